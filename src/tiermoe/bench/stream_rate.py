"""Stream delivery check: does streamed text arrive as it is generated, or in a burst at the end?

A server can generate at full speed and still deliver late: one reference server awaited a
client-disconnect check after every SSE event, which let a whole decode step pass before the
next event went out; clients saw half the speed and the backlog in one flush at the end. Only
the arrival times at the client show that, so this check stamps every SSE event on arrival.

Rule (from the published protocol): over the window from the first to the last text-bearing
event, PASS if at least 40 % of the text (characters of content + reasoning) has arrived by the
window's time midpoint AND at most 10 % arrives in the final second. The window starts at the
first output rather than at the request, so a long prefill does not count as late delivery.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tiermoe.bench import client as http
from tiermoe.bench.prompts import sized_random_text, story_request
from tiermoe.bench.results import envelope

MID_FRACTION_MIN = 0.40
TAIL_SECONDS = 1.0
TAIL_FRACTION_MAX = 0.10


@dataclass
class StreamRateConfig:
    url: str
    model: str | None = None
    max_tokens: int | None = None  # None: natural end
    prompt_tokens: int = 0  # random text ahead of the story request (0: none)
    min_tokens: int = 0  # vLLM-style min_tokens: keeps an untrained model from ending early
    mid_fraction_min: float = MID_FRACTION_MIN
    tail_seconds: float = TAIL_SECONDS
    tail_fraction_max: float = TAIL_FRACTION_MAX
    bin_seconds: float = 10.0
    seed: int | None = None
    timeout: float = http.DEFAULT_TIMEOUT_S
    api_key: str | None = None


def delivery_verdict(
    arrivals: list[tuple[float, int]],
    mid_fraction_min: float = MID_FRACTION_MIN,
    tail_seconds: float = TAIL_SECONDS,
    tail_fraction_max: float = TAIL_FRACTION_MAX,
) -> dict:
    """Judge (arrival time s, characters) pairs of text-bearing events by the rule above."""
    arrivals = sorted((t, n) for t, n in arrivals if n > 0)
    total = sum(n for _, n in arrivals)
    if total == 0:
        return {"pass": False, "reason": "no text arrived", "total_chars": 0}
    t_first, t_last = arrivals[0][0], arrivals[-1][0]
    mid = (t_first + t_last) / 2
    by_mid = sum(n for t, n in arrivals if t <= mid) / total
    tail = sum(n for t, n in arrivals if t > t_last - tail_seconds) / total
    ok_mid = by_mid >= mid_fraction_min
    ok_tail = tail <= tail_fraction_max
    reasons = []
    if not ok_mid:
        reasons.append(f"only {by_mid:.0%} of the text by the time midpoint (need >= {mid_fraction_min:.0%})")
    if not ok_tail:
        reasons.append(f"{tail:.0%} of the text in the last {tail_seconds:g} s (allowed <= {tail_fraction_max:.0%})")
    return {
        "pass": ok_mid and ok_tail,
        "reason": "; ".join(reasons) or "even delivery",
        "total_chars": total,
        "window_s": t_last - t_first,
        "fraction_by_midpoint": by_mid,
        "fraction_in_tail": tail,
    }


def delivery_bins(arrivals: list[tuple[float, int]], events_tokens: float, bin_seconds: float) -> list[dict]:
    """Delivered events and estimated tokens per second in fixed bins from the first output."""
    arrivals = sorted((t, n) for t, n in arrivals if n > 0)
    if not arrivals or bin_seconds <= 0:
        return []
    t0 = arrivals[0][0]
    n_bins = int((arrivals[-1][0] - t0) // bin_seconds) + 1
    bins = [{"start_s": i * bin_seconds, "events": 0, "chars": 0} for i in range(n_bins)]
    for t, n in arrivals:
        b = bins[int((t - t0) // bin_seconds)]
        b["events"] += 1
        b["chars"] += n
    for b in bins:
        b["tok_s"] = b["events"] * events_tokens / bin_seconds
    return bins


def _timeline(arrivals: list[tuple[float, int]], max_points: int = 400) -> list[list[float]]:
    """Cumulative characters over time, thinned to at most `max_points` (for plots)."""
    out, total = [], 0
    for t, n in arrivals:
        total += n
        out.append([round(t, 4), total])
    if len(out) > max_points:
        step = len(out) / max_points
        out = [out[int(i * step)] for i in range(max_points)] + [out[-1]]
    return out


async def run_stream_rate(cfg: StreamRateConfig) -> dict:
    rng = random.Random(cfg.seed)
    async with http.make_client(cfg.url, cfg.timeout, cfg.api_key) as c:
        model, _card = await http.resolve_model(c, cfg.model)
        prompt = story_request(rng.randrange(8))
        if cfg.prompt_tokens > 0:

            async def count(text: str) -> int | None:
                return await http.count_tokens(c, model, text)

            text, _n, _src = await sized_random_text(rng, cfg.prompt_tokens, count)
            prompt = f"{text}\n\nIgnore the words above. {prompt}"
        body = http.chat_payload(model, [{"role": "user", "content": prompt}], cfg.max_tokens)
        if cfg.min_tokens:
            body["min_tokens"] = cfg.min_tokens
        res = await http.stream(c, "/v1/chat/completions", body)
    arrivals = [(e.t, len(e.text)) for e in res.events if e.text]
    verdict = delivery_verdict(arrivals, cfg.mid_fraction_min, cfg.tail_seconds, cfg.tail_fraction_max)
    return envelope(
        "stream-rate",
        url=cfg.url,
        model=model,
        config=http.settings(cfg),
        verdict="PASS" if verdict["pass"] else "FAIL",
        **{k: v for k, v in verdict.items() if k != "pass"},
        ttft_s=res.ttft,
        completion_tokens=res.completion_tokens,
        events=len(arrivals),
        per_stream_tok_s=res.per_stream_rate(),
        finish_reason=res.finish_reason,
        bins=delivery_bins(arrivals, res.tokens_per_event(), cfg.bin_seconds),
        timeline=_timeline(arrivals),
    )
