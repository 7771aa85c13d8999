"""MoE feed-forward layer: router -> experts (through the backend seam) -> combine (+ shared)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tiermoe.models.blocks.common import Linear, SwiGLU
from tiermoe.models.spec import MoESpec
from tiermoe.moe.experts import ExpertBackend
from tiermoe.moe.router import Router


class MoELayer(nn.Module):
    def __init__(self, moe: MoESpec, hidden: int, layer: int):
        super().__init__()
        self.layer, self.moe = layer, moe
        self.gate = Router(moe, hidden)
        if moe.shared_intermediate_size:
            setattr(self, moe.shared_expert_name, SwiGLU(hidden, moe.shared_intermediate_size))
            if moe.shared_expert_gated:
                self.shared_expert_gate = Linear(hidden, 1)
        self.backend: ExpertBackend | None = None  # set by the loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        topk_ids, topk_weights = self.gate(x)
        out = self.backend.forward(self.layer, x, topk_ids, topk_weights)
        if self.moe.shared_intermediate_size:
            shared = getattr(self, self.moe.shared_expert_name)(x)
            if self.moe.shared_expert_gated:
                shared = F.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out
