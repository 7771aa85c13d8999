"""The device cache over a disk tier in `tiermoe sim`: GPU slots by the cache's own policy, host RAM as a cache of
the disk by one of the RAM rules below, disk reads counted per token.

Served (moe/disk_tier.py), a decode step of one layer first reads the picks that are neither in a slot nor in RAM
from disk into RAM (evicting the coldest entry of another layer), then the slot cache's step (its plain-torch twin,
`kernels.reference.cache_step_ref`) admits some misses, copying them from RAM. At start the slots take the most
popular experts and RAM the next most popular, less a reserve of entries that each answer keeps free for reads
ahead by evicting the coldest; a freed entry keeps its record until a read takes it (parked), so a pick of a
parked expert reads nothing (`lost_reserve`: the tier before parking, whose reserve held nothing). The RAM rules:

- `heat` (served): RAM keeps an expert a slot admitted (inclusive); eviction order from the statistics at start,
  then every HEAT_STEPS steps from the device's decayed pick counts (the cache's `freq`).
- `prior`: as heat, the eviction order from the statistics for good.
- `exclusive`: as heat, and an admitted expert leaves RAM (the slot holds it) while a slot's victim goes back to
  RAM in its place (a victim ring), or to disk only when it is colder than anything RAM holds.

The host tier's rule under independent picks is bounded by static placement over the three tiers (`static` with
`--host-experts`): the slots' experts the most popular, RAM the next, nothing moves. Not modelled: reads ahead
(served, a hint's read takes a parked entry, so a wrong hint costs a parked record), batches of several
tokens, and prefill chunks.
"""

from __future__ import annotations

import heapq

import numpy as np

from tiermoe.kernels.cache_policy import DECAY_SHIFT, HEAT_STEPS
from tiermoe.store.sim_device import cache_states

RAM_RULES = ("heat", "prior", "exclusive")


class _Ram:
    """Host RAM of `capacity` entries over (layer, expert) keys, evicting the coldest of another layer first (then
    the oldest load), as disk_tier.DiskTier does; `reserve` of them kept free (parked, or empty when `lost`)."""

    def __init__(self, capacity: int, rate: np.ndarray, reserve: int, lost: bool) -> None:
        self.capacity = int(capacity)
        self.reserve, self.lost = int(reserve), bool(lost)
        self.rate = rate  # float64 [L, E] eviction heat
        self.stamp: dict[tuple[int, int], int] = {}  # held key -> load number
        self.heap: list[tuple[float, int, int, int]] = []
        self.loads = 0
        self.parked: dict[tuple[int, int], None] = {}  # free entries' records, oldest first

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self.stamp

    def hold(self, row: int, e: int) -> None:
        self.loads += 1
        self.stamp[(row, e)] = self.loads
        heapq.heappush(self.heap, (float(self.rate[row, e]), self.loads, row, e))

    def drop(self, row: int, e: int) -> None:
        self.stamp.pop((row, e), None)  # its heap item goes stale

    def coldest(self, row: int) -> tuple[float, int, int] | None:
        """(heat, row, expert) of the next victim that is not of `row`, left in place (None: none)."""
        skipped, found = [], None
        while self.heap:
            item = heapq.heappop(self.heap)
            h, stamp, r, e = item
            if self.stamp.get((r, e)) != stamp:
                continue
            skipped.append(item)
            if r != row:
                found = (h, r, e)
                break
        for item in skipped:
            heapq.heappush(self.heap, item)
        return found

    def make_room(self, row: int) -> bool:
        """A free entry for a load of `row` (evicting when full); False: RAM holds nothing of another layer."""
        if len(self.stamp) + len(self.parked) < self.capacity:
            return True
        if self.parked:
            del self.parked[next(iter(self.parked))]
            return True
        victim = self.coldest(row)
        if victim is None:
            return False
        self.drop(victim[1], victim[2])
        return True

    def refill(self, row: int) -> None:
        """After a layer's answer: `reserve` entries free again, the coldest of other layers evicted."""
        while self.capacity - len(self.stamp) < self.reserve:
            victim = self.coldest(row)
            if victim is None:
                return
            self.drop(victim[1], victim[2])
            if not self.lost:
                self.parked[victim[1:]] = None

    def reheat(self, rate: np.ndarray) -> None:
        self.rate = rate
        self.heap = [(float(rate[r, e]), s, r, e) for (r, e), s in self.stamp.items()]
        heapq.heapify(self.heap)


def run_device_tiers(trace: np.ndarray, slots: int, host: int, warmup: int, rates: np.ndarray, rule: str = "heat",
                     reserve: int = 0, lost_reserve: bool = False, decay_shift: int = DECAY_SHIFT
                     ) -> tuple[float, float, float]:
    """trace int64 [T, L, k] per-layer expert ids, rates [L, E] expected picks per token; host: RAM entries, of which
    `reserve` stay free (the served tier's room for reads ahead). Per token over the tokens after `warmup`, batch
    1: (slot hits, RAM hits, disk reads); a parked expert's pick counts as a RAM hit."""
    import torch

    from tiermoe.kernels.reference import cache_step_ref

    if rule not in RAM_RULES:
        raise ValueError(f"RAM rule {rule!r}: choose from {', '.join(RAM_RULES)}")
    n_tok, n_layers, _ = trace.shape
    states = cache_states(slots, rates, decay_shift)
    ram = _Ram(host, np.asarray(rates, dtype=np.float64), reserve, lost_reserve)
    slotted = {(i, int(e)) for i, st in enumerate(states) for e in st["slot_expert"].tolist() if e >= 0}
    order = sorted(((i, e) for i in range(n_layers) for e in range(rates.shape[1]) if (i, e) not in slotted),
                   key=lambda k: (-rates[k], k))
    for i, e in order[: max(0, host - reserve)]:
        ram.hold(i, e)
    if not lost_reserve:  # start-up placement parks what it evicted: the next most popular
        ram.parked = dict.fromkeys(order[max(0, host - reserve): host])
    ids = torch.from_numpy(np.ascontiguousarray(trace))  # [T, L, k]
    counts = np.zeros(3)  # slot hits, RAM hits, disk reads
    for t in range(n_tok):
        if t == warmup:
            counts[:] = 0
        for i, st in enumerate(states):
            uniq = list(dict.fromkeys(int(e) for e in ids[t, i].tolist()))
            es = st["expert_slot"]
            asked = False
            for e in uniq:
                if int(es[e]) >= 0:
                    counts[0] += 1
                elif (i, e) in ram:
                    counts[1] += 1
                elif (i, e) in ram.parked:  # a request takes its entry back
                    del ram.parked[(i, e)]
                    ram.hold(i, e)
                    counts[1] += 1
                    asked = True
                else:
                    counts[2] += 1
                    asked = True
                    if ram.make_room(i):
                        ram.hold(i, e)
            if asked:
                ram.refill(i)
            before = st["slot_expert"].clone()
            if st["slot_addr"].numel():
                cache_step_ref(st, ids[t, i], admit_max=st["slot_addr"].numel(), decay_shift=decay_shift)
            if rule == "exclusive":
                _victim_ring(ram, i, before, st["slot_expert"])
        if rule != "prior" and (t + 1) % HEAT_STEPS == 0:
            ram.reheat(np.stack([st["freq"].double().numpy() for st in states]))
    n = n_tok - warmup
    return tuple(float(c) / n for c in counts)  # type: ignore[return-value]


def _victim_ring(ram: _Ram, row: int, before, after) -> None:
    """Exclusive tiers after a cache step of `row`: admitted experts leave RAM, each victim takes an entry back
    (evicting a colder one when RAM is full) or goes to disk only."""
    changed = (before != after).nonzero().reshape(-1).tolist()
    for s in changed:
        new, old = int(after[s]), int(before[s])
        if new >= 0:
            ram.drop(row, new)
        if old < 0 or (row, old) in ram:
            continue
        if len(ram.stamp) + len(ram.parked) < ram.capacity:
            ram.hold(row, old)
            continue
        victim = ram.coldest(-1)
        if victim is not None and victim[0] < ram.rate[row, old]:
            ram.drop(victim[1], victim[2])
            ram.hold(row, old)
