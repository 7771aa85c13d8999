"""The "device-cache" backend: the GPU slot cache decided on the device, no host sync per MoE layer.

The store backends (moe/store_backends.py) decide tiers in Python: every MoE layer of every step
reads the router's picks back to the host (`unique().tolist()`), runs the store's policy and
uploads a pointer table, a host round trip per layer that also keeps decode steps out of CUDA
graphs. Here the decision runs on the device instead, with the kernels of
`kernels.triton.cache_manager`:

    per MoE layer, decode step:  cache_step(topk_ids) -> gather(admitted + staged misses)
                                 -> fused_moe(x, topk_ids, topk_weights, step_table)
    prefill step of >= STAGE_TOKENS tokens: the layer's non-resident experts are copied
                                 host -> staging rows (copy engine, one copy per run of
                                 adjacent records; planned once per chunk and one layer ahead
                                 for large chunks: moe/prefill_staging.py), fused_moe reads
                                 slots + staging rows
    other steps (non-decode chunks under STAGE_TOKENS, decode steps with more picks than the
    cache kernel takes):         fused_moe(..., ptr_table): slot experts from HBM, the rest
                                 read in place from pinned host memory
    (prefill leaves the cache unchanged)

so the CPU only queues kernels and runs ahead of the GPU through the whole forward.

Placement is inclusive: the store's host tier holds every routed expert (pinned, so the GPU
reads any of them in place) and the GPU slots hold copies of some. An eviction only rewrites a
table row; an admission is one copy of a record host -> slot. That is with host RAM for all the
experts (`--host-expert-gb` >= the experts' size). With RAM for some (disk=True), host RAM is a
cache of the disk kept by moe/disk_tier.py (its start-up placement leaves the slots' experts out of
RAM), and every step first makes its picks resident there (`_resident`). The store is opened with
no slots of its own and this class owns the GPU budget: `--gpu-expert-gb` = slots of every layer +
the staging rows (`split_budget`). The store's replacement policy (`--expert-policy`) has no slots
to manage here: the cache kernel's CLOCK with frequency admission decides.

Exactness: the kernel reads a record's bytes wherever they sit; the tier changes one table
entry, never the launch configuration or the summation order, so outputs are bit-identical to
the store-triton backend and across budgets (tests/moe/test_device_cache.py, exact mode).
A mixed store (`pack --cold-quant`) changes only what a row holds: slots, staging rows and host
entries are all `store.record_bytes` long (the longest layout; a shorter record at the start of
its row; a miss copies its own record's bytes, restore_decisions whole rows), and each layer's kind
table (moe/fused.py, by expert id, so the same in every tier) tells the kernel which layout to read
each expert's row at.

Fast mode (`lane_forward`, answered by moe/device_lane.py; no host sync either, so it is
captured in decode graphs too):

    per MoE layer, decode step:  cache_step(topk_ids, lane=True) also picks the lane's experts
                                 (the coldest misses it does not admit; not staged: no PCIe
                                 bytes; admissions as in exact mode)
                                 -> mailbox.post(x, lane ids + routing)   the host lane starts
                                 -> gather(admitted + staged) -> fused_moe(lane rows at an
                                    all-zero record, their weights 0)      the GPU meanwhile
                                 -> mailbox.wait_add(out)  out += the lane's fp32 partial sum
"""

from __future__ import annotations

from typing import Collection, Hashable, Sequence

import torch

from tiermoe.moe.prefill_staging import STAGE_TOKENS, PrefillStaging, SlotLender, lend_share
from tiermoe.moe.store_backends import StoreBackend
from tiermoe.store.planner import expected_hits
from tiermoe.store.slot_split import split_by_popularity, staging_rows

# A disk tier's reads ahead: each decode layer hints the predicted picks of this many next MoE layers. One
# 13 MB O_DIRECT read takes longer than a layer's compute, so hints one layer ahead left the disk idle about
# half of each token (docs/results.md section 26); the reserve of free entries grows with it.
LAYERS_AHEAD = 2


def split_budget(slots: int, experts: list[int], top_k: int, max_tokens: int,
                 stage_misses: bool = True, rates: Sequence[Sequence[float]] | None = None) -> tuple[int, list[int]]:
    """(staging rows, slots of each layer) for a GPU budget of `slots` records over MoE layers
    of `experts[i]` routed experts: staging rows for the misses the filter does not admit
    (shared by all layers: stream order) come out of the budget first, at most half of it; the
    rest goes to the layers by popularity (`store.slot_split`; rates[i][e]: expected picks of
    layer i's expert e; None or uniform rates: evenly)."""
    stage_rows = staging_rows(slots, top_k, max_tokens, stage_misses) if experts else 0
    if rates is None:
        rates = [[1.0] * n for n in experts]
    if [len(r) for r in rates] != list(experts):
        raise ValueError("split_budget: one rate per routed expert of every layer")
    return stage_rows, split_by_popularity(int(slots) - stage_rows, rates)


def prefill_plan(experts: list[int], slots_per_layer: list[int], prefill_rows: int | None,
                 prefill_buffers: int | None) -> tuple[int, int]:
    """(staging rows per buffer as asked, buffers) where either is None: rows default to the
    most non-resident experts of any layer (a chunk then never reads in place); two buffers
    when the rows hold two layers' non-resident experts (copies run one layer ahead)."""
    most = max((n - s for n, s in zip(experts, slots_per_layer)), default=0)
    rows = most if prefill_rows is None else max(0, int(prefill_rows))
    if prefill_buffers is None:
        prefill_buffers = 2 if most and rows >= 2 * most else 1
    return rows, prefill_buffers


class DeviceCacheExperts(StoreBackend):
    """The device-cache backend over an ExpertStore whose host tier holds every routed expert.

    store: ExpertStore (no slots of its own, host tier complete and page-locked); slots: GPU
    record budget (all layers, staging rows included); rates: {record key: expected picks per
    token} (warm start: the most picked experts go into slots first, and seed the admission
    filter); max_tokens: the largest decode batch; top_k: the model's picks per token;
    prefill_rows: staging rows for prefill chunks (None: the most non-resident experts of any
    layer, so a chunk never reads in place; 0: prefill reads misses in place); prefill_buffers:
    2 stages large chunks one layer ahead on a side stream in two buffers of that many rows
    (None: 2 when prefill_rows holds two layers' non-resident experts, else 1). A chunk of
    thousands of tokens touches nearly every expert, and the kernel would read an in-place
    record once per block of tokens; one copy per record is several times cheaper;
    stage_misses: False reads the misses the filter does not admit in place (no staging rows; the
    MoE kernel reads them over PCIe) instead of gathering them into HBM first; borrow_slots: a
    second staging buffer lent by the slots (prefill_staging.SlotLender); lane_cap: most experts
    per layer and step the CPU lane may take in fast mode (`set_lane`); measured_rates: `rates` come from
    routing statistics (/stats then reports the slot hits of their best static placement, `static_bound`)."""

    kernel = "triton"

    def __init__(self, store, slots: int, rates: dict[int, float], top_k: int, max_tokens: int,
                 swiglu_limit: float | None = None, config: dict | None = None, max_picks: int = 128,
                 prefill_rows: int | None = None, stage_misses: bool = True, prefill_buffers: int | None = None,
                 borrow_slots: bool = False, lane_cap: int = 0, disk: bool = False,
                 only: Collection[int] | None = None, measured_rates: bool = False) -> None:
        from tiermoe.kernels.triton.cache_manager import ExpertCache
        from tiermoe.moe.fused import FusedMoE

        super().__init__(store, swiglu_limit, prefetch=False)  # every expert is in host RAM: no disk reads
        self.fused = FusedMoE.for_store(store, config, swiglu_limit)  # a mixed store: kind tables per layer
        self.layout = self.fused.layout  # (a mixed store's hot experts'; self.fused.layouts has every one)
        self.top_k = int(top_k)
        self.max_picks = int(max_picks)  # cache steps above this fall back to the canonical table
        dev = store.device
        r = store.record_bytes
        layers = list(store.moe_layers)
        all_entries = {layer: store.host_entries(layer) for layer in layers}
        self.disk = None  # moe/disk_tier.DiskTier when host RAM holds only some experts
        if any(entries is None for entries in all_entries.values()):
            if not disk:
                raise ValueError("the host tier does not hold every routed expert (a disk tier is off)")
            from tiermoe.moe.disk_tier import DiskTier

            # a step's worth of free entries kept for each layer's reads ahead
            self.disk = DiskTier(store, layers, rates, self.fused.zero_record(dev).data_ptr(),
                                 reserve=LAYERS_AHEAD * self.top_k * max(1, int(max_tokens)), only=only)
            prefill_rows, borrow_slots = 0, False  # prefill reads in place after its host-synchronous loads
            all_entries = {layer: [] for layer in layers}
            counts = list(self.disk.sizes)
        else:
            counts = [len(all_entries[layer]) for layer in layers]
        rates_of = [[float(rates.get(store.key(layer, e), 0.0)) for e in range(n)] for layer, n in zip(layers, counts)]
        self.stage_rows, per_layer = split_budget(slots, counts, self.top_k, max_tokens, stage_misses, rates_of)
        self.slots_per_layer: dict[int, int] = dict(zip(layers, per_layer))
        self.scratch = torch.empty(max(1, self.stage_rows), r, dtype=torch.uint8, device=dev)
        self.caches: dict[int, ExpertCache] = {}
        self.entries: dict[int, list[torch.Tensor]] = {}  # host entry of each routed expert
        most = max((n - s for n, s in zip(counts, per_layer)), default=0)
        rows, prefill_buffers = prefill_plan(counts, per_layer, prefill_rows, prefill_buffers)
        self.prefill_rows = min(rows, most) if prefill_buffers == 2 or rows > most else rows  # per buffer
        # Slot lending: a layer lends at most its last `share` slots, so a loan grows no layer's
        # non-resident experts by more than `share`; both buffers get that many rows more.
        lendable = borrow_slots and prefill_buffers == 1 and self.prefill_rows
        share = lend_share(per_layer, self.prefill_rows) if lendable else 0
        if share:
            self.prefill_rows = min(self.prefill_rows + share, max(counts))
            prefill_buffers = 2
        # One arena [sum S, R] for every layer's slots: first each layer's own slots, then the
        # lendable ones of every layer side by side, so a loan is one contiguous buffer.
        lent, left = {}, self.prefill_rows if share else 0  # exactly one buffer's rows, at most `share` a layer
        for layer in reversed(layers):
            lent[layer] = min(share, self.slots_per_layer[layer], left)
            left -= lent[layer]
        self.arena = torch.empty(max(1, sum(self.slots_per_layer.values())), r, dtype=torch.uint8, device=dev)
        self.lend_start = sum(s - lent[layer] for layer, s in self.slots_per_layer.items())  # first lendable row
        own, tail = 0, self.lend_start
        for row, layer in enumerate(layers):
            entries, s, n = all_entries[layer], self.slots_per_layer[layer], counts[row]
            # arena row of each slot [s]: the layer's own rows, then its lendable ones
            arena_rows = torch.cat([torch.arange(own, own + s - lent[layer]), torch.arange(tail, tail + lent[layer])])
            own, tail = own + s - lent[layer], tail + lent[layer]
            host_addr = (self.disk.addr[row, :n].to(dev, copy=True) if self.disk is not None else  # [E], 0: disk only
                         torch.tensor([t.data_ptr() for t in entries], dtype=torch.int64, device=dev))
            slot_addr = (self.arena.data_ptr() + arena_rows * r).to(dev)  # [s] int64
            cache = ExpertCache(host_addr, slot_addr, s, r, max_picks=self.max_picks,
                                scratch_base=self.scratch.data_ptr(), scratch_slots=self.stage_rows, lane_max=lane_cap,
                                record_words=self._record_words(layer))
            layer_rates = torch.tensor(rates_of[layers.index(layer)])  # [E] expected picks per token
            order = torch.argsort(layer_rates, descending=True, stable=True).tolist()
            for e, slot in cache.warm_start(order[:s]):
                self.arena[int(arena_rows[slot])].copy_(entries[e] if self.disk is None else self.disk.record(row, e))
            cache.warm_frequencies(layer_rates.clamp(max=1.0).to(dev))
            self.caches[layer] = cache
            self.entries[layer] = entries
        if self.disk is not None:
            from tiermoe.kernels.triton.residency import ResidencyMailbox

            tables = [(c.host_addr, c.ptr_table, c.expert_slot) for c in self.caches.values()]
            self.disk_mailbox = ResidencyMailbox(tables, self.max_picks, 2 * self.max_picks, self.disk.zero_addr, dev)
            self.disk.attach(self.disk_mailbox, list(self.caches.values()))
            self.disk.make_exclusive({row: [e for e in c.slot_expert.tolist() if e >= 0]
                                      for row, c in enumerate(self.caches.values())})
        lender = SlotLender(self, lent) if share else None
        self.prefill = PrefillStaging(self.entries, self.caches, r, self.prefill_rows, prefill_buffers, dev,
                                      lender=lender)
        self.steps = 0  # layer calls that ran a cache step
        self.table_calls = 0  # layer calls served from the canonical table (prefill, large steps)
        self.lane_calls = 0
        self.graph_replays = 0  # decode steps replayed from CUDA graphs (runner/decode_graph.py)
        self.device_lane = None  # the DeviceLane answering lane steps (fast mode): its counters join ours
        self._step_start = (0, 0)  # (cache steps, lane calls) when the current step began
        self._graph_counts: dict[Hashable, tuple[int, int]] = {}  # what each recorded program counts
        self.static_bound = expected_hits(rates, self.slots_total, 0)["slots"] if measured_rates else None  # /stats

    @property
    def slots_total(self) -> int:
        return sum(self.slots_per_layer.values())

    # -- the seam --------------------------------------------------------------------------------
    def begin_step(self, tokens: int, decode: bool) -> None:
        """Before each forward: a large prefill chunk plans its staging once (PrefillStaging)."""
        super().begin_step(tokens, decode)
        self.prefill.begin(0 if decode else tokens)  # a decode step drops the last chunk's plan
        if self.disk is not None and decode:
            self.disk.begin()
        self._step_start = (self.steps, self.lane_calls)  # so a graph replay can count it again

    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                decode: bool | None = None, partial: bool = False) -> torch.Tensor:
        """x [T, H], topk_ids/topk_weights [T, k] -> [T, H] in x's dtype, or with `partial` the fp32 sum before
        its rounding (FusedMoE). No host sync. decode: this call's kind (None: the current step's, from
        begin_step)."""
        decode = self.decoding if decode is None else decode
        if x.shape[0] == 0:
            return torch.zeros_like(x, dtype=torch.float32 if partial else x.dtype)
        if not decode and x.shape[0] >= STAGE_TOKENS and self.prefill_rows:
            out = self.fused(x, topk_ids, topk_weights, self.prefill.table(layer, topk_ids), layer, partial=partial)
            self.prefill.done(layer)
            return out
        return self.fused(x, topk_ids, topk_weights, self._decode_table(layer, x, topk_ids, step=decode), layer,
                          partial=partial)

    def end_step(self) -> None:
        """A disk tier raises here, once, for a record its step could not read (disk_tier.DiskTier.check)."""
        if self.disk is not None:
            self.disk.check()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
        super().close()

    def lane_records(self, layer: int) -> tuple[torch.Tensor, Sequence[torch.Tensor]]:
        """(int64 [E] host record address of each expert, the records by expert id) for the CPU lane;
        with a disk tier both follow what host RAM holds now."""
        if self.disk is not None:
            row = self.disk.row_of[layer]
            return self.disk.addr[row, : self.disk.sizes[row]], self.disk.row_records(row)
        entries = self.entries[layer]
        return torch.tensor([t.data_ptr() for t in entries], dtype=torch.int64), entries

    def combine(self, layer, x, topk_ids, topk_weights, skip=(), partial=False):
        if skip:  # the lane's experts are chosen on the device (lane_forward), never passed in
            raise NotImplementedError("the device cache hands the CPU lane its experts itself")
        return self.forward(layer, x, topk_ids, topk_weights, partial=partial)

    def clamp_changed(self) -> None:
        self.fused.swiglu_limit = self.swiglu_limit

    def reads_disk(self) -> bool:
        return self.disk is not None  # the disk tier under the cache (its RAM holds the store's host tier)

    def graph_unsupported(self) -> str | None:
        return None

    def graph_safe(self) -> bool:
        return self.decoding

    def graph_recorded(self, key: Hashable) -> None:
        """The step was recorded (its kernels queued into graphs, not run): uncount what the
        recording counted (cache steps, lane hand-offs) and keep it for the replays."""
        delta = (self.steps - self._step_start[0], self.lane_calls - self._step_start[1])
        self._graph_counts[key] = delta
        self.steps -= delta[0]
        self.lane_calls -= delta[1]

    def graph_replayed(self, key: Hashable) -> None:
        """The step was replayed: count what its recording would have counted."""
        self.graph_replays += 1
        steps, lane_calls = self._graph_counts.get(key, (0, 0))
        self.steps += steps
        self.lane_calls += lane_calls

    def lane_handoff(self, lane):
        """Fast mode answers through a mapped-memory mailbox (moe/device_lane.py): no host sync."""
        from tiermoe.moe.device_lane import DeviceLane

        return DeviceLane(self, lane, lane.max_tokens)

    def counters(self) -> dict | None:
        stats = self.stats()
        c = self.merge_store_counters(self.store.counters(), stats)
        c["device_cache"] = {**self.cache_counters(stats), "graph_replays": self.graph_replays}
        c["mode"] = "exact"
        c["expert_kernel"] = self.kernel
        return c

    def heat(self) -> dict | None:
        from tiermoe.moe.heat import device_cache_heat

        return device_cache_heat(self.caches)

    # -- the cache -------------------------------------------------------------------------------
    def _decode_table(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, step: bool = True) -> torch.Tensor:
        """The table a step reads: after a cache step (decode with at most max_picks picks), else
        the canonical one (slots from HBM, the rest read in place)."""
        cache = self.caches[layer]
        if step and topk_ids.numel() <= self.max_picks:
            self.prefill.return_loan()  # a cache decision must never meet lent slots
            self._resident(layer, x, topk_ids, step=True)
            cache.step(topk_ids)
            self.steps += 1
            return cache.step_table
        self._resident(layer, x, topk_ids, step=False)
        self.table_calls += 1
        return cache.ptr_table

    def _resident(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, step: bool) -> None:
        """With a disk tier, every pick in a slot or in RAM before the kernels that read it: a cache step
        asks the host through the residency mailbox (no host sync) and hints the predicted picks of the
        next LAYERS_AHEAD MoE layers (each one's router on x [T, H]: reads ahead), other steps load
        synchronously."""
        if self.disk is None:
            return
        if not step:
            self.disk.ensure_now(layer, topk_ids)
            return
        self.disk_mailbox.ensure(self.disk.row_of[layer], topk_ids)
        ahead, hinted = self.next_router.get(layer), 0
        while ahead is not None and hinted < LAYERS_AHEAD and ahead[0] in self.disk.row_of:
            next_layer, module = ahead
            self.disk_mailbox.hint_next(self.disk.row_of[next_layer], module.predict_ids(x))
            ahead, hinted = self.next_router.get(next_layer), hinted + 1

    def set_lane(self, experts: int) -> None:
        """Fast mode on the device: later `lane_forward` steps send up to `experts` of their
        coldest misses to the CPU lane (0: none; other steps never do). At most lane_cap."""
        for cache in self.caches.values():
            if experts > cache.lane_cap:
                raise ValueError(f"{experts} lane experts exceed the cache's lane_cap={cache.lane_cap}")
            cache.lane_max = max(0, int(experts))
            cache.zero_addr = self.fused.zero_record(self.scratch.device).data_ptr()

    def set_lane_share(self, share: float | None) -> None:
        """The cost model's share of each lane step's misses for the CPU lane (moe/lane_cost.py),
        at most set_lane's count; None: that count. A device tensor per layer, read by captured
        graphs too."""
        from tiermoe.kernels.triton.cache_manager import LANE_SHARE_ONE

        value = LANE_SHARE_ONE if share is None else round(min(1.0, max(0.0, float(share))) * LANE_SHARE_ONE)
        for cache in self.caches.values():
            cache.lane_share.fill_(value)

    def lane_forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     mailbox, slot: int, partial: bool = False) -> torch.Tensor:
        """A fast-mode decode step of one layer with no host sync (module doc): x [T, H] ->
        [T, H] in x's dtype, or with `partial` both parts' fp32 sum before its rounding (an
        expert-parallel rank's part, rounded once after the ranks' sum). The lane's answer
        arrives through `mailbox` (a Mailbox with meta_words >= lane_cap + 2 T k; `slot` is
        this layer's) as the fp32 partial of the experts in the cache's lane_ids, given meta =
        lane_ids (-1 padded to lane_cap) | topk_ids [T k] | topk_weights as fp32 bits [T k]
        (moe/device_lane.py)."""
        cache = self.caches[layer]
        if topk_ids.numel() > self.max_picks or not cache.lane_max:
            return self.forward(layer, x, topk_ids, topk_weights, decode=True, partial=partial)
        self.prefill.return_loan()  # a cache decision must never meet lent slots
        self._resident(layer, x, topk_ids, step=True)
        cache.step(topk_ids, gather=False, lane=True)  # decisions, the lane's choice included
        self.steps += 1
        self.lane_calls += 1
        ids = topk_ids.reshape(-1).to(torch.int32)  # [T k]
        w = topk_weights.reshape(-1).to(torch.float32)  # [T k]
        # lane_ids [lane_cap]: this step's lane experts, -1 after them (the kernel clears it all)
        meta = torch.cat([cache.lane_ids, ids, w.view(torch.int32)])  # [cap + 2 T k] int32
        mailbox.post(slot, x.contiguous(), meta)
        cache.gather()
        on_lane = cache.lmark[topk_ids.long()] == cache.clock[1]  # [T, k] (stamp of this step)
        out = self.fused(x, topk_ids, topk_weights.masked_fill(on_lane, 0), cache.step_table, layer,
                         partial=True)  # fp32 [T, H]
        mailbox.wait_add(slot, out)
        if partial:
            return out
        # one rounding of both parts' sum to the kernel's bf16, as exact mode rounds its one sum (then x's dtype)
        return out.to(torch.bfloat16).to(x.dtype)

    # What a cache step reads and writes besides the counters: slot contents and tables, CLOCK
    # state, pick frequencies, the step stamp and the marks compared against it.
    DECISION_STATE = ("ptr_table", "slot_expert", "expert_slot", "ref", "clock", "emark", "victims", "copy_src",
                      "copy_dst", "n_copy", "freq", "step_table", "smark", "saddr", "lane_ids", "lmark")

    def save_decisions(self) -> dict[int, dict[str, torch.Tensor]]:
        """A copy of every layer's decision state (for `restore_decisions`; queued, no sync).

        Why: fast mode's output depends on that state (the lane takes the coldest misses, and
        its fp32 partial is rounded apart from the device's), so steps that are not part of
        serving (the start-up warm-up) must leave it as they found it. Exact mode does not
        depend on it, but keeps the warm start's placement instead of the dummy steps'."""
        self.prefill.return_loan()
        return {layer: {n: getattr(c, n).clone() for n in self.DECISION_STATE} for layer, c in self.caches.items()}

    def restore_decisions(self, saved: dict[int, dict[str, torch.Tensor]]) -> None:
        """Put back a `save_decisions` copy, tables in place (recorded graphs keep their
        addresses) and the records of the slots whose expert changed (one gather per layer; the
        others copy onto themselves). Counters keep counting."""
        from tiermoe.kernels.triton.cache_manager import gather_records

        self.prefill.return_loan()
        for row, (layer, cache) in enumerate(self.caches.items()):
            before = cache.slot_expert.clone()  # [S] what the slots hold now
            for name, t in saved[layer].items():
                getattr(cache, name).copy_(t)
            if self.disk is not None:
                self._restore_with_disk_tier(row, cache, before)
                continue
            if not cache.num_slots:
                continue
            held = cache.slot_expert
            src = torch.where((held != before) & (held >= 0), cache.host_addr[held.clamp(min=0).long()],
                              cache.slot_addr)
            count = torch.full((1,), cache.num_slots, dtype=torch.int32, device=held.device)
            gather_records(src, cache.slot_addr.clone(), count, cache.record_bytes, chunk_bytes=cache.gather_chunk,
                           programs=cache.gather_programs, num_warps=cache.gather_warps)

    def _restore_with_disk_tier(self, row: int, cache, before: torch.Tensor) -> None:
        """restore_decisions with a disk tier: a slot whose expert changed gets its record from RAM or disk
        (the saved host addresses may be gone), and ptr_table follows RAM as it is now."""
        r = self.store.record_bytes
        for slot, (e, was) in enumerate(zip(cache.slot_expert.tolist(), before.tolist())):
            if e >= 0 and e != was:
                self.arena[(int(cache.slot_addr[slot]) - self.arena.data_ptr()) // r].copy_(self.disk.record(row, e))
        n, es = cache.num_experts, cache.expert_slot.long()
        cache.ptr_table[:n] = torch.where(es >= 0, cache.slot_addr[es.clamp(min=0)], cache.host_addr)

    def _record_words(self, layer: int) -> torch.Tensor | None:
        """A mixed store: int32 [E] 4-byte words of each expert's own record, so a miss moves its
        record's bytes and not the longer tier entry's (None: one layout, every copy whole)."""
        if not self.fused.mixed:
            return None
        words = torch.tensor([lay.length // 4 for lay in self.fused.layouts], dtype=torch.int32)  # [layouts]
        return words[self.fused.kinds[layer].long().cpu()]

    def resident(self, layer: int) -> list[int]:
        """Experts of `layer` in GPU slots now (ascending; reads the device state)."""
        return sorted(e for e in self.caches[layer].slot_expert.tolist() if e >= 0)

    def stats(self) -> dict[str, int]:
        """Cumulative unique-expert lookups, slot hits, misses, admissions and the misses' record bytes
        over all layers (decode cache steps only; reading them waits for the queued steps)."""
        tot = torch.stack([c.stats for c in self.caches.values()]).sum(0).tolist() if self.caches else [0] * 5
        names = ("lookups", "hits", "misses", "admitted", "miss_bytes")
        return dict(zip(names, (int(v) for v in tot[:4] + [4 * tot[4]])))

    def cache_counters(self, stats: dict[str, int] | None = None) -> dict:
        """The cache's own counts (/stats experts.device_cache); stats: a `stats()` just read
        (each read waits for the device), else read here."""
        lender = self.prefill.lender
        return {**(stats or self.stats()), "slots": self.slots_total, "stage_rows": self.stage_rows,
                "layers": len(self.caches), "cache_steps": self.steps, "table_calls": self.table_calls,
                "lane_calls": self.lane_calls, "prefill_staged": self.prefill.staged,
                "prefill_in_place": self.prefill.in_place,
                "prefill_borrowed_rows": lender.rows if lender else 0, "prefill_loans": lender.loans if lender else 0,
                "prefill_rows": self.prefill_rows, "prefill_buffers": self.prefill.num_buffers,
                "prefill_planned_chunks": self.prefill.planned_chunks, "kind": self.fused.kind_name,
                **({"disk_tier": self.disk.counters()} if self.disk is not None else {}),
                **({"mailbox": self.device_lane.counters()} if self.device_lane is not None else {})}

    def merge_store_counters(self, c: dict, stats: dict[str, int] | None = None) -> dict:
        """The store's counters dict with the device cache's slot traffic folded in: the store
        itself has no slots here and sees none of these picks."""
        s = stats or self.stats()
        rec = self.store.record_bytes
        tok = max(1, int(c.get("decode_tokens") or 0))
        slots = c.setdefault("slots", {})
        slots["hits"] = slots.get("hits", 0) + s["hits"]
        slots["misses"] = slots.get("misses", 0) + s["misses"]
        slots["bytes_in"] = slots.get("bytes_in", 0) + s["admitted"] * rec
        slots["capacity"] = self.slots_total
        if self.static_bound is not None:
            slots["static_bound"] = round(self.static_bound, 3)
        slots["resident"] = sum(int((cc.slot_expert >= 0).sum()) for cc in self.caches.values())
        disk_reads = self.disk.c.decode_reads if self.disk is not None else 0  # misses read from disk first
        host = c.setdefault("host", {})
        host["hits"] = host.get("hits", 0) + s["misses"] - disk_reads
        per = c.setdefault("per_decode_token", {})
        per["slots_hits"] = per.get("slots_hits", 0.0) + s["hits"] / tok
        per["host_hits"] = per.get("host_hits", 0.0) + (s["misses"] - disk_reads) / tok
        if self.disk is not None:
            disk = c.setdefault("disk", {})
            disk["reads"] = disk.get("reads", 0) + self.disk.c.decode_reads + self.disk.c.other_reads
            per["disk_reads"] = per.get("disk_reads", 0.0) + disk_reads / tok
        per["bytes_moved"] = per.get("bytes_moved", 0.0) + s["miss_bytes"] / tok  # each miss's record crosses once
        return c
