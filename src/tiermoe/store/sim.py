"""`tiermoe sim`: compare replacement policies on routing sampled from statistics, no GPU.

Routing model: for every token and MoE layer, top-k distinct experts are drawn without
replacement with probability proportional to (count + smoothing), via the Gumbel-top-k trick
(equivalent to successive sampling). Tokens are independent, so there is no temporal locality
beyond popularity: recency-based policies look worse here than on real traces, frequency
policies converge to the static optimum. All layers share one slot pool of N slots (keys are
(layer, expert)); an optional host tier of M experts sits below it with the same policy and
the exact tier rules the store uses (residency.py). "belady" is the offline optimum for the
slot tier on the same trace (with bypass), a lower bound on slot misses.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from tiermoe.errors import UserError
from tiermoe.store.planner import load_stats, pick_rates
from tiermoe.store.policy import POLICIES
from tiermoe.store.residency import Residency

SIM_POLICIES = POLICIES + ("belady",)


@dataclass
class SimResult:
    policy: str
    tokens: int  # measured tokens (after warm-up)
    slot_hits: float  # per token
    slot_misses: float  # per token
    host_hits: float | None  # per token (None: not modelled)
    disk_reads: float | None


def sample_trace(stats: dict[int, list[float]], tokens: int, top_k: int, seed: int, smoothing: float = 0.5) -> np.ndarray:
    """Keys int64 [tokens, layers, top_k]; key = layer_position * E + expert."""
    layers = sorted(stats)
    e = {len(stats[L]) for L in layers}
    if len(e) != 1:
        raise UserError("statistics layers list different expert counts; the simulator needs one")
    n_e = e.pop()
    if not 0 < top_k <= n_e:
        raise UserError(f"--top-k {top_k} must be in 1..{n_e}")
    p = np.array([pick_rates({0: stats[L]}, 1, smoothing)[0] for L in layers])  # [L, E], rows sum to 1
    logp = np.log(p)
    rng = np.random.default_rng(seed)
    out = np.empty((tokens, len(layers), top_k), dtype=np.int64)
    offs = (np.arange(len(layers)) * n_e)[None, :, None]
    chunk = 256
    for t0 in range(0, tokens, chunk):
        t1 = min(tokens, t0 + chunk)
        g = logp[None] + rng.gumbel(size=(t1 - t0, len(layers), n_e))  # [T, L, E]
        out[t0:t1] = np.argpartition(-g, top_k - 1, axis=-1)[..., :top_k] + offs
    return out


def _run_policy(trace: np.ndarray, policy: str, slots: int, host: int, warmup: int,
                rates: dict[int, float] | None, static_hot: int) -> SimResult:
    static = sorted(rates, key=lambda k: -rates[k])[:static_hot] if (rates and static_hot) else []
    res = Residency.build(policy, slots, host, static=static)
    if rates:
        res.warm_start(rates)
    counts = {"slots": 0, "host": 0, "disk": 0}
    for t in range(trace.shape[0]):
        if t == warmup:
            counts = {"slots": 0, "host": 0, "disk": 0}
        for layer_keys in trace[t]:
            keys = [int(k) for k in layer_keys]
            protect = set(keys)
            for k in keys:
                counts[res.access(k, protect).served] += 1
        res.step()
    n = trace.shape[0] - warmup
    return SimResult(policy, n, counts["slots"] / n, (counts["host"] + counts["disk"]) / n, counts["host"] / n, counts["disk"] / n)


def _run_belady(trace: np.ndarray, slots: int, warmup: int) -> SimResult:
    flat = trace.reshape(-1)
    per_token = trace.shape[1] * trace.shape[2]
    nxt = np.empty(len(flat), dtype=np.int64)
    last: dict[int, int] = {}
    inf = len(flat) + 1
    for i in range(len(flat) - 1, -1, -1):
        k = int(flat[i])
        nxt[i] = last.get(k, inf)
        last[k] = i
    resident: dict[int, int] = {}  # key -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, key), lazy
    hits = 0
    for i in range(len(flat)):
        if i == warmup * per_token:
            hits = 0
        k, n = int(flat[i]), int(nxt[i])
        if k in resident:
            hits += 1
            resident[k] = n
            heapq.heappush(heap, (-n, k))
            continue
        if slots == 0:
            continue
        if len(resident) < slots:
            resident[k] = n
            heapq.heappush(heap, (-n, k))
            continue
        while heap and (heap[0][1] not in resident or resident[heap[0][1]] != -heap[0][0]):
            heapq.heappop(heap)
        far = -heap[0][0]
        if far > n:  # evict the resident used farthest in the future, unless k is even farther
            _, v = heapq.heappop(heap)
            del resident[v]
            resident[k] = n
            heapq.heappush(heap, (-n, k))
    ntok = trace.shape[0] - warmup
    return SimResult("belady", ntok, hits / ntok, per_token - hits / ntok, None, None)


def simulate(stats_file: str, *, slots: int, policies: list[str], tokens: int = 2000, seed: int = 0,
             host_experts: int = 0, top_k: int = 8, warmup: int | None = None, warm_start: bool = True,
             static_hot: int = 0, smoothing: float = 0.5) -> list[SimResult]:
    """Run each policy on one sampled trace; per-token figures over the tokens after warm-up."""
    for p in policies:
        if p not in SIM_POLICIES:
            raise UserError(f"--policy {p!r}: choose from {', '.join(SIM_POLICIES)} or all")
    if tokens < 1 or slots < 0 or host_experts < 0:
        raise UserError("--tokens must be >= 1 and --slots/--host-experts >= 0")
    stats = load_stats(stats_file)
    trace = sample_trace(stats, tokens, top_k, seed, smoothing)
    warmup = tokens // 10 if warmup is None else warmup
    if not 0 <= warmup < tokens:
        raise UserError(f"--warmup must be in 0..{tokens - 1}")
    layers = sorted(stats)
    n_e = len(stats[layers[0]])
    rates = None
    if warm_start:
        pr = pick_rates({i: stats[L] for i, L in enumerate(layers)}, top_k)
        rates = {i * n_e + e: r for i, row in pr.items() for e, r in enumerate(row)}
    out = []
    for p in policies:
        if p == "belady":
            out.append(_run_belady(trace, slots, warmup))
        else:
            out.append(_run_policy(trace, p, slots, host_experts, warmup, rates, static_hot))
    return out


def format_results(results: list[SimResult], *, slots: int, host_experts: int, picks: int) -> str:
    lines = [
        f"{'policy':<8}{'slot hits':>11}{'slot misses':>13}{'host hits':>11}{'disk reads':>12}{'slot hit %':>12}",
    ]
    for r in results:
        miss = r.slot_misses
        host = f"{r.host_hits:>11.1f}" if r.host_hits is not None else f"{'-':>11}"
        disk = f"{r.disk_reads:>12.1f}" if r.disk_reads is not None else f"{'-':>12}"
        lines.append(f"{r.policy:<8}{r.slot_hits:>11.1f}{miss:>13.1f}{host}{disk}{r.slot_hits / picks:>12.1%}")
    lines.append(f"per token; {picks} picks/token, {slots} slots shared by all layers, {host_experts} host experts")
    return "\n".join(lines)
