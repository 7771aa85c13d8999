"""Speed sweep: prefill tokens/s and decode tokens/s at C = 1, 2, 4, measured over HTTP.

Protocol (the one the reference systems publish, so numbers compare):
- prefill: for each size, the median of `reps` fresh random-text prompts (a new nonce each, so
  no prefix cache can help), streamed with max_tokens 1; rate = prompt tokens / time to first
  token. Prompt tokens are the server's own usage count when it reports one, else /tokenize.
- decode: C simultaneous greedy chat completions (story requests) run to their natural end
  (or to --max-tokens); aggregate = all completion tokens / wall time of the round, per-stream
  = (n - 1) / (last token time - first token time), averaged over the streams.
- C1 after a long prompt: one stream whose prompt is random text of the largest prefill size
  followed by the story request (decode speed with a long KV behind it).
- tiers: around each decode round, /stats is read; each decode row records the slot hits and
  misses per decode token of its rounds (and the CPU lane's experts), and, where the server was given
  routing statistics, the slot hits a static placement by them would get: a tok/s figure always
  travels with how the tiers served it (a random model's own routing keeps hitting the same few
  experts, a real model's spreads over many: the rate alone says nothing).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import httpx

from tiermoe.bench import client as http
from tiermoe.bench.prompts import random_text, sized_random_text, story_request
from tiermoe.bench.results import envelope, median


@dataclass
class SweepConfig:
    url: str
    model: str | None = None
    prefill_sizes: list[int] = field(default_factory=lambda: [8192, 32768])
    reps: int = 3
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4])
    decode_reps: int = 1
    max_tokens: int | None = None  # None: natural end
    long_prompt_tokens: int | None = None  # None: the largest prefill size; 0: skip
    prefill_endpoint: str = "auto"  # auto | completions | chat
    decode_prompts: str = "story"  # story | random (random words: another mix of routed experts)
    seed: int | None = None
    timeout: float = http.DEFAULT_TIMEOUT_S
    api_key: str | None = None


async def _prefill_once(
    c: httpx.AsyncClient, model: str, text: str, endpoint: str
) -> http.StreamResult:
    if endpoint == "completions":
        body = {"model": model, "prompt": text, "max_tokens": 1, "temperature": 0}
        return await http.stream(c, "/v1/completions", body)
    body = http.chat_payload(model, [{"role": "user", "content": text}], max_tokens=1)
    return await http.stream(c, "/v1/chat/completions", body)


async def _pick_endpoint(c: httpx.AsyncClient, model: str, wanted: str) -> str:
    """'completions' when the server has /v1/completions (no chat template in the count)."""
    if wanted != "auto":
        return wanted
    try:
        resp = await c.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 1})
    except httpx.HTTPError:
        return "chat"
    return "completions" if resp.status_code < 400 else "chat"


def _cached(usage: dict | None) -> int | None:
    details = (usage or {}).get("prompt_tokens_details") or {}
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return int(value) if isinstance(value, int) else None


async def run_prefill(
    c: httpx.AsyncClient, model: str, sizes: list[int], reps: int, endpoint: str, rng: random.Random
) -> list[dict]:
    async def count(text: str) -> int | None:
        return await http.count_tokens(c, model, text)

    rows = []
    for size in sizes:
        runs = []
        for _ in range(reps):
            text, counted, source = await sized_random_text(rng, size, count)
            res = await _prefill_once(c, model, text, endpoint)
            ttft = res.ttft
            tokens = res.prompt_tokens
            token_source = "usage"
            if tokens is None:
                tokens, token_source = counted, source
            runs.append(
                {
                    "prompt_tokens": tokens,
                    "token_count_source": token_source,
                    "ttft_s": ttft,
                    "tok_s": tokens / ttft if ttft else None,
                    "cached_tokens": _cached(res.usage),
                }
            )
        rows.append(
            {
                "target_tokens": size,
                "runs": runs,
                "prompt_tokens": median([r["prompt_tokens"] for r in runs]),
                "median_ttft_s": median([r["ttft_s"] for r in runs]),
                "median_tok_s": median([r["tok_s"] for r in runs]),
            }
        )
    return rows


def _stream_row(res: http.StreamResult) -> dict:
    return {
        "completion_tokens": res.completion_tokens,
        "prompt_tokens": res.prompt_tokens,
        "finish_reason": res.finish_reason,
        "ttft_s": res.ttft,
        "duration_s": res.t_end,
        "per_stream_tok_s": res.per_stream_rate(),
        "token_count_source": "usage" if res.usage and "completion_tokens" in res.usage else "events",
    }


def decode_prompt(kind: str, index: int, rng: random.Random) -> str:
    """The request of decode stream `index`: a story request, or (kind "random") 60 random words
    to continue, which route other experts than stories do."""
    if kind == "random":
        return f"Continue this list of words: {random_text(rng, 60)}"
    return story_request(index)


async def run_decode_round(
    c: httpx.AsyncClient, model: str, conc: int, max_tokens: int | None, first_topic: int = 0,
    prompts: str = "story", rng: random.Random | None = None,
) -> dict:
    """C simultaneous greedy streams (story requests or random words); aggregate and per-stream
    decode rates."""
    rng = rng or random.Random(first_topic)
    bodies = [
        http.chat_payload(model, [{"role": "user", "content": decode_prompt(prompts, first_topic + i, rng)}],
                          max_tokens)
        for i in range(conc)
    ]
    t0 = time.perf_counter()
    results = await asyncio.gather(*(http.stream(c, "/v1/chat/completions", b) for b in bodies))
    wall = time.perf_counter() - t0
    total = sum(r.completion_tokens for r in results)
    rates = [r.per_stream_rate() for r in results]
    rates = [r for r in rates if r is not None]
    return {
        "wall_s": wall,
        "completion_tokens": total,
        "aggregate_tok_s": total / wall if wall > 0 else None,
        "per_stream_tok_s": sum(rates) / len(rates) if rates else None,
        "streams": [_stream_row(r) for r in results],
    }


async def expert_counters(c: httpx.AsyncClient) -> dict | None:
    """The server's cumulative expert-tier counters (None: no /stats, or a model without a store).

    Read on a connection of its own: a stream sent on a keep-alive connection right after a plain
    GET on it arrived all at once at its end (uvicorn, seen with the scripted test server), which
    would make the next round's per-stream rate meaningless.
    """
    try:
        async with httpx.AsyncClient(base_url=c.base_url, timeout=10.0, headers=c.headers) as own:
            stats = await http.get_json(own, "/stats")
    except http.BenchHTTPError:
        return None
    return tier_counters((stats.get("engine") or {}).get("experts") if isinstance(stats, dict) else None)


def tier_counters(ex: dict | None) -> dict | None:
    """The cumulative counters tiers_per_token differences, from an engine's `experts` stats (None: a model
    without a store). /stats over HTTP here, LLMEngine.stats() in `bench decode`."""
    if not isinstance(ex, dict) or "slots" not in ex:
        return None
    return {"decode_tokens": ex.get("decode_tokens", 0), "slot_hits": ex["slots"].get("hits", 0),
            "slot_misses": ex["slots"].get("misses", 0), "lane_experts": (ex.get("cpu_lane") or {}).get("experts", 0),
            "routing_replay": ex.get("routing_replay"), "static_bound": ex["slots"].get("static_bound")}


def describe_tiers(tiers: dict | None) -> str:
    """"; per token: H slot hits (static placement by the statistics: B), M misses, L on the CPU lane" ("" without
    counters): how the tiers served a tok/s figure, printed beside it."""
    if not tiers:
        return ""
    bound = tiers.get("static_bound")  # absent in files of older sweeps
    return (f"; per token: {tiers['slot_hits']:.1f} slot hits"
            + (f" (static placement by the statistics: {bound:.1f})" if bound is not None else "")
            + f", {tiers['slot_misses']:.1f} misses"
            + (f", {tiers['lane_experts']:.1f} on the CPU lane" if tiers["lane_experts"] else ""))


def tiers_per_token(before: dict | None, after: dict | None) -> dict | None:
    """Slot hits / misses (and CPU-lane experts) per decode token between two counter readings."""
    if before is None or after is None:
        return None
    tokens = after["decode_tokens"] - before["decode_tokens"]
    if tokens <= 0:
        return None
    per = {k: (after[k] - before[k]) / tokens for k in ("slot_hits", "slot_misses", "lane_experts")}
    per["decode_tokens"] = tokens
    per["routing_replay"] = after.get("routing_replay")
    per["static_bound"] = after.get("static_bound")  # slot hits a token of the statistics' static placement
    return per


async def run_long_prompt_c1(
    c: httpx.AsyncClient, model: str, n_tokens: int, max_tokens: int | None, rng: random.Random
) -> dict:
    async def count(text: str) -> int | None:
        return await http.count_tokens(c, model, text)

    text, counted, source = await sized_random_text(rng, n_tokens, count)
    prompt = f"{text}\n\nIgnore the words above. {story_request(3)}"
    body = http.chat_payload(model, [{"role": "user", "content": prompt}], max_tokens)
    res = await http.stream(c, "/v1/chat/completions", body)
    row = _stream_row(res)
    row["target_prompt_tokens"] = n_tokens
    if row["prompt_tokens"] is None:
        row["prompt_tokens"], row["prompt_token_source"] = counted, source
    return row


async def run_sweep(cfg: SweepConfig) -> dict:
    """Run the whole sweep and return its result dict (see module docstring)."""
    rng = random.Random(cfg.seed)
    async with http.make_client(cfg.url, cfg.timeout, cfg.api_key) as c:
        model, card = await http.resolve_model(c, cfg.model)
        endpoint = await _pick_endpoint(c, model, cfg.prefill_endpoint)
        prefill = await run_prefill(c, model, cfg.prefill_sizes, cfg.reps, endpoint, rng)
        decode = []
        for conc in cfg.concurrency:
            before = await expert_counters(c)
            rounds = [
                await run_decode_round(c, model, conc, cfg.max_tokens, first_topic=r * conc,
                                       prompts=cfg.decode_prompts, rng=rng)
                for r in range(cfg.decode_reps)
            ]
            decode.append(
                {
                    "concurrency": conc,
                    "aggregate_tok_s": median([r["aggregate_tok_s"] for r in rounds]),
                    "per_stream_tok_s": median([r["per_stream_tok_s"] for r in rounds]),
                    "tiers_per_token": tiers_per_token(before, await expert_counters(c)),
                    "rounds": rounds,
                }
            )
        long_tokens = cfg.long_prompt_tokens if cfg.long_prompt_tokens is not None else max(cfg.prefill_sizes)
        long_c1 = await run_long_prompt_c1(c, model, long_tokens, cfg.max_tokens, rng) if long_tokens > 0 else None
    return envelope(
        "sweep",
        url=cfg.url,
        model=model,
        max_model_len=http.max_model_len(card),
        config={
            "prefill_sizes": cfg.prefill_sizes,
            "reps": cfg.reps,
            "concurrency": cfg.concurrency,
            "decode_reps": cfg.decode_reps,
            "max_tokens": cfg.max_tokens,
            "long_prompt_tokens": long_tokens,
            "prefill_endpoint": endpoint,
            "decode_prompts": cfg.decode_prompts,
            "seed": cfg.seed,
        },
        prefill=prefill,
        decode=decode,
        long_prompt_c1=long_c1,
    )


def summary_lines(result: dict) -> list[str]:
    """Human-readable lines for the terminal."""

    def f(x: float | None, nd: int = 1) -> str:
        return "-" if x is None else f"{x:,.{nd}f}"

    lines = [f"model {result['model']} at {result['url']}"]
    for row in result["prefill"]:
        lines.append(
            f"prefill {row['target_tokens']:>6} tok (actual {f(row['prompt_tokens'], 0)}): "
            f"{f(row['median_tok_s'])} tok/s, TTFT {f(row['median_ttft_s'], 3)} s"
        )
    for row in result["decode"]:
        where = describe_tiers(row.get("tiers_per_token"))
        lines.append(
            f"decode C{row['concurrency']}: aggregate {f(row['aggregate_tok_s'])} tok/s, "
            f"per-stream {f(row['per_stream_tok_s'])} tok/s{where}"
        )
    lc = result.get("long_prompt_c1")
    if lc:
        lines.append(
            f"decode C1 after {f(lc['prompt_tokens'], 0)}-token prompt: {f(lc['per_stream_tok_s'])} tok/s "
            f"(TTFT {f(lc['ttft_s'], 3)} s)"
        )
    return lines
