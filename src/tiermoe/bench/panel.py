"""Quality panels: record a reference's greedy completions with top-k logprobs, score another
server against them teacher-forced.

Why teacher-forced: two servers that differ slightly diverge after the first different token,
and free-running comparisons then measure the divergence point, not the quality. Feeding the
reference's own tokens to the scored server compares the two distributions at every position.

How teacher forcing is done over plain HTTP (OpenAI chat cannot be teacher-forced):
- `echo` mode: one /v1/completions request per item with prompt = prompt + reference text,
  `echo: true`, `logprobs: k`, `max_tokens: 1`; the server returns top-k logprobs for every
  prompt token (vLLM-style prompt logprobs). The positions are found by `text_offset`; the item
  falls back to per-position mode if the server tokenized the text differently.
- `per-position` mode: for every position i, one /v1/completions request with
  prompt = prompt + reference text up to token i, `max_tokens: 1`, `logprobs: k`, greedy; the
  first generated token's top-k is the distribution at i. Requests run concurrently. Works on
  any server whose /v1/completions returns logprobs.
`auto` tries echo on the first item and keeps it while it aligns.

Metrics: top-1 agreement (the scored argmax equals the reference argmax, pooled over all
positions); mean KL(ref || scored) over the reference top-k, both renormalised over those k
tokens (a token missing from the scored top-k gets the scored k-th logprob, an upper bound);
greedy-match fraction (the scored server's own greedy completion: share of reference tokens
matched before the first difference, averaged over items) and the share of exact matches.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from pathlib import Path

import httpx

from tiermoe.bench import client as http
from tiermoe.bench.prompts import PANEL_PROMPTS
from tiermoe.bench.results import envelope
from tiermoe.errors import UserError

TopK = list[list]  # [[token, logprob], ...] best first


@dataclass
class PanelMakeConfig:
    url: str
    model: str | None = None
    prompts_file: str | None = None
    max_tokens: int = 64
    top_logprobs: int = 20
    concurrency: int = 4
    timeout: float = http.DEFAULT_TIMEOUT_S
    api_key: str | None = None


@dataclass
class PanelScoreConfig:
    url: str
    panel: dict
    model: str | None = None
    mode: str = "auto"  # auto | echo | per-position
    concurrency: int = 8
    greedy: bool = True
    timeout: float = http.DEFAULT_TIMEOUT_S
    api_key: str | None = None


def load_prompts(path: str | None) -> list[dict]:
    """[{"id", "prompt"}] from a .json list or .jsonl file (strings or {"prompt": ...}); built-ins when None."""
    if path is None:
        return [{"id": f"builtin-{i}", "prompt": p} for i, p in enumerate(PANEL_PROMPTS)]
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise UserError(f"{path}: cannot read prompts file ({exc.strerror or exc})") from exc
    try:
        if path.endswith(".jsonl"):
            raw = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            raw = json.loads(text)
    except ValueError as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, list) or not raw:
        raise UserError(f"{path}: expected a non-empty list of prompts")
    out = []
    for i, entry in enumerate(raw):
        if isinstance(entry, str):
            entry = {"prompt": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str) or not entry["prompt"]:
            raise UserError(f"{path}: entry {i} needs a non-empty 'prompt' string")
        out.append({"id": str(entry.get("id", f"p{i}")), "prompt": entry["prompt"]})
    return out


def _top_pairs(top: dict | list | None) -> TopK:
    """Normalise one position's top logprobs (OpenAI dict or list-of-objects) to sorted pairs."""
    if not top:
        return []
    if isinstance(top, dict):
        pairs = [[str(k), float(v)] for k, v in top.items()]
    else:
        pairs = [[str(e["token"]), float(e["logprob"])] for e in top]
    pairs.sort(key=lambda p: -p[1])
    return pairs


async def _complete(c: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, k: int, **extra) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": k, **extra}
    resp = await http.post_json(c, "/v1/completions", body)
    choices = resp.get("choices") or []
    if not choices:
        raise http.BenchHTTPError("/v1/completions returned no choices")
    return choices[0]


async def make_panel(cfg: PanelMakeConfig) -> dict:
    """Greedy completion + top-k logprobs at every position for each prompt."""
    prompts = load_prompts(cfg.prompts_file)
    sem = asyncio.Semaphore(max(1, cfg.concurrency))
    async with http.make_client(cfg.url, cfg.timeout, cfg.api_key) as c:
        model, _card = await http.resolve_model(c, cfg.model)

        async def one(p: dict) -> dict:
            async with sem:
                ch = await _complete(c, model, p["prompt"], cfg.max_tokens, cfg.top_logprobs)
            lp = ch.get("logprobs")
            if not isinstance(lp, dict) or "tokens" not in lp:
                raise UserError(f"{cfg.url}: /v1/completions returned no logprobs; a panel needs them")
            tokens = list(lp.get("tokens") or [])
            if len(lp.get("top_logprobs") or []) != len(tokens):
                raise UserError(f"{cfg.url}: /v1/completions returned no top_logprobs for every token")
            offsets = lp.get("text_offset")
            base = len(p["prompt"])
            rel = [int(o) - base for o in offsets] if isinstance(offsets, list) and len(offsets) == len(tokens) else None
            return {
                "id": p["id"],
                "prompt": p["prompt"],
                "text": ch.get("text") or "".join(tokens),
                "tokens": tokens,
                "offsets": rel,
                "logprobs": [float(x) if x is not None else None for x in lp.get("token_logprobs") or []],
                "top": [_top_pairs(t) for t in lp["top_logprobs"]],
                "finish_reason": ch.get("finish_reason"),
            }

        items = await asyncio.gather(*(one(p) for p in prompts))
    k_seen = min((len(t) for it in items for t in it["top"] if t), default=0)
    return envelope(
        "panel",
        url=cfg.url,
        model=model,
        top_logprobs=cfg.top_logprobs,
        top_logprobs_returned=k_seen,
        max_tokens=cfg.max_tokens,
        items=list(items),
    )


def validate_panel(panel: dict, source: str = "panel") -> None:
    if str(panel.get("kind")) != "tiermoe.bench.panel" or not isinstance(panel.get("items"), list):
        raise UserError(f"{source}: not a panel made by 'tiermoe bench panel make'")
    for i, it in enumerate(panel["items"]):
        if not all(k in it for k in ("prompt", "tokens", "top")) or len(it["tokens"]) != len(it["top"]):
            raise UserError(f"{source}: item {i} is incomplete (needs prompt, tokens, top of equal length)")


def kl_over_reference(ref: TopK, test: TopK) -> float | None:
    """KL(ref || test) over the reference's top-k tokens, both renormalised over that set."""
    if not ref or not test:
        return None
    q_map = dict((t, lp) for t, lp in test)
    floor = min(q_map.values())
    lp_ref = [lp for _, lp in ref]
    lq = [q_map.get(t, floor) for t, _ in ref]
    zr = _logsumexp(lp_ref)
    zq = _logsumexp(lq)
    return sum(math.exp(a - zr) * ((a - zr) - (b - zq)) for a, b in zip(lp_ref, lq))


def _logsumexp(xs: list[float]) -> float:
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))


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


async def _forced_echo(c, model: str, item: dict, k: int) -> list[TopK] | None:
    """Teacher-forced top-k by one echo request; None when the positions cannot be aligned."""
    ref_text = "".join(item["tokens"])
    full = item["prompt"] + ref_text
    try:
        ch = await _complete(c, model, full, 1, k, echo=True)
    except http.BenchHTTPError:
        return None
    lp = ch.get("logprobs") or {}
    toks, offs, tops = lp.get("tokens") or [], lp.get("text_offset") or [], lp.get("top_logprobs") or []
    if not (len(toks) == len(offs) == len(tops)):
        return None
    base = len(item["prompt"])
    try:
        j0 = offs.index(base)
    except ValueError:
        return None
    n = len(item["tokens"])
    if toks[j0 : j0 + n] != item["tokens"]:
        return None
    forced = [_top_pairs(t) for t in tops[j0 : j0 + n]]
    return forced if all(forced) else None


async def _forced_per_position(c, model: str, item: dict, k: int, sem: asyncio.Semaphore) -> list[TopK]:
    async def at(prefix: str) -> TopK:
        async with sem:
            ch = await _complete(c, model, item["prompt"] + prefix, 1, k)
        tops = (ch.get("logprobs") or {}).get("top_logprobs") or [None]
        return _top_pairs(tops[0])

    return list(await asyncio.gather(*(at(p) for p in _prefixes(item))))


async def score_panel(cfg: PanelScoreConfig) -> dict:
    """Score the server at cfg.url against a panel (see module docstring for the metrics)."""
    panel = cfg.panel
    validate_panel(panel)
    k = int(panel.get("top_logprobs") or 20)
    sem = asyncio.Semaphore(max(1, cfg.concurrency))
    echo_ok = cfg.mode in ("auto", "echo")
    async with http.make_client(cfg.url, cfg.timeout, cfg.api_key) as c:
        model, _card = await http.resolve_model(c, cfg.model)
        rows = []
        for item in panel["items"]:
            forced, mode = None, "per-position"
            if echo_ok:
                forced = await _forced_echo(c, model, item, k)
                if forced is not None:
                    mode = "echo"
                elif cfg.mode == "echo":
                    raise UserError(f"{cfg.url}: echo teacher forcing failed for item {item.get('id')}; use --mode auto")
                else:
                    echo_ok = False  # the server does not align; stop trying
            if forced is None:
                forced = await _forced_per_position(c, model, item, k, sem)
            greedy = await _greedy(c, model, item) if cfg.greedy else None
            rows.append(_score_item(item, forced, mode, greedy))
    positions = sum(r["positions"] for r in rows)
    agree = sum(r["top1_agree"] for r in rows)
    kls = [kl for r in rows for kl in r.pop("_kls")]
    greedy_rows = [r for r in rows if r["greedy_match_fraction"] is not None]
    return envelope(
        "panel-score",
        url=cfg.url,
        model=model,
        reference={"url": panel.get("url"), "model": panel.get("model"), "created": panel.get("created")},
        teacher_forcing=sorted({r["mode"] for r in rows}),
        items=len(rows),
        positions=positions,
        top1_agreement=agree / positions if positions else None,
        mean_kl=sum(kls) / len(kls) if kls else None,
        greedy_match_fraction=(
            sum(r["greedy_match_fraction"] for r in greedy_rows) / len(greedy_rows) if greedy_rows else None
        ),
        greedy_exact_fraction=(
            sum(r["greedy_exact"] for r in greedy_rows) / len(greedy_rows) if greedy_rows else None
        ),
        per_item=rows,
    )


async def _greedy(c, model: str, item: dict) -> list[str]:
    ch = await _complete(c, model, item["prompt"], max(1, len(item["tokens"])), 1)
    toks = (ch.get("logprobs") or {}).get("tokens")
    return list(toks) if toks else [ch.get("text") or ""]


def _score_item(item: dict, forced: list[TopK], mode: str, greedy: list[str] | None) -> dict:
    agree, kls = 0, []
    for ref, test in zip(item["top"], forced):
        ref = [list(p) for p in ref]
        if ref and test and ref[0][0] == test[0][0]:
            agree += 1
        kl = kl_over_reference(ref, test)
        if kl is not None:
            kls.append(kl)
    row = {
        "id": item.get("id"),
        "mode": mode,
        "positions": len(forced),
        "top1_agree": agree,
        "top1_agreement": agree / len(forced) if forced else None,
        "mean_kl": sum(kls) / len(kls) if kls else None,
        "greedy_match_fraction": None,
        "greedy_exact": None,
        "_kls": kls,
    }
    if greedy is not None:
        ref_toks = item["tokens"]
        if len(greedy) == 1 and len(ref_toks) != 1:  # server gave text only: compare characters
            ref_text, text = "".join(ref_toks), greedy[0]
            n = next((i for i, (a, b) in enumerate(zip(ref_text, text)) if a != b), min(len(ref_text), len(text)))
            row["greedy_match_fraction"] = n / len(ref_text) if ref_text else 1.0
            row["greedy_exact"] = text == ref_text
        else:
            n = next((i for i, (a, b) in enumerate(zip(ref_toks, greedy)) if a != b), min(len(ref_toks), len(greedy)))
            row["greedy_match_fraction"] = n / len(ref_toks) if ref_toks else 1.0
            row["greedy_exact"] = greedy[: len(ref_toks)] == ref_toks
    return row
