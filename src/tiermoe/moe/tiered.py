"""Tiered expert backend: routed experts served from the packed expert store.

The MoE layer calls forward(layer, ...) exactly as with resident experts; the weights come from
ExpertStore.fetch (GPU slot, host RAM or disk), and `combine_experts` runs the identical
arithmetic, so a bf16 store gives bit-identical logits whatever the tier sizes (exact mode).

Layer-ahead prefetch: before computing layer L, the next MoE layer's router is applied to
layer L's input and the predicted experts' disk reads are started, so they overlap compute.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tiermoe.errors import UserError
from tiermoe.moe.experts import combine_experts


class TieredExperts:
    def __init__(self, store, swiglu_limit: float | None = None, prefetch: bool = True):
        self.store = store
        self.swiglu_limit = swiglu_limit
        self.prefetch = prefetch
        self.next_router: dict[int, tuple[int, object]] = {}  # layer -> (next MoE layer, its router)

    @classmethod
    def open(cls, path: Path, *, device: str, dtype: torch.dtype, options: dict) -> "TieredExperts":
        from tiermoe.store.facade import ExpertStore

        if options.get("mode", "exact") == "fast":
            raise UserError("--mode fast: the CPU lane is not available in this build; use --mode exact")
        store = ExpertStore.open(
            path, device=device, dtype=dtype,
            gpu_expert_gb=options.get("gpu_expert_gb"), host_expert_gb=options.get("host_expert_gb"),
            policy=options.get("expert_policy") or "lfu", stats_file=options.get("expert_stats"),
            direct_io=not options.get("no_direct_io", False),
        )
        return cls(store)

    def attach(self, moe_layers: list) -> None:
        """Called by the loader with the model's MoE layers in order (for layer-ahead prefetch)."""
        for cur, nxt in zip(moe_layers, moe_layers[1:]):
            self.next_router[cur.layer] = (nxt.layer, nxt.gate)
        if moe_layers and moe_layers[0].moe.swiglu_limit is not None:
            self.swiglu_limit = moe_layers[0].moe.swiglu_limit

    def begin_step(self, tokens: int, decode: bool) -> None:
        self.store.begin_step(tokens=tokens, decode=decode)

    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        ahead = self.next_router.get(layer)
        if self.prefetch and ahead is not None:
            next_layer, router = ahead
            next_ids, _ = router(x)  # [T, k] predicted picks of the next MoE layer
            self.store.prefetch(next_layer, torch.unique(next_ids).tolist())
        return combine_experts(x, topk_ids, topk_weights, lambda ids: self.store.fetch(layer, ids), self.swiglu_limit)

    def counters(self) -> dict:
        return self.store.counters()

    def close(self) -> None:
        self.store.close()
