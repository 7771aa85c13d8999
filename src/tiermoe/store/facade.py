"""ExpertStore: the one object the MoE layer talks to.

    store = ExpertStore.open("/models/glm-int4", device="cuda", stats_file="stats.json")
    store.prefetch(layer + 1, predicted_ids)          # start disk reads one layer ahead
    experts = store.fetch(layer, [3, 17, 250])        # {id: (gate_up [2I, H], down [H, I])}

Every routed expert lives in exactly one of: a slot on the compute device ("slots"), an
entry of the RAM arena ("host", pinned on CUDA machines), or only in experts.bin ("disk").
`Residency` (policy layer) decides what moves; this class executes the moves on buffers.

Validity of returned tensors: for float stores, tensors of an expert held in slots (or in host
on a CPU device) are views into that tier's entry, valid until a later fetch() evicts it: use
them before the next fetch() (the MoE layer does), or clone. Other experts come back as fresh
tensors; int8/int4/int3 stores dequantize into fresh tensors on every fetch (plain-torch path).

Exactness: tier moves copy record bytes verbatim and float records decode as views, so a bf16
store returns bit-identical tensors whichever tier an expert came from. Integrity: every record
read from disk is sha256-checked before use (StoreIntegrityError otherwise; disk.py). An open
store holds OUT/store.lock shared, so `tiermoe pack` cannot rewrite it meanwhile (lock.py).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Collection

import torch

from tiermoe.store.disk import DiskReader
from tiermoe.store.lock import StoreLock
from tiermoe.store.opening import open_parts
from tiermoe.store.policy import top_keys
from tiermoe.store.records import Manifest, decode_record
from tiermoe.store.residency import Access, Residency
from tiermoe.store.stats import StoreCounters
from tiermoe.store.tiers import Arena, HostEvents, StagingPool

log = logging.getLogger("tiermoe.store")


class ExpertStore:
    def __init__(self, manifest: Manifest, *, device: torch.device, dtype: torch.dtype, n_slots: int, n_host: int,
                 policy: str, rates: dict[int, float] | None, static_hot: int, direct_io: bool, reader_threads: int,
                 verify: str, preload: bool, prefetch_limit: int | None, measured_rates: bool = False,
                 lock: StoreLock | None = None, served_experts: int | None = None):
        self._lock = lock  # released by close()
        # experts on disk only, of those served (all, or an expert-parallel rank's share)
        self.disk_only_experts = max(0, (served_experts or len(manifest.records)) - n_slots - n_host)
        self.manifest = manifest
        self.layout = manifest.layout  # every record's, or a mixed store's hot experts' (layouts[0])
        self.layouts = manifest.layouts
        self.device = device
        self.dtype = dtype
        self.record_bytes = manifest.record_bytes  # a tier entry: the longest record
        self._length = [r.length for r in manifest.records]  # bytes of each key's own record
        self._cuda = device.type == "cuda"
        self._events = HostEvents(self._cuda)
        self._reader_threads = reader_threads
        self._reader = DiskReader(manifest.experts_path, direct=direct_io, threads=reader_threads, verify=verify)
        rec = self.record_bytes
        self._slots = Arena(n_slots, rec, device)
        # One spare host entry: a host->slot promotion demotes the slot victim into it before
        # the promoted key's entry is released (see residency.py "swap").
        self._host = Arena(n_host + 1 if n_host else 0, rec, torch.device("cpu"), host=True, pin=self._cuda)
        self._staging = StagingPool(rec, max(2, reader_threads), self._events, pin=self._cuda)
        self._base = {}
        for r in manifest.records:
            self._base.setdefault(r.layer, r.index - r.expert)
        rates = rates or {}
        static = top_keys(rates, static_hot) if static_hot else []
        self.residency = Residency.build(policy, n_slots, n_host, static=static)
        self._slot_of: dict[int, int] = {}
        self._host_of: dict[int, int] = {}
        self._pending: dict[int, tuple[torch.Tensor, Future, int]] = {}  # key -> (buf, read, step)
        self._prefetched: set[int] = set()  # pending keys whose read prefetch() started
        # Keys the CPU lane is reading in place (see lane_records): never chosen as victims, and
        # for disk-only ones the staging buffer + read the lane owns until lane_release.
        self._held: dict[int, tuple[torch.Tensor | None, Future | None]] = {}
        self._prefetch_limit = prefetch_limit if prefetch_limit is not None else max(64, 4 * reader_threads)
        self.c = StoreCounters()
        self._last_layer: int | None = None
        self._explicit_steps = False
        self._handed_over = False  # take_host_tier() gave the host tier away
        self._step_tokens = 1
        if preload and rates:
            self.residency.warm_start(rates, seed=measured_rates)
        self._load_residents()

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, *, device: str = "cpu", dtype: torch.dtype | None = None,
             gpu_expert_gb: float | None = None, host_expert_gb: float | None = None, policy: str = "lfu",
             stats_file: str | os.PathLike | None = None, direct_io: bool = True, reader_threads: int = 16,
             verify: str = "always", static_hot: int = 0, preload: bool = True,
             prefetch_limit: int | None = None, only: Collection[int] | None = None) -> "ExpertStore":
        """Open a packed store; sizes tiers (GiB flags or machine defaults) and preloads the
        hottest experts (by `stats_file`, else in record order) into slots, then host. only: opening.py."""
        m, dev, plan, rates = open_parts(path, device=device, gpu_expert_gb=gpu_expert_gb, only=only,
                                         host_expert_gb=host_expert_gb, policy=policy, stats_file=stats_file)
        lock = StoreLock.shared(path)
        try:
            return cls(m, device=dev, dtype=dtype or m.dtype, n_slots=plan.n_slots, n_host=plan.n_host,
                       policy=policy, rates=rates, static_hot=static_hot, direct_io=direct_io,
                       reader_threads=reader_threads, verify=verify, preload=preload, prefetch_limit=prefetch_limit,
                       measured_rates=stats_file is not None, lock=lock, served_experts=len(set(only or ())))
        except BaseException:
            lock.release()
            raise

    def _load_residents(self) -> None:
        """Read every key the policies hold (warm start / static set) into its tier."""
        window: list[tuple[int, str, torch.Tensor, Future, torch.Tensor | None]] = []
        todo = [(k, "slots") for k in sorted(self.residency.slots.keys())]
        todo += [(k, "host") for k in sorted(self.residency.host.keys())]
        depth = max(2, 2 * self._reader_threads)

        def finish(item) -> None:
            k, tier, dst, fut, staged = item
            fut.result()
            self.c.disk_bytes += self._length[k]
            if staged is not None:
                dst.copy_(staged, non_blocking=True)
                self._events.record(staged)
                self._staging.put(staged)

        for k, tier in todo:
            if tier == "slots":
                e = self._slots.alloc()
                self._slot_of[k] = e
                dst = self._slots.entry(e)
            else:
                e = self._host.alloc()
                self._host_of[k] = e
                dst = self._host.entry(e)
            staged = self._staging.get() if dst.device.type != "cpu" else None
            fut = self._reader.submit(self.manifest.records[k], staged if staged is not None else dst)
            window.append((k, tier, dst, fut, staged))
            if len(window) >= depth:
                finish(window.pop(0))
        for item in window:
            finish(item)

    # -- public API -----------------------------------------------------------------------
    @property
    def config(self) -> dict[str, Any]:
        return self.manifest.config

    @property
    def moe_layers(self) -> list[int]:
        return list(self.manifest.moe_layers)

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (the maximum, if layers differ)."""
        return max(self.manifest.experts_per_layer.values())

    @property
    def path(self) -> Path:
        return self.manifest.root

    def key(self, layer: int, expert: int) -> int:
        base = self._base.get(layer)
        if base is None or not 0 <= expert < self.manifest.experts_per_layer.get(layer, 0):
            raise ValueError(f"no routed expert {expert} in layer {layer} of {self.path}")
        return base + expert

    def tier_of(self, layer: int, expert: int) -> str:
        """"slots", "host" or "disk" (a read-only residency snapshot, e.g. for schedulers)."""
        return self.residency.tier(self.key(layer, expert))

    def begin_step(self, tokens: int = 1, decode: bool = True) -> None:
        """Mark the start of a forward step of `tokens` tokens (optional: without it, a fetch
        of a layer <= the previous one starts a new single-token decode step)."""
        self._explicit_steps = True
        self._new_step(tokens, decode)

    def _new_step(self, tokens: int, decode: bool) -> None:
        self.residency.step()
        self.c.steps += 1
        self.c.in_decode = decode
        if decode:
            self.c.decode_steps += 1
            self.c.decode_tokens += tokens
        step = self.c.steps
        for k in [k for k, (_, _, s) in self._pending.items() if s < step - 2]:  # stale prefetches
            buf, fut, _ = self._pending.pop(k)
            self._prefetched.discard(k)
            self._settle(buf, fut)
            self.c.prefetch_dropped += 1

    def _settle(self, buf: torch.Tensor, fut: Future) -> None:
        try:
            fut.result()
        except Exception:
            pass  # an unused read's failure matters only if someone uses the record
        self._staging.put(buf)

    def _auto_step(self, layer: int) -> None:
        if self._handed_over:
            raise RuntimeError("the host tier was handed to another cache (take_host_tier): fetch from it")
        if not self._explicit_steps and (self._last_layer is None or layer <= self._last_layer):
            self._new_step(1, True)
        self._last_layer = layer

    def _start_read(self, key: int, step: int) -> None:
        buf = self._staging.get()
        self._pending[key] = (buf, self._reader.submit(self.manifest.records[key], buf), step)

    def _take_pending(self, key: int) -> tuple[torch.Tensor, Future]:
        """Hand a started read to the caller that needs the record. A failed prefetch is read again:
        prefetching is speculative, so its failure (a transient EIO during an earlier request,
        say) must not fail a later request that would read the record anew."""
        buf, fut, _ = self._pending.pop(key)
        if key in self._prefetched:
            self._prefetched.discard(key)
            if fut.exception() is None:
                self.c.prefetch_used += 1
            else:
                self._staging.put(buf)
                buf = self._staging.get()
                fut = self._reader.submit(self.manifest.records[key], buf)
        return buf, fut

    def prefetch(self, layer: int, expert_ids: list[int]) -> None:
        """Start disk reads for the given experts that are on disk only (non-blocking)."""
        for e in expert_ids:
            k = self.key(layer, e)
            if k in self._pending or self.residency.tier(k) != "disk":
                continue
            if len(self._pending) >= self._prefetch_limit:
                self.c.prefetch_dropped += 1
                continue
            self._start_read(k, self.c.steps)
            self._prefetched.add(k)
            self.c.prefetch_issued += 1

    def fetch(self, layer: int, expert_ids: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """{expert id: (gate_up [2I, H], down [H, I])} on the store's device in its dtype."""
        records = self.fetch_records(layer, expert_ids)
        base = self._base[layer]
        return {e: decode_record(self.layouts[self.manifest.records[base + e].layout], buf, self.dtype)
                for e, buf in records.items()}

    def layout_ids(self, layer: int) -> list[int]:
        """Index into `layouts` of each routed expert of `layer` (expert-id order)."""
        return self.manifest.layout_ids(layer)

    def fetch_records(self, layer: int, expert_ids: list[int]) -> dict[int, torch.Tensor]:
        """{expert id: raw record bytes, uint8 [record_bytes] on the device} (see records.py)."""
        return self._fetch_records(layer, expert_ids, in_place=False)

    def device_records(self, layer: int, expert_ids: list[int]) -> dict[int, torch.Tensor]:
        """{expert id: uint8 [record_bytes] record the compute device can read where it is}, for kernels
        that take record addresses (the Triton MoE kernel's pointer table). As fetch_records, but an
        expert staying in the host tier comes back as its host entry when the device can read it in
        place (a CPU; CUDA once its chunk is page-locked, mapped at the same address under unified
        addressing): read over PCIe (zero-copy), not copied. Unpinned entries and unadmitted disk-only
        experts come back as device copies. Valid until a later call evicts them; after queueing the
        kernels that read them, call `device_reads_queued` so the CPU never overwrites one meanwhile."""
        return self._fetch_records(layer, expert_ids, in_place=True)

    def device_reads_queued(self, bufs) -> None:
        """The kernels queued on the current stream read these buffers (from device_records):
        CPU writes into host entries among them wait for those kernels first."""
        if self._cuda:
            for b in bufs:
                if b.device.type == "cpu":
                    self._events.record(b)

    def host_entries(self, layer: int) -> list[torch.Tensor] | None:
        """uint8 [record_bytes] host entry of each routed expert of `layer` (id order), or None
        unless the host tier holds all of them. For inclusive device caches reading the host
        copies in place (moe/device_cache.py): with no slots and every expert in the host tier
        nothing is admitted or evicted, so these entries never move."""
        out = []
        for e in range(self.manifest.experts_per_layer[layer]):
            i = self._host_of.get(self.key(layer, e))
            if i is None:
                return None
            out.append(self._host.entry(i))
        return out

    def take_host_tier(self) -> tuple[Arena, dict[int, int], DiskReader]:
        """(host arena, {record key: its entry}, disk reader) for a cache that manages the host tier from
        now on (moe/disk_tier.py, under the device cache); this store's fetch paths refuse afterwards."""
        self._handed_over = True
        return self._host, dict(self._host_of), self._reader

    def wait_pinned(self) -> bool:
        """Block until the host tier is page-locked; True when all of it is (CUDA only)."""
        return self._cuda and self._host.wait_pinned()

    def _host_readable(self, e: int) -> bool:
        """Can the compute device read host entry e in place (see device_records)?"""
        return not self._cuda or self._host._chunks[e // self._host._per_chunk].data_ptr() in self._host._registered

    def _fetch_records(self, layer: int, expert_ids: list[int], in_place: bool) -> dict[int, torch.Tensor]:
        self._auto_step(layer)
        ids = list(dict.fromkeys(int(e) for e in expert_ids))
        keys = [self.key(layer, e) for e in ids]
        protect = set(keys) | self._held.keys()
        for k in keys:  # issue every disk read of this call first: a deep queue
            if k not in self._pending and self.residency.tier(k) == "disk":
                self._start_read(k, self.c.steps)
        out: dict[int, torch.Tensor] = {}
        try:
            for e, k in zip(ids, keys):
                staged = None
                if k in self._pending and self.residency.tier(k) == "disk":
                    buf, fut = self._take_pending(k)
                    try:
                        fut.result()
                    except BaseException:
                        self._staging.put(buf)
                        raise
                    staged = buf
                    self.c.disk_bytes += self._length[k]
                    self.c.moved(self._length[k])
                acc = self.residency.access(k, protect)
                self.c.use(acc.served, k)
                out[e] = self._execute(acc, staged, in_place)
        except BaseException:
            for k in keys:  # leave no orphaned demand reads behind
                if k in self._pending:
                    buf, fut, _ = self._pending.pop(k)
                    self._prefetched.discard(k)
                    self._settle(buf, fut)
            raise
        return out

    # -- CPU lane: read records where they sit ----------------------------------------------
    def heat(self, layer: int, expert: int) -> float:
        """How hot an expert is for the replacement policy (LFU decayed uses; 0.0 for policies
        without a score). The CPU lane's cost model sends the coldest misses to the CPU."""
        score = getattr(self.residency.host, "score", None) or getattr(self.residency.slots, "score", None)
        return float(score(self.key(layer, expert))) if score else 0.0

    def lane_records(self, layer: int, expert_ids: list[int], *,
                     disk: bool = True) -> dict[int, tuple[torch.Tensor, Future | None]]:
        """Record bytes for the CPU lane without any tier move: {expert id: (uint8 [record_bytes]
        on the CPU, pending read or None)}. Host-resident experts come back as read-only views of
        their host entry (no copy). Disk-only experts (when `disk`) get a staging buffer and an
        O_DIRECT read (sha256-checked; wait on the future first), used once and not admitted.
        Experts in slots, or on disk with disk=False, are left out (the caller computes them on the
        normal path). Each returned expert counts as one use and stays held (never a victim of
        fetch) until `lane_release`. Call from the thread that calls fetch; the lane's workers
        only read the buffers."""
        out: dict[int, tuple[torch.Tensor, Future | None]] = {}
        for e in dict.fromkeys(int(x) for x in expert_ids):
            k = self.key(layer, e)
            if k in self._held:
                raise RuntimeError(f"layer {layer} expert {e} is already held by the CPU lane")
            tier = self.residency.tier(k)
            if tier == "slots" or (tier == "disk" and not disk):
                continue
            if tier == "host":
                buf = self._host.entry(self._host_of[k])
                self._events.wait(buf)  # a queued device->host demotion may still be writing it
                fut = None
            else:
                if k in self._pending:  # a prefetch already started this read
                    buf, fut = self._take_pending(k)
                else:
                    buf = self._staging.get()
                    fut = self._reader.submit(self.manifest.records[k], buf)
                self.c.disk_bytes += self._length[k]
                self.c.moved(self._length[k])
            self.residency.slots.touch(k)
            self.residency.host.touch(k)
            self.c.use(tier, k)
            self._held[k] = (buf if fut is not None else None, fut)
            out[e] = (buf, fut)
        return out

    def lane_release(self, layer: int, expert_ids: list[int]) -> None:
        """End the CPU lane's hold on these experts (after its reads of them are done)."""
        for e in expert_ids:
            k = self.key(layer, int(e))
            held = self._held.pop(k, None)
            if held is not None and held[0] is not None:
                self._settle(held[0], held[1])

    # -- moves ------------------------------------------------------------------------------
    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One record copy, queued on the current stream on CUDA. The host side (a source still being
        read, or a destination a D2H copy still writes) gets an event: the CPU waits for it to write."""
        dst.copy_(src, non_blocking=self._cuda)
        for t in (src, dst):
            if t.device.type == "cpu":
                self._events.record(t)

    def _to_device(self, src: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.record_bytes, dtype=torch.uint8, device=self.device)
        self._copy(out, src)
        self.c.moved(self.record_bytes)
        return out

    def _evict(self, acc: Access) -> None:
        if acc.host_victim is not None:
            self._host.free(self._host_of.pop(acc.host_victim))
            self.c.host.evictions += 1
        if acc.slot_victim is None:
            return
        s = self._slot_of.pop(acc.slot_victim)
        self.c.slots.evictions += 1
        if acc.demoted:
            e = self._host.alloc()
            self._copy(self._host.entry(e), self._slots.entry(s))
            self._host_of[acc.slot_victim] = e
            self.c.slots.bytes_out += self.record_bytes
            self.c.host.bytes_in += self.record_bytes
            self.c.moved(self.record_bytes)
        self._slots.free(s)

    def _execute(self, acc: Access, staged: torch.Tensor | None, in_place: bool = False) -> torch.Tensor:
        k = acc.key
        if acc.served == "slots":
            return self._slots.entry(self._slot_of[k])
        self._evict(acc)
        if acc.served == "host":
            he = self._host_of[k]
            src = self._host.entry(he)
            if acc.to == "slots":
                s = self._slots.alloc()
                self._copy(self._slots.entry(s), src)
                del self._host_of[k]
                self._host.free(he)
                self._slot_of[k] = s
                self.c.host.bytes_out += self.record_bytes
                self.c.slots.bytes_in += self.record_bytes
                self.c.moved(self.record_bytes)
                return self._slots.entry(s)
            if self.device.type == "cpu":
                return src
            if in_place and self._host_readable(he):
                self.c.moved(self._length[k])  # the kernel reads it over PCIe
                return src
            self.c.host.bytes_out += self.record_bytes
            return self._to_device(src)
        assert staged is not None
        try:
            if acc.to == "slots":
                s = self._slots.alloc()
                self._copy(self._slots.entry(s), staged)
                self._slot_of[k] = s
                self.c.slots.bytes_in += self.record_bytes
                return self._slots.entry(s)
            if acc.to == "host":
                e = self._host.alloc()
                dst = self._host.entry(e)
                self._events.wait(dst)
                dst.copy_(staged)
                self._host_of[k] = e
                self.c.host.bytes_in += self.record_bytes
                if self.device.type == "cpu":
                    return dst
                if in_place and self._host_readable(e):
                    self.c.moved(self._length[k])
                    return dst
                return self._to_device(dst)
            if self.device.type == "cpu":
                return staged.clone()
            return self._to_device(staged)
        finally:
            self._staging.put(staged)

    # -- reporting / teardown -------------------------------------------------------------------
    def counters(self) -> dict:
        return self.c.as_dict(
            slots_capacity=self.residency.slots.capacity, slots_resident=len(self.residency.slots),
            host_capacity=self.residency.host.capacity, host_resident=len(self.residency.host),
            reads_in_flight=self._reader.in_flight, record_bytes=self.record_bytes,
        )

    def close(self) -> None:
        for k in list(self._held):
            buf, fut = self._held.pop(k)
            if buf is not None:
                self._settle(buf, fut)
        for k in list(self._pending):
            buf, fut, _ = self._pending.pop(k)
            self._settle(buf, fut)
        self._prefetched.clear()
        if self._cuda:
            torch.cuda.synchronize()
        self._reader.close()
        self._host.close()
        self._slots.close()
        self._staging.close()
        if self._lock is not None:
            self._lock.release()

    def __enter__(self) -> "ExpertStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
