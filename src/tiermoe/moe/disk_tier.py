"""Host RAM as a cache of the disk under the device cache: the disk tier's host side.

The device cache (device_cache.py) keeps copies of some experts in GPU slots and reads or copies
the rest from pinned host RAM. When RAM cannot hold every routed expert (GLM-5.3-Flash's 162 GB of
int4 experts on a 128 GB machine), host RAM becomes a cache of the store's disk tier, kept here:

- `addr` [L, E] int64: the host entry's address of each (layer row, expert), 0 when it is on disk
  only. It is the host's truth; the CPU lane reads records by it. The device keeps its own copy in
  each cache's `host_addr`, changed only by answers (kernels/triton/residency.py) or, on the
  host-synchronous paths, by `apply`.
- Decode steps: the server thread answers the device's requests (ResidencyMailbox) with O_DIRECT
  reads (the store's DiskReader, sha256-checked) into free entries, evicting entries of other
  layers when none is free (the requesting layer's own may be read by its step). The device waits
  in a step that needs a read and in no other.
- Other steps (prefill chunks, decode steps larger than the cache kernel takes): `ensure_now`
  reads the layer's picks back (such a step's host sync; every earlier kernel is then done, so
  other layers' entries may be reused) and loads them in the caller's thread.
- Reads ahead need free entries while the device runs (an entry the device may read is freed only in an
  answer), so each answer keeps `reserve` entries free by evicting the coldest. A freed entry keeps its record
  ("parked") until a read takes it, the oldest parked first: a request for a parked expert takes its entry
  back without reading the disk. Without that, the reserve cost RAM its coldest `reserve` experts for good
  (`tiermoe sim --reserve`: 19.6 -> 20.9 disk reads a token at 64 of 1,843 entries, docs/results.md).
- Eviction: the coldest first, then the oldest load. Cold is the statistics' expected picks per
  token at start, then, every HEAT_STEPS decode steps, the device cache's own decayed pick counts
  (its kernel's `freq`, warm-started from the same statistics), so RAM follows the routing the
  server really sees. Under steady routing the popular experts stay, as in the static placement
  that bounds any online policy under independent picks (`tiermoe sim`).

Failures: a record that fails its read or its checksum is answered with the zero record and the
error mark; `check` (after the step's device work) then raises the store's error, once, after
`repair` put the tables right (the device's copy resynchronised from `addr`, slots that admitted
the zero record emptied), so a later step reads the record again and other requests go on.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from tiermoe.errors import StoreError
from tiermoe.kernels.cache_policy import HEAT_STEPS



@dataclass
class DiskTierCounters:
    requests: int = 0  # device requests answered (decode steps that needed a read)
    decode_reads: int = 0  # experts read from disk for those
    other_reads: int = 0  # ... for host-synchronous steps (prefill, large decode steps, warm start)
    bytes_read: int = 0
    evictions: int = 0  # host entries taken from another expert
    failed_reads: int = 0
    read_s: float = 0.0  # wall seconds waiting for reads
    prefetch_issued: int = 0  # reads started from the device's layer-ahead hints
    prefetch_used: int = 0  # ... whose expert a request then asked for
    prefetch_wasted: int = 0  # ... dropped unused (their entry was needed first)
    prefetch_failed: int = 0  # ... that failed (the request reads the record anew)
    reclaimed: int = 0  # experts a request took back from a parked entry (evicted, not yet overwritten): no read

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class DiskTier:
    """The host tier of a device cache whose RAM holds only some experts (module docstring).

    store: an ExpertStore with no slots whose host tier it takes over (take_host_tier); layers: the
    MoE layers in the device cache's row order; rates: {record key: expected picks per token};
    zero_addr: address of an all-zero record the device may read (failures answer with it); only: the record
    keys this process computes (an expert-parallel rank's share: start-up placement takes no others)."""

    def __init__(self, store, layers: list[int], rates: Mapping[int, float], zero_addr: int, reserve: int = 0,
                 only: Collection[int] | None = None) -> None:
        self.arena, held, self.reader = store.take_host_tier()
        self.records = store.manifest.records
        self.layers = list(layers)
        self.row_of = {layer: row for row, layer in enumerate(self.layers)}
        self.sizes = [store.manifest.experts_per_layer[layer] for layer in self.layers]
        self.zero_addr = int(zero_addr)
        self.addr = torch.zeros(len(self.layers), max(self.sizes, default=0), dtype=torch.int64)  # [L, E]
        self._key = [[store.key(layer, e) for e in range(n)] for layer, n in zip(self.layers, self.sizes)]
        self._rate = [[float(rates.get(k, 0.0)) for k in keys] for keys in self._key]
        self._entry: dict[tuple[int, int], int] = {}  # (row, expert) -> host entry
        self._stamp: dict[tuple[int, int], int] = {}  # (row, expert) -> load number (heap validity)
        self._heap: list[tuple[float, int, int, int]] = []  # (rate, load number, row, expert): eviction order
        self._loads = 0
        self.only = None if only is None else frozenset(only)
        for key, entry in held.items():
            rec = self.records[key]
            self._hold(self.row_of[rec.layer], rec.expert, entry)
        self.free = [self.arena.alloc() for _ in range(self.arena.free_entries)]  # entries holding nothing
        self._parked: OrderedDict[int, tuple[int, int]] = OrderedDict()  # free entry -> the record it still holds
        self._parked_at: dict[tuple[int, int], int] = {}  # (row, expert) -> its parked entry
        self.capacity = len(self.free) + len(self._entry)
        # layer-ahead prefetch: reads started into free entries, not yet announced to the device (so an entry
        # here is referenced by no device table); `reserve` free entries are kept for them by each answer
        self._pending: dict[tuple[int, int], tuple[int, object]] = {}  # (row, expert) -> (entry, read)
        self.reserve = min(max(0, int(reserve)), self.capacity // 8)  # an eighth of RAM at most: RAM is for hits
        self._hint_seen = 0
        self._checks = 0  # decode steps checked (the heat is read every HEAT_STEPS)
        self.lock = threading.Lock()
        self.c = DiskTierCounters()
        self.failure: BaseException | None = None  # the last failed read, raised by check()
        self.mailbox = None  # kernels.triton.residency.ResidencyMailbox, set by attach()
        self.caches: list = []  # each row's ExpertCache, set by attach()
        self.active = threading.Event()  # set from a decode step's start to its check: the server polls then
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the host's truth -------------------------------------------------------------------------
    def _hold(self, row: int, e: int, entry: int, transient: bool = False) -> None:
        """(row, e) now in `entry`; transient: first in the eviction order (a prefill chunk's load)."""
        self._loads += 1
        self._entry[(row, e)] = entry
        self._stamp[(row, e)] = self._loads
        self.addr[row, e] = self.arena.entry(entry).data_ptr()
        heapq.heappush(self._heap, (-1.0 if transient else self._rate[row][e], self._loads, row, e))

    def _park(self, row: int, e: int, entry: int) -> None:
        """`entry`, just evicted from (row, e), is free and still holds (row, e)'s record."""
        self._parked[entry] = (row, e)
        self._parked_at[(row, e)] = entry

    def _unpark(self, entry: int) -> int:
        del self._parked_at[self._parked.pop(entry)]
        return entry

    def _take_free(self, keep: Collection[tuple[int, int]] = ()) -> int | None:
        """A free entry to read into: one holding nothing, else the oldest parked one whose record is not in
        `keep` (wanted by the same request or hint); None: none."""
        if self.free:
            return self.free.pop()
        for entry, key in self._parked.items():
            if key not in keep:
                return self._unpark(entry)
        return None

    def _victim(self, row: int) -> tuple[int, int, int] | None:
        """(row, expert, entry) to evict: the coldest held expert of another row (None: none)."""
        skipped, found = [], None
        while self._heap:
            item = heapq.heappop(self._heap)
            _, stamp, r, e = item
            if self._stamp.get((r, e)) != stamp:
                continue  # evicted or reloaded since: a stale heap item
            if r == row:
                skipped.append(item)
                continue
            found = (r, e, self._entry.pop((r, e)))
            del self._stamp[(r, e)]
            self.addr[r, e] = 0
            break
        for item in skipped:
            heapq.heappush(self._heap, item)
        return found

    def record(self, row: int, e: int) -> torch.Tensor:
        """uint8 [record_bytes] record of (row, e): its host entry when held, else read from disk into a
        fresh buffer (the device cache's warm start fills slots this way, leaving RAM as it is)."""
        from tiermoe.store.disk import aligned_buffer

        with self.lock:
            entry = self._entry.get((row, e))
            if entry is not None:
                return self.arena.entry(entry)
        rec = self.records[self._key[row][e]]
        buf = aligned_buffer(self.arena.record_len)
        self.reader.read(rec, buf)
        self.c.other_reads += 1
        self.c.bytes_read += rec.length
        return buf

    def row_records(self, row: int) -> "HeldRecords":
        return HeldRecords(self, row)

    def ensure(self, row: int, experts: list[int], decode: bool, transient: bool = False
               ) -> tuple[list[tuple[int, int, int]], list[int], BaseException | None]:
        """Load `experts` of layer row `row` that are on disk only into host entries (transient: they are
        evicted first, so a prefill chunk, which picks nearly every expert of each layer, does not push
        the popular experts out of RAM: it churns about one layer's worth of entries).

        Returns (updates, failed experts, error): updates are every (row, expert, address) change
        made, the loads and the evictions (address 0), which the device must apply whatever else
        happened; a failed expert stays on disk only and `error` says why."""
        updates: list[tuple[int, int, int]] = []
        failed: list[int] = []
        error: BaseException | None = None
        with self.lock:
            reads = []
            wanted = {(row, e) for e in experts}
            for e in sorted(experts, key=lambda e: (row, e) not in self._parked_at):  # parked ones taken back first
                if (row, e) in self._entry:
                    continue
                if (row, e) in self._parked_at:  # evicted, its entry not yet overwritten: taken back, no read
                    self._hold(row, e, self._unpark(self._parked_at[(row, e)]), transient)
                    updates.append((row, e, int(self.addr[row, e])))
                    self.c.reclaimed += 1
                    continue
                if (row, e) in self._pending:  # a layer-ahead read: announced now
                    entry, fut = self._pending.pop((row, e))
                    if fut.exception() is None:
                        self._hold(row, e, entry)
                        updates.append((row, e, int(self.addr[row, e])))
                        self.c.prefetch_used += 1
                        self.c.bytes_read += self.records[self._key[row][e]].length
                        self.c.decode_reads += decode
                        self.c.other_reads += not decode
                        continue
                    self.c.prefetch_failed += 1  # read again below: a prefetch's failure fails nothing
                    self.free.append(entry)
                entry = self._free_entry(wanted)
                if entry is None:
                    victim = self._victim(row)
                    if victim is None:
                        failed.append(e)
                        error = StoreError(f"host RAM holds {self.capacity} expert records, too few beside layer "
                                           f"{self.layers[row]}'s own: raise --host-expert-gb")
                        continue
                    vr, ve, entry = victim
                    self.c.evictions += 1
                    updates.append((vr, ve, 0))
                rec = self.records[self._key[row][e]]
                reads.append((e, entry, rec, self.reader.submit(rec, self.arena.entry(entry))))
            t0 = time.perf_counter()
            for e, entry, rec, fut in reads:
                try:
                    fut.result()
                except Exception as exc:  # StoreIntegrityError / StoreIOError: the store's own message
                    failed.append(e)
                    error = exc
                    self.free.append(entry)
                    self.c.failed_reads += 1
                    continue
                self._hold(row, e, entry, transient)
                updates.append((row, e, int(self.addr[row, e])))
                self.c.bytes_read += rec.length
                if decode:
                    self.c.decode_reads += 1
                else:
                    self.c.other_reads += 1
            self.c.read_s += time.perf_counter() - t0
            while decode and len(self.free) + len(self._parked) < self.reserve:  # room for the next hints
                victim = self._victim(row)
                if victim is None:
                    break
                vr, ve, entry = victim
                self.c.evictions += 1
                updates.append((vr, ve, 0))  # announced with this answer
                self._park(vr, ve, entry)
        return updates, failed, error

    def _free_entry(self, keep: Collection[tuple[int, int]] = ()) -> int | None:
        """A free entry (_take_free), else one a prefetch holds unannounced (its read settled first); None:
        neither."""
        entry = self._take_free(keep)
        if entry is not None:
            return entry
        if self._pending:
            key = next(iter(self._pending))
            entry, fut = self._pending.pop(key)
            fut.exception()  # wait for the read into it; its outcome no longer matters
            self.c.prefetch_wasted += 1
            return entry
        return None

    def prefetch(self, row: int, experts: list[int]) -> None:
        """Start reading `experts` of layer row `row` (a layer-ahead hint) into free entries, without
        evicting: the device learns of them only when the row asks (ensure)."""
        with self.lock:
            wanted = {(row, e) for e in experts}
            for e in experts:
                if (row, e) in self._entry or (row, e) in self._pending or (row, e) in self._parked_at:
                    continue  # held, being read, or parked (its request takes it back)
                entry = self._take_free(wanted)
                if entry is None:
                    return
                rec = self.records[self._key[row][e]]
                self._pending[(row, e)] = (entry, self.reader.submit(rec, self.arena.entry(entry)))
                self.c.prefetch_issued += 1

    def make_exclusive(self, in_slots: Mapping[int, list[int]]) -> None:
        """Start-up placement as static placement over three tiers: the experts the device cache put in
        GPU slots (`in_slots`: row -> experts) leave RAM, and RAM (less the read-ahead reserve) holds the
        most popular of the others (by rate; among equals those it holds already), read now. The
        device's tables follow (`apply`). RAM then holds the next most popular experts after the
        slots', not copies of them."""
        slotted = {(row, e) for row, es in in_slots.items() for e in es}
        others = [(row, e) for row, n in enumerate(self.sizes) for e in range(n)
                  if (row, e) not in slotted and (self.only is None or self._key[row][e] in self.only)]
        others.sort(key=lambda k: (-self._rate[k[0]][k[1]], k not in self._entry, k))
        keep = set(others[: max(0, self.capacity - self.reserve)])
        updates: list[tuple[int, int, int]] = []
        with self.lock:
            for key in sorted(k for k in self._entry if k not in keep):
                self._park(*key, self._entry.pop(key))
                del self._stamp[key]
                self.addr[key] = 0
                updates.append((*key, 0))
        by_row: dict[int, list[int]] = {}
        for row, e in sorted(k for k in keep if k not in self._entry):
            by_row.setdefault(row, []).append(e)
        for row, es in by_row.items():  # a record that cannot be read now is read (and reported) when picked
            updates += self.ensure(row, es, decode=False)[0]
        self.apply(updates)

    # -- the device's tables ----------------------------------------------------------------------
    def attach(self, mailbox, caches: list) -> None:
        """The device side: the residency mailbox over `caches` (each row's ExpertCache, whose host_addr
        rows start as `addr`'s); starts the server thread."""
        self.mailbox, self.caches = mailbox, list(caches)
        self._thread = threading.Thread(target=self._run, name="tiermoe-disk-tier", daemon=True)
        self._thread.start()

    def apply(self, updates: list[tuple[int, int, int]]) -> None:
        """Host-synchronous twin of the answer kernel: host_addr rows, and ptr_table rows of experts not in
        a slot (kernels.reference.residency_apply_ref, vectorised per row)."""
        by_row: dict[int, list[tuple[int, int]]] = {}
        for row, e, a in updates:
            by_row.setdefault(row, []).append((e, a))
        for row, pairs in by_row.items():
            cache = self.caches[row]
            dev = cache.host_addr.device
            idx = torch.tensor([e for e, _ in pairs], dtype=torch.long, device=dev)  # [n]
            addr = torch.tensor([a for _, a in pairs], dtype=torch.int64, device=dev)  # [n]
            cache.host_addr[idx] = addr
            cache.ptr_table[idx] = torch.where(cache.expert_slot[idx] >= 0, cache.ptr_table[idx], addr)

    def ensure_now(self, layer: int, topk_ids: torch.Tensor) -> None:
        """A host-synchronous step's picks [T, k] of `layer` into RAM, tables updated before its kernels
        are queued; raises the store's error for a record that cannot be read (after the changes that
        were made are applied)."""
        row = self.row_of[layer]
        ids = list(dict.fromkeys(int(e) for e in topk_ids.reshape(-1).tolist()))  # the sync
        if all((row, e) in self._entry for e in ids):
            return
        updates, failed, error = self.ensure(row, ids, decode=False, transient=True)
        self.apply(updates)
        if failed:
            raise error if error is not None else StoreError(f"layer {layer}: experts {failed} could not be read")

    # -- the server thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            # between decode steps: a look every 50 ms (a request of a step nobody began is late, not lost)
            idle = not self.active.wait(timeout=0.05)
            seq = self.mailbox.pending()
            if idle and not seq:
                continue
            if not seq:
                self._hint_seen, hints = self.mailbox.read_hints(self._hint_seen)
                for row, experts in hints:  # oldest first: the nearest layer's reads start first
                    if 0 <= row < len(self.sizes):
                        self.prefetch(row, [e for e in experts if 0 <= e < self.sizes[row]])
                if not hints:
                    time.sleep(1e-4)  # requests wait for disk reads of milliseconds: no need to spin
                continue
            row, experts = self.mailbox.read_request()
            try:
                updates, failed, error = self.ensure(row, experts, decode=True)
            except Exception as exc:  # the device must still be released
                updates, failed, error = [], experts, exc
            if failed:
                self.failure = error
                updates += [(row, e, self.zero_addr) for e in failed]
            self.c.requests += 1
            self.mailbox.answer(seq, updates, failed=bool(failed))

    def begin(self) -> None:
        """A decode step starts: requests may come until `check`."""
        self.active.set()

    def check(self) -> None:
        """After a step's device work: raise, once, for a read that failed or an answer that came too
        late, after `repair`; the step's tokens must then not be served."""
        if self.mailbox is None:
            return
        if self.mailbox.device.type == "cuda":
            torch.cuda.current_stream(self.mailbox.device).synchronize()
        err = self.mailbox.error()
        if not err:
            self.active.clear()
            self._checks += 1
            if self._checks % HEAT_STEPS == 0:
                self.refresh_heat()
            return
        deadline = time.monotonic() + 60.0  # a late answer lands first, so the host's state is final
        while self.mailbox.pending() and time.monotonic() < deadline:
            time.sleep(1e-3)
        self.active.clear()
        with self.lock:
            row, requested = self.mailbox.read_request()
            self.repair(row, requested)
        self.mailbox.clear_error()
        failure, self.failure = self.failure, None
        if err < 0 and failure is not None:
            raise failure
        raise RuntimeError("the disk tier did not answer a decode step's request in time")

    def refresh_heat(self) -> None:
        """Eviction order from the device's decayed pick counts (each cache's `freq`, read after the step's
        sync): the heap is rebuilt over what RAM holds, coldest first."""
        heat = [c.freq[: n].cpu().tolist() for c, n in zip(self.caches, self.sizes)]
        with self.lock:
            self._rate = [[float(f) for f in row] for row in heat]
            self._heap = [(self._rate[r][e], self._stamp[(r, e)], r, e) for r, e in self._entry]
            heapq.heapify(self._heap)

    def repair(self, row: int, requested: list[int]) -> None:
        """After a failed request of layer row `row`: every row's host_addr from `addr`, experts of the
        request that a slot admitted (with the zero record) out of their slot, ptr_table rebuilt."""
        for r, cache in enumerate(self.caches):
            n = cache.num_experts
            cache.host_addr.copy_(self.addr[r, :n].to(cache.host_addr.device))
            if r == row and requested:
                idx = torch.tensor(requested, dtype=torch.long, device=cache.expert_slot.device)
                slots = cache.expert_slot[idx].long()  # [m]
                held = slots[slots >= 0]
                cache.slot_expert[held] = -1
                cache.expert_slot[idx] = -1
            es = cache.expert_slot.long()
            cache.ptr_table[:n] = torch.where(es >= 0, cache.slot_addr[es.clamp(min=0)], cache.host_addr)

    def counters(self) -> dict:
        return {**self.c.as_dict(), "ram_entries": self.capacity, "ram_free": len(self.free) + len(self._parked),
                "device_wait_polls": self.mailbox.wait_polls() if self.mailbox is not None else 0}

    def close(self) -> None:
        """Stop the server thread (queued device waits are answered first on CUDA)."""
        if self.mailbox is not None and self.mailbox.device.type == "cuda":
            torch.cuda.synchronize(self.mailbox.device)
        self._stop.set()
        self.active.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


class HeldRecords:
    """Records of one layer row by expert id, as the CPU lane's plain-torch path takes them (the compiled
    path reads `DiskTier.addr` directly): the host entry an expert is held in now."""

    def __init__(self, tier: DiskTier, row: int) -> None:
        self.tier, self.row = tier, row

    def __getitem__(self, e: int) -> torch.Tensor:
        entry = self.tier._entry.get((self.row, int(e)))
        if entry is None:
            raise StoreError(f"layer {self.tier.layers[self.row]} expert {e} is not in host RAM")
        return self.tier.arena.entry(entry)

    def __len__(self) -> int:
        return self.tier.sizes[self.row]
