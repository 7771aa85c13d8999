"""Expert-parallel shares: which rank (GPU) owns each routed expert of each MoE layer.

Here, below the model and the engine, because both the expert-parallel ranks (moe/expert_parallel.py) and
`tiermoe plan --tensor-parallel-size` deal the same shares from the same routing statistics.
"""

from __future__ import annotations

from typing import Mapping, Sequence


def share_experts(rates: Sequence[Sequence[float]], world: int) -> list[list[int]]:
    """Owner rank of each expert of each layer: rates[i][e] expected picks per token of layer i's expert e,
    dealt back and forth in descending order of rate (ties by id), so the shares match in count, in
    expected picks and in how those are spread."""
    if world < 1:
        raise ValueError("share_experts: world must be >= 1")
    owners = []
    for layer_rates in rates:
        order = sorted(range(len(layer_rates)), key=lambda e: (-float(layer_rates[e]), e))
        owner = [0] * len(layer_rates)
        for i, e in enumerate(order):
            lap, pos = divmod(i, world)
            owner[e] = pos if lap % 2 == 0 else world - 1 - pos
        owners.append(owner)
    return owners


def deal(manifest, rates: Mapping[int, float], ranks: int) -> tuple[dict[int, list[int]], dict[int, list[float]]]:
    """({MoE layer: owner rank of each expert}, {MoE layer: each expert's expected picks}) for a store's
    manifest and {record key: expected picks per token}."""
    key = {(r.layer, r.expert): r.index for r in manifest.records}
    per_layer = {layer: [rates[key[(layer, e)]] for e in range(manifest.experts_per_layer[layer])]
                 for layer in manifest.moe_layers}
    return dict(zip(per_layer, share_experts(list(per_layer.values()), ranks))), per_layer


def rank_keys(manifest, owners: Mapping[int, Sequence[int]], rank: int) -> frozenset[int]:
    """The record keys of `rank`'s share."""
    key = {(r.layer, r.expert): r.index for r in manifest.records}
    return frozenset(key[(layer, e)] for layer, owner in owners.items() for e, r in enumerate(owner) if r == rank)


def rank_rates(manifest, rates: Mapping[int, float], ranks: int, rank: int = 0) -> dict[int, float]:
    """{record key: expected picks per token} of `rank`'s share of the experts."""
    return {k: rates[k] for k in rank_keys(manifest, deal(manifest, rates, ranks)[0], rank)}


def check_ranks(manifest, ranks: int) -> None:
    """UserError unless every rank of `ranks` owns at least top_k experts of every MoE layer (a token's picks
    of other ranks' experts are stood in for by the rank's own, moe/expert_parallel.py)."""
    from tiermoe.errors import UserError
    from tiermoe.store.planner import config_top_k

    top_k = config_top_k(manifest.config)
    fewest = min(manifest.experts_per_layer[layer] for layer in manifest.moe_layers)
    if ranks < 1 or fewest // ranks < top_k:
        raise UserError(f"--tensor-parallel-size {ranks}: must be 1 to {max(1, fewest // top_k)} for this model "
                        f"({fewest} experts a layer, {top_k} picks a token: each rank owns at least {top_k})")
