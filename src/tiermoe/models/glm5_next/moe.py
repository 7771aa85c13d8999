"""glm5_next MoE block: sigmoid noaux_tc router, routed experts behind the engine's
`ExpertBackend` seam, and an unscaled shared expert with the swiglu_limit clamp.

Routed experts are computed only through

    backend.forward(layer, x [T, H], topk_ids [T, k], topk_weights [T, k]) -> [T, H]

(`tiermoe.moe.experts.ExpertBackend`): `ResidentExperts` (everything in memory, ascending
expert order exactly like transformers' `Glm5NextTextExperts`) by default, the tiered expert
store when serving. The routing weights already include norm_topk_prob and
routed_scaling_factor; the clamp (gate <= limit, |up| <= limit, before SiLU) is applied by
the backend from `MoESpec.swiglu_limit`, and by `layers.MLP` for the shared expert.
"""

from __future__ import annotations

import torch
from torch import nn

from tiermoe.models.blocks.router import Router
from tiermoe.models.spec import MoESpec

from .config import Glm5NextConfig
from .layers import MLP


def moe_spec(cfg: Glm5NextConfig) -> MoESpec:
    return MoESpec(
        num_experts=cfg.n_routed_experts,
        top_k=cfg.num_experts_per_tok,
        intermediate_size=cfg.moe_intermediate_size,
        scoring="sigmoid_noaux",
        norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        shared_intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts,
        swiglu_limit=cfg.swiglu_limit,
    )


class MoE(nn.Module):
    """Router -> routed experts (through `self.backend`) + shared expert.

    Exposes `layer`, `moe`, `gate`, `routing` and `predict_ids` like the engine's MoELayer, so
    expert backends and routing replay (moe/replay.py) attach to it the same way."""

    def __init__(self, cfg: Glm5NextConfig, layer: int):
        super().__init__()
        self.layer, self.moe = layer, moe_spec(cfg)
        self.gate = Router(self.moe, cfg.hidden_size)
        self.gate.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32))
        self.gate.e_score_correction_bias = nn.Parameter(torch.empty(cfg.n_routed_experts, dtype=torch.float32))
        self.shared_experts = MLP(cfg.hidden_size, self.moe.shared_intermediate_size, cfg.swiglu_limit)
        self.backend = None  # an ExpertBackend; set by Glm5NextModel.set_expert_backend
        self.routing = None  # moe/replay.LayerRouting: routing replay and/or recording (benchmarks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        routing = self.routing
        topk_ids, topk_weights = self.gate(x) if routing is None else routing.route(self.gate, x)
        return self.backend.forward(self.layer, x, topk_ids, topk_weights) + self.shared_experts(x)

    def predict_ids(self, x: torch.Tensor) -> torch.Tensor:
        """The ids [T, k] this layer will pick for x [T, H], with no side effect (layer-ahead prefetch)."""
        return self.gate(x)[0] if self.routing is None else self.routing.peek(x.shape[0])
