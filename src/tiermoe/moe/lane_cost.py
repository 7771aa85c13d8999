"""Fast mode's cost model: how many of a layer's misses the CPU lane takes, from bandwidths measured
at start-up.

A decode step's misses (picked experts not in device slots) reach the device over PCIe (admitted
or staged copies, or in-place reads) unless the CPU lane computes them where they sit. Both read
host memory, and both run at once, so the layer is done when the slower of the two is:

    t(n) = max((m - n) * B / P, n * B / L)    m misses of B weight bytes, n of them on the lane

smallest where both finish together: n = m * L / (P + L). P and L are the rates each gets while
the other runs: the copy engine and the lane's threads share the host's memory bandwidth, so the
start-up measurement times a PCIe copy alone, the lane alone, a multi-threaded host read, and
then the copy and the lane together; the split uses the shared rates (the other rates are kept
for /stats and the floor model). The share L / (P + L) goes to the device as a per-layer
tensor (cache_manager's lane_share, read inside captured decode graphs) and to CpuLane.assign on
the store path; the cap (`--cpu-lane-experts`) still bounds n. In service the lane's own rate
replaces the start-up L (ServiceShare), since the lane then shares its cores and memory with the
engine.

The same start-up run picks the compiled kernel's work items and prefetch distance
(kernels/cpu/native.py: LaneTuning) from a few candidates, by the lane's rate on the same records:
what pays depends on the host's memory latency and cores, so it is measured, not assumed.

Measured on CUDA only: on a CPU device the "device" path computes on the same cores as the lane,
and the lane keeps its fixed count per layer. `--cpu-lane-share S` skips the measurement and
gives the lane the fixed share S instead (the same per-layer tensor, the same cap).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch

from tiermoe.kernels.cpu.native import LaneTuning
from tiermoe.kernels.layout import expert_layout
from tiermoe.kernels.reference import make_record


@dataclass(frozen=True)
class LaneBandwidths:
    """GB/s (1e9 bytes/s) measured at start-up."""

    pcie_gbs: float  # pinned host -> device copies, alone
    host_gbs: float  # host memory read by the lane's threads, alone
    lane_gbs: float  # expert weight bytes the lane computes, alone
    pcie_shared_gbs: float  # copies while the lane computes
    lane_shared_gbs: float  # the lane while copies run
    tuning: str = ""  # the kernel tuning chosen (TUNINGS), "" where the lane has no compiled kernel
    tuning_gbs: dict = field(default_factory=dict)  # the lane's GB/s with each candidate

    @property
    def share(self) -> float:
        """The lane's share of a layer's misses: both sides finish together at the shared rates."""
        total = self.pcie_shared_gbs + self.lane_shared_gbs
        return self.lane_shared_gbs / total if total > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "share": self.share}


@dataclass
class ServiceShare:
    """The share re-derived from what the two sides take in service.

    The start-up figures time the lane on a few records while nothing else runs; in service it
    shares the cores with the engine and the server and reads records spread over all of host
    memory, and it can run at a fraction of that rate. A share set too high makes the lane the
    slower side of every layer. So after each `window_bytes` of lane work the share moves halfway
    to a target; a change under `min_step` is not applied (each one is a device write).

    Target, where the hand-off reports both sides' times (`balance`: the lane's seconds answering
    and the device's seconds on its own part of the same layers, from each post to its wait; the
    device mailbox on CUDA): with ratio rho = lane seconds / device seconds over the window and s
    the share in force, s / (s + (1 - s) rho), the share at which both would take equal time if
    each side's time grew with its experts. Its fixed point is rho = 1, so fixed costs on either
    side are balanced too (the device's kernels on its slot hits; the lane's set-up, but not the
    few microseconds a post and its answer take to cross PCIe, which neither clock sees). Otherwise
    lane / (pcie + lane) with the lane's service rate (weight bytes per busy second over the window)
    and the start-up PCIe rate beside the lane. The share never goes under `floor`: a window
    closes only on lane work, so a lane given no experts would never be measured again."""

    pcie_gbs: float  # copies while the lane computes (LaneBandwidths.pcie_shared_gbs)
    share: float  # the share in force
    window_bytes: int = 1 << 30
    min_step: float = 0.01
    floor: float = 0.1  # the least share the feedback sets (at five misses a layer still one expert)
    service_gbs: float | None = None  # the last window's lane rate
    updates: int = 0
    rho: float | None = None  # the last window's lane seconds / device seconds (None: not measured)
    _busy_s: float = 0.0
    _bytes: int = 0
    _balance: tuple[float, float] = (0.0, 0.0)

    def update(self, busy_s: float, weight_bytes: int,
               balance: Callable[[], tuple[float, float] | None] | None = None) -> float | None:
        """The lane's cumulative busy seconds and weight bytes now, and a function giving the hand-off's
        cumulative (lane, device) seconds (None, or it returns None: not measured), called only when a
        window closes -> the new share, or None to keep it."""
        done, busy = weight_bytes - self._bytes, busy_s - self._busy_s
        if done < self.window_bytes or busy <= 0:
            return None
        self._busy_s, self._bytes = busy_s, weight_bytes
        balance = balance() if balance is not None else None
        self.service_gbs = done / busy / 1e9
        lane_s, device_s = (balance[0] - self._balance[0], balance[1] - self._balance[1]) if balance else (0.0, 0.0)
        self._balance = balance or self._balance
        if lane_s > 0 and device_s > 0:
            self.rho = lane_s / device_s
            s = min(0.98, max(0.02, self.share))  # never stuck at either end
            target = s / (s + (1 - s) * self.rho)
        else:
            target = self.service_gbs / (self.pcie_gbs + self.service_gbs) if self.pcie_gbs > 0 else 1.0
        new = max(self.floor, self.share + (target - self.share) / 2)
        if abs(new - self.share) < self.min_step:
            return None
        self.share, self.updates = new, self.updates + 1
        return new

    def as_dict(self) -> dict:
        return {"share": self.share, "service_gbs": self.service_gbs, "rho": self.rho, "updates": self.updates,
                "window_bytes": self.window_bytes}


def lane_count(misses: int, share: float | None, cap: int) -> int:
    """Experts of a layer's `misses` the lane takes: round(misses * share), at most `cap` (share
    None: the fixed cap)."""
    if share is None:
        return max(0, int(cap))
    return max(0, min(int(cap), int(misses * share + 0.5)))


def _lane_rate(lane, records: list[torch.Tensor], experts: int, done) -> float:
    """GB/s of expert weights lane.compute gets through until done(elapsed seconds) (and at least
    two calls), `experts` records a call, one token each (a decode step's typical lane expert)."""
    x = torch.randn(1, lane.layouts[0].hidden).to(torch.bfloat16)  # [1, H]
    weights = torch.full((1, experts), 1.0 / experts)  # [1, experts]
    n, calls, cursor = len(records), 0, 0
    t0 = time.perf_counter()
    while True:
        picked = [(cursor + e) % n for e in range(experts)]
        cursor = (cursor + experts) % n
        lane.compute(0, x, torch.tensor([picked], dtype=torch.int32), weights, {e: records[e] for e in picked})
        calls += 1
        elapsed = time.perf_counter() - t0
        if calls >= 2 and done(elapsed):
            return calls * experts * lane.weight_bytes_of[0] / elapsed / 1e9


# Candidates of choose_tuning: the kernel's defaults, then longer items (longer runs of a record read by
# one thread, at the cost of balance between threads) with prefetches further ahead, into L1 or L3.
TUNINGS = (LaneTuning(), LaneTuning(64, 32, 4, 3), LaneTuning(256, 64, 4, 3), LaneTuning(64, 32, 8, 1))


def tuning_label(t: LaneTuning) -> str:
    """GATE_UP:DOWN item rows, rows ahead and prefetch locality (bench lane's flags)."""
    return f"{t.rows_gu}:{t.rows_down} ahead {t.ahead_rows} hint {t.hint}"


def choose_tuning(lane, records: list[torch.Tensor], seconds: float = 0.04, rounds: int = 2,
                  candidates: tuple[LaneTuning, ...] = TUNINGS) -> tuple[str, dict]:
    """Time the lane with each candidate tuning (`rounds` rounds of `seconds` each, best kept), leave
    it on the fastest; returns (its label, {label: GB/s}). ("", {}) where the lane has no compiled
    kernel. The lane's counters are left as they were."""
    if lane.pool is None:
        return "", {}
    saved = replace(lane.c)
    rates: dict[str, float] = {}
    try:
        for _ in range(rounds):
            for t in candidates:
                lane.pool.tune(t)
                gbs = _lane_rate(lane, records, 4, lambda elapsed: elapsed >= seconds)
                rates[tuning_label(t)] = max(rates.get(tuning_label(t), 0.0), gbs)
    finally:
        lane.c = saved
    best = max(candidates, key=lambda t: rates[tuning_label(t)])
    lane.pool.tune(best)
    return tuning_label(best), rates


def measure(lane, device: torch.device, records: int = 16, seconds: float = 0.2) -> LaneBandwidths:
    """Measure the cost model's bandwidths on `device` (CUDA) with `records` random pinned records
    of the lane's layout; the lane's counters are left as they were."""
    layout = lane.layouts[0]  # a mixed store's hot layout: the split is timed on it
    klay = expert_layout(layout.kind, layout.hidden, layout.intermediate, layout.group_size or 0)
    gen = torch.Generator().manual_seed(0)
    n = max(2, records)
    arena = torch.empty(n, layout.length, dtype=torch.uint8).pin_memory()  # [n, R]: one read covers all
    for r in range(n):
        arena[r] = make_record(klay, gen)
    recs = list(arena)  # uint8 [R] each
    dst = torch.empty(layout.length, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    saved = replace(lane.c)

    def copies(k: int):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            for i in range(k):
                dst.copy_(recs[i % len(recs)], non_blocking=True)
            end.record(stream)
        return start, end

    def copy_gbs(k: int, events) -> float:
        events[1].synchronize()
        return k * layout.length / (events[0].elapsed_time(events[1]) / 1e3) / 1e9

    try:
        copy_gbs(len(recs), copies(len(recs)))  # first use: pins, allocator, copy engine warm
        pcie = copy_gbs(len(recs), copies(len(recs)))
        host = 0.0
        if lane.pool is not None:
            lane.pool.read(arena)  # first touch
            t0 = time.perf_counter()
            lane.pool.read(arena)
            host = arena.numel() / (time.perf_counter() - t0) / 1e9
        tuning, tuning_gbs = choose_tuning(lane, recs)
        lane_alone = _lane_rate(lane, recs, 4, lambda elapsed: elapsed >= seconds)
        # together: copies of about `seconds` at the lone rate, the lane computing until they end
        k = max(len(recs), int(pcie * 1e9 * seconds / layout.length))
        events = copies(k)
        lane_shared = _lane_rate(lane, recs, 4, lambda elapsed: events[1].query())
        pcie_shared = copy_gbs(k, events)
    finally:
        torch.cuda.synchronize(device)
        lane.c = saved
    return LaneBandwidths(pcie, host, lane_alone, pcie_shared, lane_shared, tuning, tuning_gbs)
