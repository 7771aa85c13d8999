"""`tiermoe sim`: compare replacement policies on routing sampled from statistics, no GPU.

Routing model: for every token and MoE layer, top-k distinct experts are drawn without
replacement with probability proportional to (count + smoothing), via the Gumbel-top-k trick
(equivalent to successive sampling). Tokens are independent, so there is no temporal locality
beyond popularity: recency-based policies look worse here than on real traces, frequency
policies converge to the static optimum. All layers share one slot pool of N slots (keys are
(layer, expert)); an optional host tier of M experts sits below it with the same policy and
the exact tier rules the store uses (residency.py). "belady" is the offline optimum for the
slot tier on the same trace (with bypass), a lower bound on slot misses. "device" is the GPU
device cache's own policy (sim_device.py): slots split over the layers by popularity, as served.
A recorded routing trace (`--trace`) replaces the sampled one, keeping its temporal locality.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from tiermoe.errors import UserError
from tiermoe.store.planner import load_stats, pick_rates
from tiermoe.store.policy import POLICIES
from tiermoe.store.residency import Residency
from tiermoe.store.sim_device import run_device_policy
from tiermoe.store.sim_tiers import RAM_RULES, run_device_tiers

SIM_POLICIES = POLICIES + ("device", "belady")


@dataclass
class SimResult:
    policy: str
    tokens: int  # measured tokens (after warm-up)
    slot_hits: float  # per token
    slot_misses: float  # per token
    host_hits: float | None  # per token (None: not modelled)
    disk_reads: float | None

    @property
    def picks(self) -> int:
        """Expert picks per token (every layer's top-k)."""
        return round(self.slot_hits + self.slot_misses)


def sample_trace(
    stats: dict[int, list[float]], tokens: int, top_k: int, seed: int, smoothing: float = 0.5
) -> np.ndarray:
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


def _run_policy(
    trace: np.ndarray, policy: str, slots: int, host: int, warmup: int, rates: dict[int, float], warm_start: bool,
    static_hot: int,
) -> SimResult:
    """rates: the statistics' pick rate of every expert key; they choose the pinned experts (static_hot) always,
    and fill the tiers before the first token only with warm_start."""
    static = sorted(rates, key=lambda k: -rates[k])[:static_hot] if static_hot else []
    res = Residency.build(policy, slots, host, static=static)
    if warm_start:
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
    return SimResult(
        policy, n, counts["slots"] / n, (counts["host"] + counts["disk"]) / n, counts["host"] / n, counts["disk"] / n
    )


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


def simulate(
    stats_file: str | None,
    *,
    slots: int,
    policies: list[str],
    tokens: int = 2000,
    seed: int = 0,
    host_experts: int = 0,
    top_k: int = 8,
    warmup: int | None = None,
    warm_start: bool = True,
    static_hot: int = 0,
    smoothing: float = 0.5,
    trace_file: str | None = None,
    ram_rules: tuple[str, ...] = ("heat",),
    reserve: int = 0,
    lost_reserve: bool = False,
) -> list[SimResult]:
    """Run each policy on one trace; per-token figures over the tokens after warm-up.

    The trace is sampled from the counts of `stats_file`, or read from `trace_file` (a routing
    trace recorded by `--record-routing`: its decode tokens, in order, so temporal locality is
    kept). Warm start uses the counts file when given, else the trace's own pick counts. The device
    cache's policy with a host tier runs once for each RAM rule of `ram_rules` (sim_tiers.py), `reserve` host
    entries kept free (parked; `lost_reserve`: holding nothing).
    """
    for p in policies:
        if p not in SIM_POLICIES:
            raise UserError(f"--policy {p!r}: choose from {', '.join(SIM_POLICIES)} or all")
    for rule in ram_rules:
        if rule not in RAM_RULES:
            raise UserError(f"--ram-rule {rule!r}: choose from {', '.join(RAM_RULES)}")
    if tokens < 1 or slots < 0 or host_experts < 0 or not 0 <= reserve <= host_experts:
        raise UserError("--tokens must be >= 1, --slots/--host-experts >= 0 and --reserve in 0..--host-experts")
    if static_hot < 0:  # a slice [:-1] would pin every expert but the coldest
        raise UserError(f"--static-hot {static_hot}: must be >= 0 (experts pinned)")
    if seed < 0:  # numpy's generators take none
        raise UserError(f"--seed {seed}: must be >= 0")
    if stats_file is None and trace_file is None:
        raise UserError("give --stats (per-layer pick counts) or --trace (a recorded routing trace)")
    stats = load_stats(stats_file) if stats_file is not None else None
    if trace_file is not None:
        picks = load_trace_picks(trace_file, tokens)  # [T, L, k] expert ids
        top_k = picks.shape[2]
        if stats is None:
            stats = {
                i: np.bincount(picks[:, i].reshape(-1), minlength=int(picks.max()) + 1).astype(float).tolist()
                for i in range(picks.shape[1])
            }
        n_e = len(next(iter(stats.values())))
        if len(stats) != picks.shape[1] or picks.max() >= n_e:
            raise UserError(
                f"--stats has {len(stats)} layers of {n_e} experts; the trace has {picks.shape[1]} "
                f"layers and expert ids up to {int(picks.max())}"
            )
        trace = picks.astype(np.int64) + (np.arange(picks.shape[1]) * n_e)[None, :, None]
    else:
        trace = sample_trace(stats, tokens, top_k, seed, smoothing)
    tokens = trace.shape[0]
    warmup = tokens // 10 if warmup is None else warmup
    if not 0 <= warmup < tokens:
        raise UserError(f"--warmup must be in 0..{tokens - 1}")
    layers = sorted(stats)
    n_e = len(stats[layers[0]])
    # A tier larger than every expert holds them all; the policies allocate a list per capacity.
    slots, host_experts = min(slots, len(layers) * n_e), min(host_experts, len(layers) * n_e)
    pr = pick_rates({i: stats[L] for i, L in enumerate(layers)}, top_k)
    rates = {i * n_e + e: r for i, row in pr.items() for e, r in enumerate(row)}
    out = []
    for p in policies:
        if p == "belady":
            out.append(_run_belady(trace, slots, warmup))
        elif p == "device":
            local = trace - (np.arange(len(layers)) * n_e)[None, :, None]  # [T, L, k] per-layer ids
            layer_rates = np.array([pr[i] for i in range(len(layers))]) if warm_start else None
            if host_experts:
                if layer_rates is None:
                    raise UserError("--policy device with --host-experts starts its tiers from the statistics: "
                                    "drop --no-warm-start")
                for rule in ram_rules:
                    hits, ram, disk = run_device_tiers(local, slots, host_experts, warmup, layer_rates, rule,
                                                       reserve, lost_reserve)
                    out.append(SimResult(f"device/{rule}", tokens - warmup, hits, ram + disk, ram, disk))
                continue
            hits, misses = run_device_policy(local, slots, warmup, layer_rates)
            out.append(SimResult("device", tokens - warmup, hits, misses, None, None))
        else:
            out.append(_run_policy(trace, p, slots, host_experts, warmup, rates, warm_start, static_hot))
    return out


def load_trace_picks(path: str, tokens: int) -> np.ndarray:
    """The first `tokens` decode tokens of a recorded trace (all tokens if it has no decode ones)."""
    from tiermoe.store.routing_trace import read_trace

    _, picks, decode = read_trace(path)
    if decode.any():
        picks = picks[decode]
    if picks.shape[0] < 2:
        raise UserError(f"{path}: the trace holds {picks.shape[0]} tokens; the simulator needs at least 2")
    return np.asarray(picks[:tokens], dtype=np.int64)


def format_results(results: list[SimResult], *, slots: int, host_experts: int, picks: int) -> str:
    lines = [
        f"{'policy':<17}{'slot hits':>11}{'slot misses':>13}{'host hits':>11}{'disk reads':>12}{'slot hit %':>12}",
    ]
    for r in results:
        miss = r.slot_misses
        host = f"{r.host_hits:>11.1f}" if r.host_hits is not None else f"{'-':>11}"
        disk = f"{r.disk_reads:>12.1f}" if r.disk_reads is not None else f"{'-':>12}"
        lines.append(f"{r.policy:<17}{r.slot_hits:>11.1f}{miss:>13.1f}{host}{disk}{r.slot_hits / picks:>12.1%}")
    lines.append(f"per token; {picks} picks/token, {slots} slots shared by all layers, {host_experts} host experts")
    if any(r.policy == "device" for r in results):
        lines.append("device: the GPU device cache's policy, slots split over the layers by popularity, no host tier")
    if any(r.policy.startswith("device/") for r in results):
        lines.append("device/RULE: the device cache's slots over a disk tier whose RAM follows RULE (sim_tiers.py)")
    return "\n".join(lines)
