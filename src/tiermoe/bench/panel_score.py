"""Quality panels, part 2: score a server against a panel, teacher-forced.

Why teacher-forced: two servers that differ slightly diverge after the first different token,
and free-running comparisons then measure the divergence point, not the quality. Feeding the
reference's own tokens to the scored server compares the two distributions at every position.
OpenAI chat cannot be teacher-forced, so every mode uses /v1/completions with logprobs:

- `token-ids` (exact; needs ids in the panel and `return_tokens_as_token_ids` on the scored
  server): for every position i one request with prompt = prompt ids + reference ids[:i]
  (a list of ints), max_tokens 1; top-k comes back keyed by id.
- `echo`: one request per item with prompt = prompt + reference text, `echo: true`; the
  server's prompt logprobs at the reference positions (found by `text_offset`) are the forced
  distributions. Used only where the server's tokens equal the reference tokens.
- `per-position` (text): for every position one request with prompt = prompt + reference text
  up to token i, max_tokens 1. Text can re-tokenize differently from the reference's split;
  with /tokenize available each position is checked (prompt + prefix must count exactly
  i tokens more than the prompt) and misaligned positions are left out and counted.
`auto` picks token-ids, then echo, then per-position, per item. Requests run concurrently.
Logprobs are read in either answer shape: the completions one (`tokens` / `token_logprobs` /
`top_logprobs`, vLLM and tiermoe) or the chat one (`logprobs.content[j]`), which llama-server
returns from /v1/completions too (see `completion_logprobs`).

Metrics: top-1 agreement (scored argmax == reference argmax, pooled over positions); mean
KL(ref || scored) over the reference top-k (see `panel.kl_over_reference`); greedy-match
fraction (the scored server's own greedy completion: share of reference tokens matched before
the first difference, averaged over items) and the share of exact matches.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

from tiermoe.bench import client as http
from tiermoe.bench.panel import TopK, as_ids, complete, id_pairs, kl_over_reference, top_pairs, validate_panel
from tiermoe.bench.results import envelope
from tiermoe.errors import UserError

MODES = ("auto", "token-ids", "echo", "per-position")


@dataclass
class PanelScoreConfig:
    url: str
    panel: dict
    model: str | None = None
    mode: str = "auto"
    concurrency: int = 8
    greedy: bool = True
    timeout: float = http.DEFAULT_TIMEOUT_S
    api_key: str | None = None


class _Forcer:
    """Teacher-forced top-k for one server, remembering which modes it supports."""

    def __init__(self, c: httpx.AsyncClient, model: str, k: int, mode: str, concurrency: int):
        self.c, self.model, self.k, self.mode = c, model, k, mode
        self.sem = asyncio.Semaphore(max(1, concurrency))
        self.ids_ok = mode in ("auto", "token-ids")
        self.echo_ok = mode in ("auto", "echo")

    async def _one(self, prompt, **extra) -> dict:
        async with self.sem:
            return await complete(self.c, self.model, prompt, 1, self.k, **extra)

    async def token_ids(self, item: dict) -> list[TopK | None] | None:
        if not (self.ids_ok and item.get("token_ids") is not None and item.get("prompt_ids") is not None):
            return None
        ids, pids = item["token_ids"], item["prompt_ids"]
        try:
            chs = await asyncio.gather(
                *(self._one(pids + ids[:i], return_tokens_as_token_ids=True) for i in range(len(ids)))
            )
        except http.BenchHTTPError:
            chs = None
        out = []
        for ch in chs or []:
            tops = (ch.get("logprobs") or {}).get("top_logprobs") or [None]
            pairs = id_pairs(top_pairs(tops[0]))
            if pairs is None:
                chs = None
                break
            out.append(pairs)
        if chs is None:
            self.ids_ok = False  # the server does not give ids back
            return None
        return out

    async def echo(self, item: dict) -> list[TopK | None] | None:
        if not self.echo_ok:
            return None
        try:
            ch = await self._one(item["prompt"] + "".join(item["tokens"]), echo=True)
        except http.BenchHTTPError:
            self.echo_ok = False
            return None
        lp = ch.get("logprobs") or {}
        toks, offs, tops = lp.get("tokens") or [], lp.get("text_offset") or [], lp.get("top_logprobs") or []
        n, base = len(item["tokens"]), len(item["prompt"])
        if not (len(toks) == len(offs) == len(tops)) or base not in offs:
            self.echo_ok = False  # no prompt logprobs from this server
            return None
        j0 = offs.index(base)
        if toks[j0 : j0 + n] != item["tokens"]:
            return None  # this item re-tokenized differently; others may align
        forced = [top_pairs(t) for t in tops[j0 : j0 + n]]
        return forced if all(forced) else None

    async def per_position(self, item: dict) -> tuple[list[TopK | None], int, bool]:
        """(forced top-k or None where misaligned, misaligned count, whether alignment was checked)."""
        prefixes = _prefixes(item)
        chs = await asyncio.gather(*(self._one(item["prompt"] + p) for p in prefixes))
        forced: list[TopK | None] = [
            top_pairs(((ch.get("logprobs") or {}).get("top_logprobs") or [None])[0]) for ch in chs
        ]
        base = await http.count_tokens(self.c, self.model, item["prompt"], special=True)
        if base is None:
            return forced, 0, False

        async def count(p: str) -> int | None:
            async with self.sem:
                return await http.count_tokens(self.c, self.model, item["prompt"] + p, special=True)

        counts = await asyncio.gather(*(count(p) for p in prefixes))
        bad = 0
        for i, n in enumerate(counts):
            if n is not None and n != base + i:
                forced[i] = None
                bad += 1
        return forced, bad, True


def _prefixes(item: dict) -> list[str]:
    """Reference text before each completion token (offsets when recorded, else joined tokens)."""
    toks, offs, text = item["tokens"], item.get("offsets"), item.get("text") or ""
    if offs and len(offs) == len(toks) and all(0 <= o <= len(text) for o in offs):
        return [text[:o] for o in offs]
    out, acc = [], ""
    for t in toks:
        out.append(acc)
        acc += t
    return out


async def _greedy(c: httpx.AsyncClient, model: str, item: dict, use_ids: bool) -> list:
    n = max(1, len(item["tokens"]))
    if use_ids:
        ch = await complete(c, model, item["prompt_ids"], n, 1, return_tokens_as_token_ids=True)
        ids = as_ids(list((ch.get("logprobs") or {}).get("tokens") or []))
        if ids is not None:
            return ids
    ch = await complete(c, model, item["prompt"], n, 1)
    toks = (ch.get("logprobs") or {}).get("tokens")
    return list(toks) if toks else [ch.get("text") or ""]


def _match(ref: list, got: list) -> tuple[float, bool]:
    n = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    return (n / len(ref) if ref else 1.0), got[: len(ref)] == ref


def _score_item(item: dict, forced: list[TopK | None], mode: str, misaligned: int, greedy: list | None) -> dict:
    ref_top = item["top_ids"] if mode == "token-ids" else item["top"]
    agree, kls, positions = 0, [], 0
    for ref, test in zip(ref_top, forced):
        if test is None:
            continue
        positions += 1
        if ref and test and ref[0][0] == test[0][0]:
            agree += 1
        kl = kl_over_reference(ref, test)
        if kl is not None:
            kls.append(kl)
    row = {
        "id": item.get("id"),
        "mode": mode,
        "positions": positions,
        "misaligned": misaligned,
        "top1_agree": agree,
        "top1_agreement": agree / positions if positions else None,
        "mean_kl": sum(kls) / len(kls) if kls else None,
        "greedy_match_fraction": None,
        "greedy_exact": None,
        "_kls": kls,
    }
    if greedy is not None:
        if greedy and isinstance(greedy[0], int):
            row["greedy_match_fraction"], row["greedy_exact"] = _match(item["token_ids"], greedy)
        elif len(greedy) == 1 and len(item["tokens"]) != 1:  # text only: compare characters
            row["greedy_match_fraction"], row["greedy_exact"] = _match(list("".join(item["tokens"])), list(greedy[0]))
        else:
            row["greedy_match_fraction"], row["greedy_exact"] = _match(item["tokens"], greedy)
    return row


async def score_panel(cfg: PanelScoreConfig) -> dict:
    """Score the server at cfg.url against a panel (see the module docstring for the metrics)."""
    if cfg.mode not in MODES:
        raise UserError(f"--mode must be one of {', '.join(MODES)}")
    panel = cfg.panel
    validate_panel(panel)
    k = int(panel.get("top_logprobs") or 20)
    async with http.make_client(cfg.url, cfg.timeout, cfg.api_key) as c:
        model, _card = await http.resolve_model(c, cfg.model)
        f = _Forcer(c, model, k, cfg.mode, cfg.concurrency)
        rows, checked = [], True
        for item in panel["items"]:
            forced, mode, bad = await f.token_ids(item), "token-ids", 0
            if forced is None and cfg.mode == "token-ids":
                raise UserError(
                    f"{cfg.url}: token-id teacher forcing failed for item {item.get('id')} "
                    "(panel without ids, or no return_tokens_as_token_ids); use --mode auto"
                )
            if forced is None:
                forced, mode = await f.echo(item), "echo"
                if forced is None and cfg.mode == "echo":
                    raise UserError(
                        f"{cfg.url}: echo teacher forcing failed for item {item.get('id')}; use --mode auto"
                    )
            if forced is None:
                (forced, bad, was_checked), mode = await f.per_position(item), "per-position"
                checked = checked and was_checked
            greedy = await _greedy(c, model, item, mode == "token-ids") if cfg.greedy else None
            rows.append(_score_item(item, forced, mode, bad, greedy))
    positions = sum(r["positions"] for r in rows)
    agree = sum(r["top1_agree"] for r in rows)
    kls = [kl for r in rows for kl in r.pop("_kls")]
    greedy_rows = [r for r in rows if r["greedy_match_fraction"] is not None]

    def mean(key: str) -> float | None:
        return sum(r[key] for r in greedy_rows) / len(greedy_rows) if greedy_rows else None

    return envelope(
        "panel-score",
        url=cfg.url,
        model=model,
        reference={"url": panel.get("url"), "model": panel.get("model"), "created": panel.get("created")},
        teacher_forcing=sorted({r["mode"] for r in rows}),
        alignment_checked=checked,
        items=len(rows),
        positions=positions,
        positions_misaligned=sum(r["misaligned"] for r in rows),
        top1_agreement=agree / positions if positions else None,
        mean_kl=sum(kls) / len(kls) if kls else None,
        greedy_match_fraction=mean("greedy_match_fraction"),
        greedy_exact_fraction=mean("greedy_exact"),
        per_item=rows,
    )
