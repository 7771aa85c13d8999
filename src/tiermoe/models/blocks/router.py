"""Routers: token -> (top-k expert ids, combine weights).

Both scoring schemes mirror transformers op for op (dtype of the logits, where the softmax
is taken in fp32, where weights are renormalised), since routing decisions are discrete and
a flipped pick would break exactness.

The sigmoid scheme (fp32 projection, then sigmoid, bias, group pre-selection, top-k and
renormalisation) is two Triton launches on CUDA when nothing needs a gradient
(kernels/triton/router.py's sigmoid_topk_route_from_hidden: split-K projection partials, then the
routing kernel adding them in a fixed order), where torch issues ~12 tiny kernels per layer after
the projection and an fp32 copy of x plus cuBLAS's GEMV (two kernels at decode) for it. Besides
the launches, cuBLAS's fp32 GEMV rounds differently for different row counts, so a token verified
in a batch of draft tokens could route otherwise than decoded alone; the kernels' result for a
token does not depend on the batch. Elsewhere (CPU, training) the plain-torch twin runs
(kernels.reference_router.sigmoid_topk_route_from_hidden_ref: the transformers code, unchanged,
so CPU results are bit for bit the reference's). The kernels' logits match the twin's to fp32
rounding, not bit for bit: the two pick the same expert set unless biased scores lie within that
rounding of each other. The kernel's ids come in descending biased-score order, the twin's in
torch.topk(sorted=False)'s unspecified order: callers treat a token's ids as a set (fused_moe adds
the picks in pick order, so the order moves only fp32 rounding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tiermoe.kernels.reference_router import sigmoid_topk_route_from_hidden_ref
from tiermoe.models.blocks.common import device_kernels, empty_param
from tiermoe.models.spec import MoESpec


class Router(nn.Module):
    def __init__(self, moe: MoESpec, hidden: int):
        super().__init__()
        self.moe = moe
        self.weight = empty_param(moe.num_experts, hidden)
        if moe.scoring == "sigmoid_noaux":
            # Its dtype (and the weight's) follows the reference: see models/fp32_params.py.
            self.e_score_correction_bias = empty_param(moe.num_experts)

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_ids [T, k] long, topk_weights [T, k]).

        ids [T, k] long (routing replay, moe/replay.py): the router still runs in full (its
        cost stays in the step) but returns these ids, with the weights it gives them (the
        same gather, renormalisation, scaling and dtype as for its own picks).
        """
        if self.moe.scoring == "softmax":
            return self._softmax(x, ids)
        return self._sigmoid_noaux(x, ids)

    def _softmax(self, x, replay_ids=None):
        logits = F.linear(x, self.weight)  # [T, E] in the model dtype
        probs = F.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.moe.top_k, dim=-1)
        if replay_ids is not None:
            ids, weights = replay_ids, probs.gather(1, replay_ids)  # [T, k]
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, (weights if self.moe.fp32_combine_weights else weights.to(logits.dtype))

    def _sigmoid_noaux(self, x, replay_ids=None):
        """x [T, H] -> (ids [T, k] long, weights fp32 [T, k]): logits = x.float() @ weight.float().T, then the
        noaux_tc routing. On CUDA two launches reading x, the weight and the bias in their own dtypes (no fp32
        copies); the kernels carry no gradient, so anything that trains through here takes the twin (the torch
        code, also the CPU path)."""
        m = self.moe
        weight, bias = self.weight, self.e_score_correction_bias
        if device_kernels(x, weight, bias):
            from tiermoe.kernels.triton.router import sigmoid_topk_route_from_hidden as route
        else:
            route = sigmoid_topk_route_from_hidden_ref
        return route(x, weight, bias, m.top_k, m.n_group, m.topk_group, m.norm_topk_prob, m.routed_scaling_factor,
                     replay_ids)
