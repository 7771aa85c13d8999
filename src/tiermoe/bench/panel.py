"""Quality panels, part 1: record a reference's greedy completions with top-k logprobs.

A panel item holds the prompt, the reference's greedy completion as token strings with the
top-k (token, logprob) pairs at every position, and, when the server can give them, the same
completion as token ids (`token_ids`, `top_ids`) plus the prompt's ids (`prompt_ids`). Ids make
teacher forcing exact: the scored server is fed the very token sequence the reference produced,
instead of text that its tokenizer may split differently (a model can generate a non-canonical
split, e.g. "Par" + "is", that re-tokenizes as one token). Ids are requested through the
vLLM extension `return_tokens_as_token_ids` (tokens come back as "token_id:N"); prompt ids come
from /tokenize and are checked against the completion's own prompt-token count.

Scoring lives in `panel_score.py`.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import httpx

from tiermoe.bench import client as http
from tiermoe.bench.prompts import PANEL_PROMPTS
from tiermoe.bench.results import envelope
from tiermoe.errors import UserError

TopK = list[list]  # [[token, logprob], ...] best first
_ID_RE = re.compile(r"token_id:(-?\d+)")


@dataclass
class PanelMakeConfig:
    url: str
    model: str | None = None
    prompts_file: str | None = None
    max_tokens: int = 64
    top_logprobs: int = 20
    concurrency: int = 4
    token_ids: bool = True  # also record ids when the server supports return_tokens_as_token_ids
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


def top_pairs(top: dict | list | None) -> TopK:
    """Normalise one position's top logprobs (OpenAI dict or list-of-objects) to sorted pairs."""
    if not top:
        return []
    if isinstance(top, dict):
        pairs = [[str(k), float(v)] for k, v in top.items()]
    else:
        pairs = [[str(e["token"]), float(e["logprob"])] for e in top]
    pairs.sort(key=lambda p: -p[1])
    return pairs


def as_ids(tokens: list[str]) -> list[int] | None:
    """[ "token_id:5", ... ] -> [5, ...]; None unless every entry has that form."""
    out = []
    for t in tokens:
        m = _ID_RE.fullmatch(t)
        if not m:
            return None
        out.append(int(m.group(1)))
    return out


def id_pairs(pairs: TopK) -> TopK | None:
    ids = as_ids([t for t, _ in pairs])
    return None if ids is None else [[i, lp] for i, (_, lp) in zip(ids, pairs)]


async def complete(
    c: httpx.AsyncClient, model: str, prompt: str | list[int], max_tokens: int, k: int, **extra
) -> dict:
    """One greedy /v1/completions choice with top-k logprobs, in the completions shape whichever
    shape the server answered in (`completion_logprobs`); returns the whole response's choice."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": k, **extra}
    resp = await http.post_json(c, "/v1/completions", body)
    choices = resp.get("choices") or []
    if not choices:
        raise http.BenchHTTPError("/v1/completions returned no choices")
    choice = dict(choices[0])
    choice["_usage"] = resp.get("usage") or {}
    choice["logprobs"] = completion_logprobs(choice, ids=bool(extra.get("return_tokens_as_token_ids")))
    return choice


def completion_logprobs(choice: dict, ids: bool = False) -> dict:
    """A choice's logprobs in the completions shape, whichever of the two shapes the server used.

    Completions shape (vLLM, tiermoe): {"tokens", "token_logprobs", "top_logprobs",
    "text_offset"}, returned as it is. Chat shape (OpenAI chat completions; llama-server answers
    /v1/completions in it too): {"content": [{"token", "logprob", "top_logprobs": [{"token",
    "logprob"}, ...]}, ...]}, turned into tokens / token_logprobs / top_logprobs (no offsets:
    the chat shape has none, so echo forcing is not offered from it). llama-server adds each
    token's vocabulary "id"; with `ids` such a token is named "token_id:N", the way vLLM's
    return_tokens_as_token_ids names it, so exact id forcing works on that server as well.
    """
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return {}
    content = lp.get("content")
    if not isinstance(content, list):
        return lp

    def name(entry: dict):
        tok, tid = entry.get("token"), entry.get("id")
        if ids and isinstance(tid, int) and not (isinstance(tok, str) and tok.startswith("token_id:")):
            return f"token_id:{tid}"
        return tok

    entries = [e for e in content if isinstance(e, dict)]
    return {
        "tokens": [name(e) for e in entries],
        "token_logprobs": [e.get("logprob") for e in entries],
        "top_logprobs": [
            [
                {"token": name(t), "logprob": t.get("logprob")}
                for t in e.get("top_logprobs") or []
                if isinstance(t, dict)
            ]
            for e in entries
        ],
    }


async def _record_ids(c: httpx.AsyncClient, model: str, item: dict, max_tokens: int, k: int) -> None:
    """Add prompt_ids, token_ids and top_ids to `item` when the server can give them."""
    try:
        ch = await complete(c, model, item["prompt"], max_tokens, k, return_tokens_as_token_ids=True)
    except http.BenchHTTPError:
        return
    lp = ch.get("logprobs") or {}
    ids = as_ids(list(lp.get("tokens") or []))
    tops = [id_pairs(top_pairs(t)) for t in lp.get("top_logprobs") or []]
    if ids is None or len(ids) != len(item["tokens"]) or len(tops) != len(ids) or any(t is None for t in tops):
        return
    prompt_ids = await http.token_ids(c, model, item["prompt"], special=True)
    n_prompt = ch["_usage"].get("prompt_tokens")
    if prompt_ids is None or (isinstance(n_prompt, int) and n_prompt != len(prompt_ids)):
        return
    item.update(prompt_ids=prompt_ids, token_ids=ids, top_ids=tops)


async def make_panel(cfg: PanelMakeConfig) -> dict:
    """Greedy completion + top-k logprobs at every position for each prompt."""
    prompts = load_prompts(cfg.prompts_file)
    sem = asyncio.Semaphore(max(1, cfg.concurrency))
    async with http.make_client(cfg.url, cfg.timeout, cfg.api_key) as c:
        model, _card = await http.resolve_model(c, cfg.model)

        async def one(p: dict) -> dict:
            async with sem:
                ch = await complete(c, model, p["prompt"], cfg.max_tokens, cfg.top_logprobs)
                lp = ch.get("logprobs")
                if not isinstance(lp, dict) or "tokens" not in lp:
                    raise UserError(f"{cfg.url}: /v1/completions returned no logprobs; a panel needs them")
                tokens = list(lp.get("tokens") or [])
                if len(lp.get("top_logprobs") or []) != len(tokens):
                    raise UserError(f"{cfg.url}: /v1/completions returned no top_logprobs for every token")
                offsets = lp.get("text_offset")
                base = len(p["prompt"])
                ok_offsets = isinstance(offsets, list) and len(offsets) == len(tokens)
                item = {
                    "id": p["id"],
                    "prompt": p["prompt"],
                    "text": ch.get("text") or "".join(tokens),
                    "tokens": tokens,
                    "offsets": [int(o) - base for o in offsets] if ok_offsets else None,
                    "logprobs": [float(x) if x is not None else None for x in lp.get("token_logprobs") or []],
                    "top": [top_pairs(t) for t in lp["top_logprobs"]],
                    "finish_reason": ch.get("finish_reason"),
                }
                if cfg.token_ids:
                    await _record_ids(c, model, item, max(1, len(tokens)), cfg.top_logprobs)
            return item

        items = await asyncio.gather(*(one(p) for p in prompts))
    k_seen = min((len(t) for it in items for t in it["top"] if t), default=0)
    return envelope(
        "panel",
        url=cfg.url,
        model=model,
        top_logprobs=cfg.top_logprobs,
        top_logprobs_returned=k_seen,
        max_tokens=cfg.max_tokens,
        has_token_ids=bool(items) and all("token_ids" in it for it in items),
        items=list(items),
    )


def validate_panel(panel: dict, source: str = "panel") -> None:
    if str(panel.get("kind")) != "tiermoe.bench.panel" or not isinstance(panel.get("items"), list):
        raise UserError(f"{source}: not a panel made by 'tiermoe bench panel make'")
    for i, it in enumerate(panel["items"]):
        if not all(k in it for k in ("prompt", "tokens", "top")) or len(it["tokens"]) != len(it["top"]):
            raise UserError(f"{source}: item {i} is incomplete (needs prompt, tokens, top of equal length)")


def kl_over_reference(ref: TopK, test: TopK) -> float | None:
    """KL(ref || test) over the reference's top-k tokens, both renormalised over that set.

    A reference token missing from the scored top-k gets the scored k-th logprob (an upper
    bound on its true logprob), so a missing token is never scored as impossible.
    """
    if not ref or not test:
        return None
    q_map = {t: lp for t, lp in test}
    floor = min(q_map.values())
    lp_ref = [lp for _, lp in ref]
    lq = [q_map.get(t, floor) for t, _ in ref]
    zr, zq = _logsumexp(lp_ref), _logsumexp(lq)
    return sum(math.exp(a - zr) * ((a - zr) - (b - zq)) for a, b in zip(lp_ref, lq))


def _logsumexp(xs: list[float]) -> float:
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))
