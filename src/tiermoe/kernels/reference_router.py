"""Plain-torch twins of the sigmoid "noaux_tc" routing kernels (kernels/triton/router.py).

This is the routing of transformers' DeepSeek-V3 / GLM MoE gates, their fp32 projection included,
operation by operation (models/blocks/router.py runs it on CPU, and wherever a gradient is
needed): routing decisions are discrete, so a different rounding anywhere could flip a pick and
break exactness against the reference. Kept apart from reference.py (the expert-path twins) so
the router's code path reads on its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sigmoid_topk_route_ref(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                           norm_topk_prob: bool, routed_scaling_factor: float,
                           replay_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits fp32 [T, E], bias [E] (e_score_correction_bias) -> (ids [T, k] long, weights fp32 [T, k]).

    The bias only steers the choice; the weights are the plain sigmoid scores of the chosen
    experts. With n_group > 1 the experts form n_group equal groups, each rated by the sum of its
    two best biased scores, and only the topk_group best groups compete. Ids come in
    torch.topk(sorted=False)'s order, which torch does not define (a set, as far as callers may
    assume). replay_ids [T, k] long (routing replay): returned as the ids, with the weights this
    router gives them (the top-k is still computed, as the router's cost stays in the step).
    """
    scores = logits.sigmoid()  # [T, E]
    choice = scores + bias.float()  # [T, E]
    if n_group > 1:
        t, e = choice.shape
        group_scores = choice.view(t, n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)  # [T, G]
        score_mask = group_mask.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, -1)  # [T, E]
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]  # [T, k]
    if replay_ids is not None:
        ids = replay_ids
    weights = scores.gather(1, ids)  # [T, k]
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * routed_scaling_factor


def sigmoid_topk_route_from_hidden_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int,
                                       n_group: int, topk_group: int, norm_topk_prob: bool,
                                       routed_scaling_factor: float,
                                       replay_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of router.sigmoid_topk_route_from_hidden: x [T, H], weight [E, H] (the gate), bias [E] ->
    (ids [T, k] long, weights fp32 [T, k]).

    The gate's projection in fp32 (x and weight cast first, as transformers does; cuBLAS on a GPU, which the
    kernels replace; weight.float() is the weight itself when it is fp32 already), then sigmoid_topk_route_ref."""
    logits = F.linear(x.float(), weight.float())  # [T, E] fp32
    return sigmoid_topk_route_ref(logits, bias.float(), top_k, n_group, topk_group, norm_topk_prob,
                                  routed_scaling_factor, replay_ids)
