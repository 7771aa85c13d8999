"""One fused MoE call over a pointer table, shared by the Triton store path and the device cache.

    table[e] = address of expert e's record (a GPU slot, a staging row, the pinned host entry
               read in place, or the all-zero record of an expert another lane computes)
    out      = fused_moe(x, topk_ids, topk_weights, table, layout)      # [T, H]

`FusedMoE` owns what both callers used to repeat: the bf16 activations the kernel takes, the
SwiGLU clamp it applies in its epilogue, the result in the caller's dtype, and the all-zero
record that skipped experts point at (their routing weights are zeroed too, so they add exactly
zero). Which tier a record sits in changes one table entry, never the launch configuration or
the summation order.

A mixed store (`pack --cold-quant`: the hot experts of each layer in one record kind, the rest in
another) also needs each expert's layout: `for_store` builds one kind table per MoE layer (the
layout index of each expert id, int8 on the store's device) once, and each call passes its
layer's to the kernel, which runs each layout's launches on its own experts only. The table
follows the expert, not the tier: a record keeps its layout in every slot, host entry or staging
row (all `record_bytes` long, the longest layout; a shorter record sits at the start).
"""

from __future__ import annotations

from typing import Sequence

import torch


class FusedMoE:
    """record_layout: the store's RecordLayout, or every layout of a mixed store (then a kind table
    goes with each call: `for_store`); config: a fused_moe launch configuration, or one per layout
    (None: per shape and device, kernels/triton/configs.json); swiglu_limit: set by the backend's
    `attach` from the model (GLM-5.3 clamps)."""

    def __init__(self, record_layout, config: dict | Sequence[dict | None] | None = None,
                 swiglu_limit: float | None = None) -> None:
        from tiermoe.kernels.layout import layout_from

        given = record_layout if isinstance(record_layout, (list, tuple)) else [record_layout]
        self.layouts = tuple(layout_from(lay) for lay in given)
        self.layout = self.layouts[0]  # every record's in a store of one kind
        self.mixed = len(self.layouts) > 1
        self.record_bytes = max(lay.length for lay in self.layouts)  # a tier entry: the longest record
        self.config = config
        self.swiglu_limit = swiglu_limit
        self.kinds: dict[int, torch.Tensor] = {}  # mixed stores: layer -> int8 [E] layout index per expert
        self._zero: torch.Tensor | None = None

    @classmethod
    def for_store(cls, store, config: dict | Sequence[dict | None] | None = None,
                  swiglu_limit: float | None = None) -> "FusedMoE":
        """The kernel's view of an ExpertStore's records: its layouts and, for a mixed store, every
        MoE layer's kind table on the store's device (made once here, read by every call after)."""
        fused = cls(store.layouts, config, swiglu_limit)
        if fused.mixed:
            fused.kinds = {layer: torch.tensor(store.layout_ids(layer), dtype=torch.int8, device=store.device)
                           for layer in store.moe_layers}
        return fused

    @property
    def kind_name(self) -> str:
        """The record kinds the kernel reads, for counters: "int4", or "int4+int3" for a mixed store."""
        return "+".join(lay.kind for lay in self.layouts)

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 table: torch.Tensor, layer: int | None = None, partial: bool = False) -> torch.Tensor:
        """x [T, H], topk_ids/topk_weights [T, k], table [E] int64 -> [T, H] in x's dtype, or with `partial`
        the picks' fp32 sum before its rounding: fast mode adds the CPU lane's fp32 part to that and rounds
        once, as exact mode rounds the sum of every pick once (rounding the GPU's part first would add a
        second rounding to nearly every element of every fast-mode layer).
        layer: the MoE layer (a mixed store's calls read its kind table; ignored otherwise)."""
        from tiermoe.kernels.triton.fused_moe import fused_moe

        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        clamp = {} if self.swiglu_limit is None else {"swiglu_limit": self.swiglu_limit}
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device) if partial else None  # [T, H]
        if self.mixed:
            if layer not in self.kinds:
                raise ValueError(f"layer {layer}: no kind table (a mixed store's calls name a MoE layer)")
            out = fused_moe(xb.contiguous(), topk_ids, topk_weights, table, self.layouts, config=self.config,
                            kind_table=self.kinds[layer], out=out, **clamp)
        else:
            out = fused_moe(xb.contiguous(), topk_ids, topk_weights, table, self.layout, config=self.config,
                            out=out, **clamp)
        return out if partial or out.dtype == x.dtype else out.to(x.dtype)

    def zero_record(self, device: torch.device) -> torch.Tensor:
        """The all-zero record (uint8 [record bytes]: zero weights and scales in every layout) on
        `device`, made once."""
        if self._zero is None or self._zero.device != device:
            self._zero = torch.zeros(self.record_bytes, dtype=torch.uint8, device=device)
        return self._zero
