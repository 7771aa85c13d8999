"""Replacement policies (LRU, LFU with decay, CLOCK, static) and warm start from routing stats.

A policy only decides *which keys* are resident in one tier of fixed capacity; it never
touches data. Keys are dense ints (the record index of an expert). The tier logic in
residency.py tells a policy what happened (`touch` on every use, `step` per decode step) and
asks it two things: which resident key would make room (`victim`), and whether a missing key
is worth admitting in its place (`should_admit`). Keys in the
caller's `protect` set (the experts of the call in progress, whose tensors the caller is
about to use) and the static hot set are never chosen as victims.

LFU with decay keeps a score for every key ever seen (resident or not): each access adds the
current increment and every `step()` (one decode step) divides future increments' scale by
`decay`, i.e. scores decay geometrically without touching every key. It admits a missing key
only when its score beats the victim's, so one-off picks do not flush hot experts. Victims
come from a lazy min-heap, O(log n) amortized.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Collection, Iterable, Mapping

POLICIES = ("lru", "lfu", "clock", "static")


class Policy:
    """Interface shared by every replacement policy (keys: non-negative ints)."""

    name = "base"

    def __init__(self, capacity: int, *, static: Iterable[int] = ()):
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self.static = set(static)
        if len(self.static) > capacity:
            raise ValueError(f"static hot set ({len(self.static)}) larger than capacity ({capacity})")
        self._resident: set[int] = set()
        for k in sorted(self.static):
            self.insert(k)

    def __contains__(self, key: int) -> bool:
        return key in self._resident

    def __len__(self) -> int:
        return len(self._resident)

    def keys(self) -> set[int]:
        return set(self._resident)

    @property
    def full(self) -> bool:
        return len(self._resident) >= self.capacity

    # -- events ------------------------------------------------------------------------
    def touch(self, key: int) -> None:
        """`key` was used (resident here or not: frequency policies count every use)."""

    def step(self) -> None:
        """One decode step (all layers) ended."""

    # -- decisions ---------------------------------------------------------------------
    def should_admit(self, key: int, victim: int | None) -> bool:
        """Admit missing `key`, evicting `victim` (None: there is free room)?"""
        return self.capacity > 0

    def victim(self, protect: Collection[int] = ()) -> int | None:
        """The resident key to evict next (not static, not protected), or None."""
        raise NotImplementedError

    def insert(self, key: int) -> None:
        if key in self._resident:
            return
        if len(self._resident) >= self.capacity:
            raise RuntimeError(f"{self.name}: insert into a full tier")
        self._resident.add(key)
        self._on_insert(key)

    def remove(self, key: int) -> None:
        if key in self.static:
            raise RuntimeError(f"{self.name}: key {key} is in the static hot set")
        self._resident.discard(key)
        self._on_remove(key)

    def _on_insert(self, key: int) -> None: ...

    def _on_remove(self, key: int) -> None: ...

    def warm_start(self, rates: Mapping[int, float], exclude: Collection[int] = (), *, seed: bool = True) -> list[int]:
        """Fill free room with the hottest keys not in `exclude` (e.g. the keys a faster tier
        already holds); with `seed`, also seed usage statistics from the rates (expected uses
        per step). Pass seed=False when the rates are a mere guess (uniform routing).

        Returns the keys inserted (hottest first) so the caller can load their data.
        """
        room = self.capacity - len(self._resident)
        added = [k for k in top_keys(rates, room + len(self._resident), exclude) if k not in self._resident][:room]
        for k in reversed(added):  # coldest first: LRU then holds the hottest as most recent
            self.insert(k)
        return added


class LRU(Policy):
    name = "lru"

    def __init__(self, capacity: int, **kw):
        self._order: OrderedDict[int, None] = OrderedDict()
        super().__init__(capacity, **kw)

    def touch(self, key: int) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def _on_insert(self, key: int) -> None:
        self._order[key] = None

    def _on_remove(self, key: int) -> None:
        self._order.pop(key, None)

    def victim(self, protect: Collection[int] = ()) -> int | None:
        for k in self._order:
            if k not in protect and k not in self.static:
                return k
        return None


class LFU(Policy):
    """LFU with exponential decay and frequency-based admission (see module docstring)."""

    name = "lfu"

    def __init__(self, capacity: int, *, decay: float = 0.995, admit_always: bool = False, **kw):
        if not 0.0 < decay <= 1.0:
            raise ValueError("decay must be in (0, 1]")
        self.decay = decay
        self.admit_always = admit_always
        self._score: dict[int, float] = {}
        self._inc = 1.0
        self._heap: list[tuple[float, int]] = []
        super().__init__(capacity, **kw)

    def score(self, key: int) -> float:
        """Decayed access count, in units of the current step."""
        return self._score.get(key, 0.0) / self._inc

    def touch(self, key: int) -> None:
        s = self._score.get(key, 0.0) + self._inc
        self._score[key] = s
        if key in self._resident:
            heapq.heappush(self._heap, (s, key))

    def step(self) -> None:
        self._inc /= self.decay
        if self._inc > 1e100:  # renormalize before floats overflow
            self._score = {k: v / self._inc for k, v in self._score.items()}
            self._inc = 1.0
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(self._score.get(k, 0.0), k) for k in self._resident]
        heapq.heapify(self._heap)

    def _on_insert(self, key: int) -> None:
        heapq.heappush(self._heap, (self._score.get(key, 0.0), key))

    def victim(self, protect: Collection[int] = ()) -> int | None:
        if len(self._heap) > 4 * max(16, len(self._resident)):
            self._rebuild()
        skipped = []
        found = None
        while self._heap:
            s, k = heapq.heappop(self._heap)
            if k not in self._resident or s != self._score.get(k, 0.0):
                continue  # stale entry
            skipped.append((s, k))
            if k not in protect and k not in self.static:
                found = k
                break
        for item in skipped:
            heapq.heappush(self._heap, item)
        return found

    def should_admit(self, key: int, victim: int | None) -> bool:
        if self.capacity == 0:
            return False
        if victim is None or self.admit_always:
            return True
        return self._score.get(key, 0.0) > self._score.get(victim, 0.0)

    def warm_start(self, rates: Mapping[int, float], exclude: Collection[int] = (), *, seed: bool = True) -> list[int]:
        if seed:
            # Steady state of a decayed counter for a key used `r` times per step: r / (1 - decay).
            horizon = 1.0 / (1.0 - self.decay) if self.decay < 1.0 else 1000.0
            for k, r in rates.items():
                self._score[k] = self._score.get(k, 0.0) + r * horizon * self._inc
            self._rebuild()
        return super().warm_start(rates, exclude, seed=seed)


class Clock(Policy):
    """CLOCK (second chance): a ring of slots with reference bits and a sweeping hand."""

    name = "clock"

    def __init__(self, capacity: int, **kw):
        self._ring: list[int | None] = [None] * capacity
        self._ref: list[bool] = [False] * capacity
        self._pos: dict[int, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._hand = 0
        super().__init__(capacity, **kw)

    def touch(self, key: int) -> None:
        p = self._pos.get(key)
        if p is not None:
            self._ref[p] = True

    def _on_insert(self, key: int) -> None:
        p = self._free.pop()
        self._ring[p] = key
        self._ref[p] = False
        self._pos[key] = p

    def _on_remove(self, key: int) -> None:
        p = self._pos.pop(key, None)
        if p is not None:
            self._ring[p] = None
            self._ref[p] = False
            self._free.append(p)

    def victim(self, protect: Collection[int] = ()) -> int | None:
        n = self.capacity
        if n == 0:
            return None
        for _ in range(2 * n + 1):
            p = self._hand
            self._hand = (self._hand + 1) % n
            k = self._ring[p]
            if k is None or k in protect or k in self.static:
                continue
            if self._ref[p]:
                self._ref[p] = False
                continue
            return k
        return None

    def warm_start(self, rates: Mapping[int, float], exclude: Collection[int] = (), *, seed: bool = True) -> list[int]:
        added = super().warm_start(rates, exclude, seed=seed)
        for k in added if seed else ():
            self._ref[self._pos[k]] = True  # loaded because they are hot: one free pass
        return added


class Static(Policy):
    """A fixed resident set: the warm start (or first arrivals until full), never replaced."""

    name = "static"

    def victim(self, protect: Collection[int] = ()) -> int | None:
        return None

    def should_admit(self, key: int, victim: int | None) -> bool:
        return victim is None and not self.full


def make_policy(name: str, capacity: int, *, decay: float = 0.995, static: Iterable[int] = ()) -> Policy:
    """Build a policy by name (one of POLICIES)."""
    name = name.lower()
    if name == "lru":
        return LRU(capacity, static=static)
    if name == "lfu":
        return LFU(capacity, decay=decay, static=static)
    if name == "clock":
        return Clock(capacity, static=static)
    if name == "static":
        return Static(capacity, static=static)
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")


def top_keys(rates: Mapping[int, float], n: int, exclude: Collection[int] = ()) -> list[int]:
    """The n keys with the highest rates (ties by key), skipping `exclude`."""
    order = sorted((k for k in rates if k not in exclude), key=lambda k: (-rates[k], k))
    return order[:n]
