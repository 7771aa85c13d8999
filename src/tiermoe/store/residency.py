"""Which tier holds each expert: two exclusive policy-managed tiers over the disk store.

An expert (key) is in at most one of "slots" (the compute device's slot arena) and "host"
(RAM); the disk store always holds every expert. `Residency.access` turns one use of a key into
an `Access` plan: where it is served from, where it ends up, and which keys move to make room.
The facade executes plans on real buffers; the simulator only counts them, so both run the
same decisions.

Rules (exclusive tiers, "victims flow down"):
  slots hit   -> nothing moves.
  host hit    -> promote to slots if the slot policy admits it; the slot victim is demoted
                 into the host entry the key just left (a swap).
  disk read   -> into slots if the slot policy admits it (slot victim demoted to host, making
                 room there by dropping a host victim), else into host if the host policy
                 admits it, else the record is used once and dropped ("transient").
Keys in `protect` (this call's other experts) are never chosen as victims.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Mapping

from tiermoe.store.policy import Policy, make_policy


@dataclass(frozen=True)
class Access:
    key: int
    served: str  # "slots" | "host" | "disk": where the bytes came from
    to: str | None  # "slots" | "host" after this access, None: transient (not kept)
    slot_victim: int | None = None  # evicted from slots
    demoted: bool = False  # slot_victim moved to host (else dropped; disk still has it)
    host_victim: int | None = None  # dropped from host to make room


class Residency:
    def __init__(self, slots: Policy, host: Policy):
        self.slots = slots
        self.host = host

    @classmethod
    def build(
        cls, policy: str, n_slots: int, n_host: int, *, decay: float = 0.995, static: Collection[int] = ()
    ) -> "Residency":
        """Both tiers under `policy`; the static hot set lives in slots (or host if no slots)."""
        s_static = list(static)[:n_slots]
        h_static = [k for k in static if k not in set(s_static)][:n_host]
        return cls(
            make_policy(policy, n_slots, decay=decay, static=s_static),
            make_policy(policy, n_host, decay=decay, static=h_static),
        )

    def tier(self, key: int) -> str:
        if key in self.slots:
            return "slots"
        if key in self.host:
            return "host"
        return "disk"

    def step(self) -> None:
        self.slots.step()
        self.host.step()

    def warm_start(self, rates: Mapping[int, float], *, seed: bool = True) -> tuple[list[int], list[int]]:
        """Fill both tiers by rate (seeding policy statistics too if `seed`); return
        (keys to load into slots, keys to load into host)."""
        in_slots = self.slots.warm_start(rates, seed=seed)
        in_host = self.host.warm_start(rates, exclude=self.slots.keys(), seed=seed)
        return in_slots, in_host

    def _room(self, policy: Policy, key: int, protect: Collection[int]) -> tuple[bool, int | None]:
        """(admit?, victim) for putting `key` into `policy`'s tier."""
        if policy.capacity == 0:
            return False, None
        victim = policy.victim(protect) if policy.full else None
        if policy.full and victim is None:
            return False, None
        return policy.should_admit(key, victim), victim

    def _demote(self, victim: int, protect: Collection[int]) -> tuple[bool, int | None]:
        """Move a slot victim down to host; (demoted?, host key dropped for it)."""
        if self.host.capacity == 0:
            return False, None
        hv = None
        if self.host.full:
            hv = self.host.victim(protect)
            if hv is None:
                return False, None
            self.host.remove(hv)
        self.host.insert(victim)
        return True, hv

    def access(self, key: int, protect: Collection[int] = ()) -> Access:
        """Record one use of `key` and decide the moves it causes."""
        self.slots.touch(key)
        self.host.touch(key)
        if key in self.slots:
            return Access(key, "slots", "slots")
        if key in self.host:
            if key in self.host.static:
                return Access(key, "host", "host")
            admit, victim = self._room(self.slots, key, protect)
            if not admit:
                return Access(key, "host", "host")
            self.host.remove(key)
            demoted = False
            if victim is not None:
                self.slots.remove(victim)
                demoted, _ = self._demote(victim, protect)  # room: `key` just left host
            self.slots.insert(key)
            return Access(key, "host", "slots", victim, demoted)
        admit, victim = self._room(self.slots, key, protect)
        if admit:
            demoted, hv = False, None
            if victim is not None:
                self.slots.remove(victim)
                demoted, hv = self._demote(victim, protect)
            self.slots.insert(key)
            return Access(key, "disk", "slots", victim, demoted, hv)
        admit, hv = self._room(self.host, key, protect)
        if admit:
            if hv is not None:
                self.host.remove(hv)
            self.host.insert(key)
            return Access(key, "disk", "host", None, False, hv)
        return Access(key, "disk", None)
