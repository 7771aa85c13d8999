"""The live stats stream behind the web dashboard: compact snapshots once a second over SSE.

`GET /v1/stats/stream` (web_routes.py) sends `event: stats` once a second and `event: heat`
(the per-layer expert heat map) every few seconds when it changed. One sampler task per app
serves every open stream: it runs only while at least one client listens, takes one engine
stats() snapshot per tick (between engine steps, as /stats does) and turns the cumulative
counters into rates from the difference between two snapshots, so a dashboard never polls the
whole /stats document and ten open dashboards cost the engine no more than one.

Snapshot fields (null where the engine has nothing to say: no expert tiers, no decode tokens
in the interval, no CPU lane):
  t, dt                   time (Unix s) and seconds since the previous snapshot
  tok_s, prompt_tok_s     generated / prompt tokens per second over the interval
  ttft_p50_s, ttft_p90_s, itl_p50_s   over the most recent requests (metrics.py windows)
  running, waiting, kv_usage, requests, errors
  decode_tokens           decode tokens in the interval
  hits_per_token          {slots, host, disk}: expert uses per decode token by tier
  hits_per_token_total    the same since start-up (the engine's own averages)
  bytes_per_token         {moved, disk, cpu_lane}: bytes per decode token that crossed to the
                          compute device (PCIe on a GPU), were read from disk, were read from
                          RAM by the CPU lane
  cpu_lane_busy           share of the interval the CPU lane's workers were computing
  floor_fraction          decode rate x the engine's floor (s per token), where the engine
                          reports one as `decode_floor_s_per_token`; none does today, so null

The same snapshots, taken every STATS_LOG_INTERVAL_S by `ThroughputLog`, make the server log's
periodic throughput line (access_log.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import AsyncIterator

from tiermoe.server.access_log import STATS_LOG_INTERVAL_S, stats_log
from tiermoe.server.metrics import expert_tiers
from tiermoe.server.streaming import sse

log = logging.getLogger("tiermoe.server")

STATS_INTERVAL_S = 1.0
HEAT_INTERVAL_S = 5.0


def _num(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def cumulative(engine: dict, server: dict, now: float) -> dict:
    """The monotonic counters of one engine + server snapshot that rates are computed from."""
    experts = _dict(engine.get("experts"))
    decode = _num(experts.get("decode_tokens")) or 0.0
    per = _dict(experts.get("per_decode_token"))
    tok = max(1.0, decode)  # the store divides by max(1, decode_tokens)
    record = _num(experts.get("record_bytes")) or 0.0
    lane = _dict(experts.get("cpu_lane"))
    generated = _num(engine.get("generation_tokens"))  # LLMEngine
    if generated is None:
        generated = _num(engine.get("generated_tokens"))  # the scripted core's name
    return {
        "t": now, "generated": generated, "prompt": _num(engine.get("prompt_tokens")), "decode": decode,
        "tiers": bool(expert_tiers(engine)), "record_bytes": record,
        "slots": (_num(per.get("slots_hits")) or 0.0) * tok, "host": (_num(per.get("host_hits")) or 0.0) * tok,
        "disk": (_num(per.get("disk_reads")) or 0.0) * tok, "moved": (_num(per.get("bytes_moved")) or 0.0) * tok,
        "lane_experts": _num(lane.get("decode_experts")), "lane_busy_s": _num(lane.get("busy_s")),
        "lane_workers": _num(lane.get("workers")) or 1.0,
        "floor_s": _num(engine.get("decode_floor_s_per_token")),
    }


def _short(value):
    """Floats to 4 significant digits, recursively: the stream is read by eyes and charts."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: _short(v) for k, v in value.items()}
    return value


def _rate(prev: dict | None, cur: dict, key: str, per: float | None) -> float | None:
    if prev is None or not per or cur[key] is None or prev[key] is None:
        return None
    return max(0.0, cur[key] - prev[key]) / per


def compact(prev: dict | None, cur: dict, engine: dict, server: dict) -> dict:
    """One `stats` event from two `cumulative` snapshots (prev None: no rates yet)."""
    dt = cur["t"] - prev["t"] if prev is not None else None
    dt = dt if dt and dt > 0 else None
    decode = cur["decode"] - prev["decode"] if prev is not None else 0.0
    per_tok = decode if decode > 0 else None
    hits = bytes_ = None
    if cur["tiers"] and per_tok:
        hits = {tier: _rate(prev, cur, tier, per_tok) for tier in ("slots", "host", "disk")}
        lane_bytes = _rate(prev, cur, "lane_experts", per_tok)
        bytes_ = {"moved": _rate(prev, cur, "moved", per_tok),
                  "disk": hits["disk"] * cur["record_bytes"] if hits["disk"] is not None else None,
                  "cpu_lane": lane_bytes * cur["record_bytes"] if lane_bytes is not None else None}
    busy = _rate(prev, cur, "lane_busy_s", dt)
    tok_s = _rate(prev, cur, "generated", dt)
    decode_rate = decode / dt if dt and decode > 0 else None
    ttft, itl = _dict(server.get("ttft_s")), _dict(server.get("inter_token_latency_s"))
    return {"t": round(cur["t"], 3), **_short({
        "dt": round(dt, 3) if dt else None,
        "tok_s": tok_s, "prompt_tok_s": _rate(prev, cur, "prompt", dt),
        "ttft_p50_s": ttft.get("p50"), "ttft_p90_s": ttft.get("p90"), "itl_p50_s": itl.get("p50"),
        "running": server.get("requests_running"), "waiting": server.get("requests_waiting"),
        "kv_usage": _num(engine.get("kv_usage")), "requests": server.get("requests"), "errors": server.get("errors"),
        "decode_tokens": decode if prev is not None else None,
        "hits_per_token": hits, "bytes_per_token": bytes_, "hits_per_token_total": _since_start(cur),
        "cpu_lane_busy": busy / cur["lane_workers"] if busy is not None else None,
        "floor_fraction": cur["floor_s"] * decode_rate if cur["floor_s"] and decode_rate else None,
    })}


def _since_start(cur: dict) -> dict | None:
    """Expert uses per decode token by tier since start-up (what the tiles show while idle)."""
    if not cur["tiers"] or cur["decode"] <= 0:
        return None
    return {tier: cur[tier] / cur["decode"] for tier in ("slots", "host", "disk")}


class LiveStats:
    """The app's one sampler and the state every open stream reads (one event loop: no locks)."""

    def __init__(self, ctx, interval_s: float = STATS_INTERVAL_S, heat_interval_s: float = HEAT_INTERVAL_S):
        self.ctx = ctx
        self.interval_s, self.heat_interval_s = interval_s, heat_interval_s
        self.listeners = 0
        self.stopping = False  # set when the server starts to exit: every stream ends within a tick
        self.stats: dict | None = None
        self.heat: dict | None = None
        self.stats_seq = self.heat_seq = 0
        self._task: asyncio.Task | None = None
        self._tick: asyncio.Event | None = None

    def stop(self) -> None:
        """End every open stream (the server is exiting; uvicorn would wait for them)."""
        self.stopping = True
        if self._tick is not None:
            self._tick.set()

    def _ended(self) -> bool:
        engine = self.ctx.engine
        return self.stopping or engine.draining or not engine.alive

    async def events(self) -> AsyncIterator[str]:
        """One client's stream: the latest snapshot at once, then each new one as it is taken."""
        self.listeners += 1
        if self._task is None or self._task.done():
            self._tick = asyncio.Event()
            self._task = asyncio.ensure_future(self._sample_loop())
        seen_stats = seen_heat = -1
        try:
            while not self._ended():
                tick = self._tick
                if self.stats is not None and seen_stats != self.stats_seq:
                    seen_stats = self.stats_seq
                    yield sse(self.stats, event="stats")
                if self.heat is not None and seen_heat != self.heat_seq:
                    seen_heat = self.heat_seq
                    yield sse(self.heat, event="heat")
                try:
                    await asyncio.wait_for(tick.wait(), timeout=self.interval_s * 3)
                except asyncio.TimeoutError:
                    yield ": waiting for the engine\n\n"  # a comment line keeps proxies from timing out
        finally:
            self.listeners -= 1

    async def _sample_loop(self) -> None:
        prev, next_heat, heat_text = None, 0.0, None
        while self.listeners > 0 and not self._ended():
            try:
                cur = await self._sample(prev)
                if time.monotonic() >= next_heat:
                    next_heat = time.monotonic() + self.heat_interval_s
                    heat = await self._heat()
                    text = json.dumps(heat, sort_keys=True)
                    # a map once available stays up while the engine is too busy to answer in time
                    lost = not heat["available"] and self.heat is not None and self.heat["available"]
                    if text != heat_text and not lost:
                        heat_text, self.heat = text, heat
                        self.heat_seq += 1
                prev = cur
            except Exception:  # an odd engine snapshot must not end the dashboards' stream for good
                log.exception("live stats sample failed")
            self._publish()
            await asyncio.sleep(self.interval_s)
        self._publish()

    async def _sample(self, prev: dict | None) -> dict:
        """Take one engine + server snapshot, publish its `stats` event; its counters for the next."""
        engine = self.ctx.engine
        engine_snap = await engine.stats()
        running = engine.num_unfinished - engine.num_waiting
        server = self.ctx.metrics.summary(engine_snap, running, engine.num_waiting)
        cur = cumulative(engine_snap, server, time.time())
        self.stats = compact(prev, cur, engine_snap, server)
        self.stats_seq += 1
        return cur

    async def _heat(self) -> dict:
        heat = await self.ctx.engine.expert_heat()
        if not isinstance(heat, dict):
            return {"available": False, "reason": "this engine keeps no per-expert counts (resident experts, "
                                                  "or no expert store)"}
        return {"available": True, **heat}

    def _publish(self) -> None:
        tick, self._tick = self._tick, asyncio.Event()
        if tick is not None:
            tick.set()


def throughput_line(snap: dict) -> str:
    """vLLM's periodic line from one live_stats.compact snapshot."""
    def num(key: str) -> float:
        return snap.get(key) or 0.0

    line = (f"Avg prompt throughput: {num('prompt_tok_s'):.1f} tokens/s, Avg generation throughput: "
            f"{num('tok_s'):.1f} tokens/s, Running: {int(num('running'))} reqs, Waiting: {int(num('waiting'))} reqs")
    if snap.get("kv_usage") is not None:
        line += f", KV cache usage: {100 * snap['kv_usage']:.1f}%"
    hits = snap.get("hits_per_token")
    if hits:
        host, disk = hits.get("host") or 0.0, hits.get("disk") or 0.0
        line += (f", Experts per decode token: slot hits {hits.get('slots') or 0:.2f}, slot misses "
                 f"{host + disk:.2f} (host {host:.2f}, disk {disk:.2f})")
    return line


class ThroughputLog:
    """The periodic line (module doc): one task per app, started and stopped by its lifespan."""

    def __init__(self, ctx, interval_s: float = STATS_LOG_INTERVAL_S):
        self.ctx = ctx
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        prev, was_busy = None, False
        while True:
            if not stats_log.isEnabledFor(logging.INFO):
                prev = None
            else:  # the first pass only takes the counters the first interval's rates start from
                try:
                    prev, was_busy = await self._tick(prev, was_busy)
                except Exception:  # a failing stats() must not end the task or the server
                    stats_log.debug("throughput line skipped", exc_info=True)
            await asyncio.sleep(self.interval_s)

    async def _tick(self, prev: dict | None, was_busy: bool) -> tuple[dict, bool]:
        engine = self.ctx.engine
        stats = await engine.stats()
        running = engine.num_unfinished - engine.num_waiting
        server = self.ctx.metrics.summary(stats, running, engine.num_waiting)
        cur = cumulative(stats, server, time.time())
        snap = compact(prev, cur, stats, server)
        busy = bool(snap.get("tok_s") or snap.get("prompt_tok_s") or running or engine.num_waiting)
        if prev is not None and (busy or was_busy):
            stats_log.info("%s", throughput_line(snap))
        return cur, busy
