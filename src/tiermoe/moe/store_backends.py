"""Backends over the packed expert store, where the store's policy decides the tiers in Python.

    StoreBackend        what every store-served backend shares: the store, the model's SwiGLU
                        clamp, layer-ahead prefetch, step counting, counters, close
    StoreTorchExperts   "store-torch": `combine_experts` on dequantized weights from
                        ExpertStore.fetch (GPU slot, host RAM or disk); bit-identical to the
                        resident experts whatever the tier sizes (exact mode)
    StoreTritonExperts  "store-triton": one fused MoE call per layer over a pointer table into
                        the tiers (host records read in place); bit-identical across tier sizes
                        within this backend, close to the torch path

The third strategy, the slot cache decided on the device, is moe/device_cache.py. All three are
chosen by name in moe/backends.py; fast mode's CPU lane wraps any of them (moe/lane.py), using
`prefetch_ahead` + `combine(..., skip=)` here to leave the lane's experts out.

Layer-ahead prefetch: before computing layer L, the next MoE layer's router is applied to layer
L's input and the predicted experts' disk reads are started, so they overlap compute.

StoreTritonExperts per MoE layer and step: the store decides tiers exactly as for the torch path
(`ExpertStore.device_records`: same policy, admissions and counters), the addresses go into a
pointer table of the layer's E rows, and one fused_moe call computes every routed pick. The
kernel reads each record's bytes at `table[e]`; which tier the bytes sit in changes one int64,
never the arithmetic, the launch configuration or the summation order (pick order, fp32). Against
the torch path results are close, not bit-equal: the kernel accumulates in fp32, rounds the
SwiGLU activation to bf16 once and sums the top-k in pick order.
"""

from __future__ import annotations

import abc
from typing import Collection, Sequence

import torch

from tiermoe.moe.experts import HostSyncedBackend, combine_experts


class StoreBackend(HostSyncedBackend):
    """An ExpertBackend whose experts live in an ExpertStore (which it owns and closes)."""

    kernel = "torch"  # what /stats shows as experts.expert_kernel

    def __init__(self, store, swiglu_limit: float | None = None, prefetch: bool = True) -> None:
        self.store = store
        self.swiglu_limit = swiglu_limit
        self.prefetch = prefetch
        self.next_router: dict[int, tuple[int, object]] = {}  # layer -> (next MoE layer, that layer's module)
        self.decoding = True  # the current step is a decode step

    # -- the seam --------------------------------------------------------------------------------
    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                partial: bool = False) -> torch.Tensor:
        """x [T, H] -> [T, H] in x's dtype, or with `partial` fp32 as `combine` gives it (ExpertBackend.forward)."""
        self.prefetch_ahead(layer, x)
        return self.combine(layer, x, topk_ids, topk_weights, partial=partial)

    def attach(self, moe_layers: Sequence) -> None:
        """Layer-ahead prefetch order, and the model's SwiGLU clamp (GLM-5.3: swiglu_limit)."""
        for cur, nxt in zip(moe_layers, moe_layers[1:]):
            self.next_router[cur.layer] = (nxt.layer, nxt)
        if moe_layers and moe_layers[0].moe.swiglu_limit is not None:
            self.swiglu_limit = moe_layers[0].moe.swiglu_limit
        self.clamp_changed()

    def begin_step(self, tokens: int, decode: bool) -> None:
        self.store.begin_step(tokens=tokens, decode=decode)
        self.decoding = decode

    def counters(self) -> dict | None:
        c = self.store.counters()
        c["mode"] = "exact"
        c["expert_kernel"] = self.kernel
        return c

    def heat(self) -> dict | None:
        from tiermoe.moe.heat import store_heat

        return store_heat(self.store)

    def close(self) -> None:
        self.store.close()

    # -- for subclasses and the CPU lane ---------------------------------------------------------
    @abc.abstractmethod
    def combine(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                skip: Collection[int] = (), partial: bool = False) -> torch.Tensor:
        """The routed experts' weighted sum, x [T, H] -> [T, H] in x's dtype, without the experts in `skip`;
        with `partial` in fp32, before the kernel's rounding where it has one (fast mode adds the CPU lane's part
        to it and rounds once)."""

    def clamp_changed(self) -> None:
        """`swiglu_limit` was set from the model: pass it on to the kernels."""

    def reads_disk(self) -> bool:
        return self.store.disk_only_experts > 0

    def prefetch_ahead(self, layer: int, x: torch.Tensor) -> None:
        """Start the disk reads of the experts the next MoE layer will pick for x [T, H]."""
        ahead = self.next_router.get(layer)
        if self.prefetch and ahead is not None:
            next_layer, module = ahead
            next_ids = module.predict_ids(x)  # [T, k] the next MoE layer's picks (under replay: its rows)
            self.store.prefetch(next_layer, torch.unique(next_ids).tolist())

    def lane_handoff(self, lane):
        """How fast mode's CPU lane (`lane`, a CpuLane) shares this backend's decode layers:
        the host-synchronous hand-off (moe/lane.py); the device cache answers a mailbox instead."""
        from tiermoe.moe.lane import HostLaneHandoff

        return HostLaneHandoff(self, lane)


class StoreTorchExperts(StoreBackend):
    """"store-torch": torch on dequantized weights fetched through the tiers (see module doc)."""

    def combine(self, layer, x, topk_ids, topk_weights, skip=(), partial=False):
        fetch = lambda ids: self.store.fetch(layer, ids)  # noqa: E731
        out = combine_experts(x, topk_ids, topk_weights, fetch, self.swiglu_limit, skip=skip)
        return out.float() if partial else out  # the reference order rounds every expert's add: nothing to keep


class StoreTritonExperts(StoreBackend):
    """"store-triton": one fused_moe call per MoE layer and step (see module doc). Needs bf16
    activations and records of a kind and shape the kernel tiles (moe/backends.SUPPORTED_KINDS
    and triton_unsupported; a mixed store: every one of its layouts); the settling gives any
    other store to StoreTorchExperts and logs why (engine/settle.py). A mixed store's layer
    calls pass that layer's kind table (moe/fused.py): each expert is read at its own layout.

    `combine(..., skip=ids)` leaves out experts another lane computes: their table rows point at
    the all-zero record and their routing weights are zeroed, so they add exactly zero.
    """

    kernel = "triton"

    def __init__(self, store, config: dict | None = None, swiglu_limit: float | None = None,
                 prefetch: bool = True) -> None:
        from tiermoe.moe.fused import FusedMoE

        super().__init__(store, swiglu_limit, prefetch)
        self.fused = FusedMoE.for_store(store, config, swiglu_limit)  # a mixed store: kind tables per layer
        self.layout = self.fused.layout  # the kernel's view of the store's records (a mixed store's hot ones)
        self.layouts = self.fused.layouts
        # bytes of each expert's own record per layer (an in-place read covers only those)
        self._lengths = {layer: [store.layouts[i].length for i in store.layout_ids(layer)]
                         for layer in store.moe_layers}
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]] = {}  # CUDA only
        self.calls = 0
        self.picks = 0
        self.host_in_place = 0  # records read from the host tier in place (CUDA only)
        self.host_in_place_bytes = 0

    def clamp_changed(self) -> None:
        self.fused.swiglu_limit = self.swiglu_limit  # fused_moe clamps in its epilogue

    def combine(self, layer, x, topk_ids, topk_weights, skip=(), partial=False):
        t = x.shape[0]
        if t == 0:
            return torch.zeros_like(x, dtype=torch.float32 if partial else x.dtype)
        skip = {int(e) for e in skip}
        expert_ids = [e for e in torch.unique(topk_ids).tolist() if e not in skip]  # ascending
        recs = self.store.device_records(layer, expert_ids) if expert_ids else {}
        rows = {e: buf.data_ptr() for e, buf in recs.items()}
        if skip:
            zero = self.fused.zero_record(x.device).data_ptr()
            rows.update({e: zero for e in skip})
            lane = torch.tensor(sorted(skip), device=topk_ids.device)
            topk_weights = topk_weights.masked_fill(torch.isin(topk_ids, lane), 0)  # [T, k]
        table = self._table(layer, rows, x.device)  # [E] int64; rows nobody picks are never read
        out = self.fused(x, topk_ids, topk_weights, table, layer, partial=partial)  # [T, H]
        self.store.device_reads_queued(recs.values())
        self.calls += 1
        self.picks += topk_ids.numel()
        if x.device.type == "cuda":
            host = [e for e, b in recs.items() if b.device.type == "cpu"]
            self.host_in_place += len(host)
            self.host_in_place_bytes += sum(self._lengths[layer][e] for e in host)
        return out

    def _table(self, layer: int, rows: dict[int, int], device: torch.device) -> torch.Tensor:
        """The layer's pointer table on `device` with `rows` (expert -> address) written.

        CUDA: a persistent device table per layer, filled from a pinned host copy without a
        stream sync; the host copy is rewritten only after the previous upload from it is done
        (its event; normally long past, since every call first syncs on the routing).
        """
        n = self.store.manifest.experts_per_layer[layer]
        ids = torch.tensor(list(rows), dtype=torch.int64)
        vals = torch.tensor(list(rows.values()), dtype=torch.int64)
        if device.type != "cuda":
            table = torch.zeros(n, dtype=torch.int64, device=device)
            table[ids.to(device)] = vals.to(device)
            return table
        if layer not in self._tables:
            self._tables[layer] = (torch.zeros(n, dtype=torch.int64, pin_memory=True),
                                   torch.zeros(n, dtype=torch.int64, device=device), torch.cuda.Event())
        host, table, uploaded = self._tables[layer]
        uploaded.synchronize()
        host[ids] = vals
        table.copy_(host, non_blocking=True)
        uploaded.record()
        return table

    def counters(self) -> dict | None:
        c = super().counters()
        c["triton"] = {"calls": self.calls, "picks": self.picks, "host_in_place": self.host_in_place,
                       "host_in_place_bytes": self.host_in_place_bytes, "kind": self.fused.kind_name}
        return c
