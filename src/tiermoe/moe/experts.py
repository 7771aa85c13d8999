"""The MoE seam: routed-expert computation behind one interface.

`ExpertBackend.forward(layer, x, topk_ids, topk_weights)` is the only way the model reaches
routed experts. The resident backend holds every expert in memory (the oracle); the tiered
backend fetches them from the expert store. Both call `combine_experts`, which visits experts
in ascending id order and accumulates exactly as transformers does, so the result depends only
on the expert weights, never on which tier served them (bit-identical in exact mode).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F

ExpertWeights = tuple[torch.Tensor, torch.Tensor]  # (gate_up [2I, H], down [H, I])


class ExpertBackend(Protocol):
    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_ids [T, k], topk_weights [T, k] -> [T, H]."""
        ...


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    """One SwiGLU expert: x [n, H], gate_up [2I, H], down [H, I] -> [n, H]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return F.linear(F.silu(gate) * up, down)


def combine_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights_of: Callable[[list[int]], dict[int, ExpertWeights]],
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """Weighted sum of the routed experts' outputs, reference order: x [T, H] -> [T, H]."""
    out = torch.zeros_like(x)
    expert_ids = torch.unique(topk_ids).tolist()  # sorted ascending
    weights = weights_of(expert_ids)
    for e in expert_ids:
        top_k_pos, token_idx = torch.where((topk_ids == e).t())  # same order as the reference
        gate_up, down = weights[e]
        y = expert_mlp(x[token_idx], gate_up, down, swiglu_limit)
        y = y * topk_weights[token_idx, top_k_pos, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


class ResidentExperts:
    """Every expert of every MoE layer held in memory as stacked tensors (the oracle)."""

    def __init__(self, swiglu_limit: float | None = None):
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> ([E,2I,H], [E,H,I])
        self.swiglu_limit = swiglu_limit

    def add_layer(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self.layers[layer] = (gate_up, down)

    def weights(self, layer: int, expert_ids: list[int]) -> dict[int, ExpertWeights]:
        gate_up, down = self.layers[layer]
        return {e: (gate_up[e], down[e]) for e in expert_ids}

    def forward(self, layer, x, topk_ids, topk_weights):
        return combine_experts(x, topk_ids, topk_weights, lambda ids: self.weights(layer, ids), self.swiglu_limit)
