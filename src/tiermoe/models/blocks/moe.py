"""MoE feed-forward layer: router -> experts (through the backend seam) -> combine (+ shared).

A model block like attention: it owns the router and the shared expert (checkpoint weights of
the model) and reaches the routed experts only through `ExpertBackend` (moe/), which knows
nothing of models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tiermoe.models.blocks.common import Linear, SwiGLU
from tiermoe.models.blocks.router import Router
from tiermoe.models.spec import MoESpec
from tiermoe.moe.experts import ExpertBackend


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
        self.routing = None  # moe/replay.py LayerRouting: routing replay and/or recording (benchmarks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        routing = self.routing
        topk_ids, topk_weights = self.gate(x) if routing is None else routing.route(self.gate, x)
        out = self.backend.forward(self.layer, x, topk_ids, topk_weights)
        if self.moe.shared_intermediate_size:
            shared = getattr(self, self.moe.shared_expert_name)(x)
            if self.moe.shared_expert_gated:
                shared = F.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    def predict_ids(self, x: torch.Tensor) -> torch.Tensor:
        """The ids [T, k] this layer will pick for x [T, H], with no side effect (layer-ahead
        prefetch calls it on the previous layer's input: under replay, the rows it will take)."""
        return self.gate(x)[0] if self.routing is None else self.routing.peek(x.shape[0])
