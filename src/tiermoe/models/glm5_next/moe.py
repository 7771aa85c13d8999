"""glm5_next MoE block: sigmoid noaux_tc router, shared expert, and the routed-expert seam.

Routed experts are computed through one function boundary,

    moe_experts(layer_idx, x [T, H], topk_ids [T, k], topk_weights [T, k]) -> [T, H],

which a serving engine replaces with its tiered expert store (`Glm5NextModel.moe_experts`).
`ResidentExperts` is the default: every expert in memory, computed in ascending expert id
order exactly like transformers' `Glm5NextTextExperts.forward`, so results match bit for bit.
The routing weights already include norm_topk_prob and routed_scaling_factor; the shared
expert is added outside the seam and is never scaled.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import Glm5NextConfig
from .layers import MLP, clamped_swiglu

MoEExpertsFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Router(nn.Module):
    """Sigmoid scores; the correction bias only steers which experts are picked (noaux_tc)."""

    def __init__(self, cfg: Glm5NextConfig):
        super().__init__()
        self.top_k, self.n_experts = cfg.num_experts_per_tok, cfg.n_routed_experts
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scale = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.n_experts, cfg.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_ids [T, k] int64, topk_weights [T, k] fp32)."""
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        per_group = self.n_experts // self.n_group
        group_scores = choice.view(-1, self.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(-1, self.n_experts)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scale


class ResidentExperts:
    """All routed experts in memory: per MoE layer gate_up [E, 2I, H] and down [E, H, I]."""

    def __init__(self, swiglu_limit: float):
        self.limit = swiglu_limit
        self.gate_up: dict[int, torch.Tensor] = {}
        self.down: dict[int, torch.Tensor] = {}

    def add_layer(self, layer_idx: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate_up[layer_idx], self.down[layer_idx] = gate_up, down

    def __call__(self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.gate_up[layer_idx], self.down[layer_idx]
        return expert_forward(x, topk_ids, topk_weights, lambda e: (gate_up[e], down[e]), self.limit)


def expert_forward(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    weights_of: Callable[[int], tuple[torch.Tensor, torch.Tensor]], limit: float,
) -> torch.Tensor:
    """Reference routed-expert compute. weights_of(e) -> (gate_up [2I, H], down [H, I]).

    Experts run in ascending id; each token's contributions are accumulated in that order,
    which is what makes this bit-identical to transformers' loop."""
    out = torch.zeros_like(x)
    for e in torch.unique(topk_ids).tolist():
        pos, tok = torch.where((topk_ids == e).t())  # sorted by top-k position, then token
        gate_up, down = weights_of(e)
        gate, up = F.linear(x[tok], gate_up).chunk(2, dim=-1)
        y = F.linear(clamped_swiglu(gate, up, limit), down) * topk_weights[tok, pos, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


class MoE(nn.Module):
    """Router + routed experts (through the seam) + unscaled shared expert."""

    def __init__(self, cfg: Glm5NextConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.gate = Router(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.swiglu_limit)

    def forward(self, x: torch.Tensor, experts: MoEExpertsFn) -> torch.Tensor:
        ids, weights = self.gate(x)
        return experts(self.layer_idx, x, ids, weights) + self.shared_experts(x)
