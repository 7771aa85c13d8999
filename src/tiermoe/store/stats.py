"""Per-tier counters of the expert store (for logs, /stats and /metrics).

Everything is a plain int/float updated by the single thread that calls fetch/prefetch;
reader threads only report their in-flight count, read under the reader's lock. "Per decode
token" figures divide what was counted during decode steps by the number of decode tokens
(a batched decode step of n sequences is n tokens), so prefill traffic does not inflate them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TierCounters:
    hits: int = 0  # uses served from this tier
    misses: int = 0  # uses that had to go to a slower tier
    bytes_in: int = 0  # bytes copied into this tier (admissions)
    bytes_out: int = 0  # bytes copied out of this tier (demotions, transient copies)
    evictions: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class StoreCounters:
    slots: TierCounters = field(default_factory=TierCounters)
    host: TierCounters = field(default_factory=TierCounters)
    disk_reads: int = 0  # demand reads (a use served from disk)
    disk_bytes: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_dropped: int = 0
    steps: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    # totals accumulated while a decode step was current
    decode_slot_hits: int = 0
    decode_host_hits: int = 0
    decode_disk_reads: int = 0
    decode_bytes_moved: int = 0
    in_decode: bool = True
    # uses per record key since start (the web dashboard's per-layer heat map; engine/expert_heat.py)
    key_uses: dict[int, int] = field(default_factory=dict)

    def use(self, served: str, key: int | None = None) -> None:
        """Count one expert use served from tier `served` (of record `key`, when given)."""
        if key is not None:
            self.key_uses[key] = self.key_uses.get(key, 0) + 1
        if served == "slots":
            self.slots.hits += 1
            if self.in_decode:
                self.decode_slot_hits += 1
            return
        self.slots.misses += 1
        if served == "host":
            self.host.hits += 1
            if self.in_decode:
                self.decode_host_hits += 1
        else:
            self.host.misses += 1
            self.disk_reads += 1
            if self.in_decode:
                self.decode_disk_reads += 1

    def moved(self, nbytes: int) -> None:
        if self.in_decode:
            self.decode_bytes_moved += nbytes

    def as_dict(self, *, slots_capacity: int, slots_resident: int, host_capacity: int, host_resident: int,
                reads_in_flight: int, record_bytes: int) -> dict:
        tok = max(1, self.decode_tokens)
        return {
            "record_bytes": record_bytes,
            "slots": {**self.slots.as_dict(), "capacity": slots_capacity, "resident": slots_resident},
            "host": {**self.host.as_dict(), "capacity": host_capacity, "resident": host_resident},
            "disk": {
                "reads": self.disk_reads,
                "bytes_read": self.disk_bytes,
                "reads_in_flight": reads_in_flight,
                "prefetch_issued": self.prefetch_issued,
                "prefetch_used": self.prefetch_used,
                "prefetch_dropped": self.prefetch_dropped,
            },
            "cpu_lane": {"experts": 0, "wait_s": 0.0},  # the CPU lane reports through the MoE layer
            "steps": self.steps,
            "decode_steps": self.decode_steps,
            "decode_tokens": self.decode_tokens,
            "per_decode_token": {
                "slots_hits": self.decode_slot_hits / tok,
                "host_hits": self.decode_host_hits / tok,
                "disk_reads": self.decode_disk_reads / tok,
                "bytes_moved": self.decode_bytes_moved / tok,
            },
        }
