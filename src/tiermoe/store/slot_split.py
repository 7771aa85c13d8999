"""How a GPU slot budget is split over the MoE layers: by popularity, as static placement would.

Real routing is far more concentrated in some layers than in others: on GLM-5.3-Flash's
statistics, the 474 most popular experts of 16 layers (11 % of them) fall 2 to 47 to a layer.
An even split gives every layer the same share and loses hits in the concentrated layers; a
policy that decides inside each layer can then not reach the bound of static placement over one
shared pool, whatever it admits. So the device cache's slots are split the way that shared
static placement would place them: the `slots` most popular (layer, expert) pairs, counted per
layer. Uniform (or missing) rates fall back to an even split: ties go round-robin over the
layers, most popular rank first.
"""

from __future__ import annotations

from typing import Hashable, Mapping, Sequence

STAGE_PICKS = 4  # staged (not admitted) misses per step are bounded by top_k x this many tokens


def static_tiers(rates: Mapping[Hashable, float], n_slots: int, n_host: int) -> dict[str, list]:
    """Static placement by popularity: the `n_slots` most popular keys in slots, the next `n_host` in host RAM, the
    rest on disk only (ties by key). The plan's expected hits and its prefill reads place experts this way."""
    order = sorted(rates, key=lambda k: (-rates[k], k))
    return {"slots": order[:n_slots], "host": order[n_slots: n_slots + n_host], "disk": order[n_slots + n_host:]}


def staging_rows(slots: int, top_k: int, max_tokens: int, stage_misses: bool = True) -> int:
    """Rows of a device cache's GPU budget of `slots` records kept for the misses its admission filter
    does not admit (shared by all layers: stream order): top_k x min(max_tokens, STAGE_PICKS), at most
    half the budget (moe/device_cache.split_budget; `tiermoe plan` counts them out of the slots)."""
    want = top_k * max(1, min(int(max_tokens), STAGE_PICKS)) if stage_misses else 0
    return min(want, max(0, int(slots)) // 2)


def split_by_popularity(slots: int, rates: Sequence[Sequence[float]]) -> list[int]:
    """Slots of each layer: how many of the `slots` highest expected-pick rates over all layers
    fall in each. rates[i][e]: expected picks per token of layer i's expert e (any scale shared
    by all layers); a layer never gets more slots than it has experts."""
    slots = max(0, int(slots))
    ranked = []  # (-rate, rank within its layer, layer)
    for layer, layer_rates in enumerate(rates):
        order = sorted(range(len(layer_rates)), key=lambda e: -float(layer_rates[e]))
        ranked.extend((-float(layer_rates[e]), rank, layer) for rank, e in enumerate(order))
    ranked.sort()
    per_layer = [0] * len(rates)
    for _, _, layer in ranked[:slots]:
        per_layer[layer] += 1
    return per_layer
