"""Routers: token -> (top-k expert ids, combine weights).

Both scoring schemes mirror transformers op for op (dtype of the logits, where the softmax
is taken in fp32, where weights are renormalised), since routing decisions are discrete and
a flipped pick would break exactness.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tiermoe.models.blocks.common import empty_param
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
        m = self.moe
        logits = F.linear(x.float(), self.weight.float())  # [T, E] fp32
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if m.n_group > 1:
            t = choice.shape[0]
            group_scores = choice.view(t, m.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
            group_idx = torch.topk(group_scores, k=m.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand(t, m.n_group, m.num_experts // m.n_group).reshape(t, -1)
            choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        ids = torch.topk(choice, k=m.top_k, dim=-1, sorted=False)[1]
        if replay_ids is not None:
            ids = replay_ids
        weights = scores.gather(1, ids)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * m.routed_scaling_factor
