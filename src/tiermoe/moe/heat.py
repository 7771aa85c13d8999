"""Per-layer expert heat (MoE layers x routed experts) for the web dashboard's heat map.

`ExpertBackend.heat()` answers with one of these, read on the engine thread between steps
(AsyncEngine.expert_heat -> LLMEngine.expert_heat), at most every few seconds and only while a
dashboard is open: never inside a step, so never inside a recorded CUDA graph. Plain lists go
out, because the server process never imports torch.

The counts come from counters the expert tiers already keep, whichever backend serves:

  - the device slot cache (moe/device_cache.py): each layer's ExpertCache keeps `freq`, its
    decayed pick count per expert (1024 per pick, decayed every cache step; what its admission
    filter compares). All layers are concatenated on the device and copied to the host once
    (one wait for the queued steps, as stats() already does). measure "recent_picks".
  - the store backends (store/facade.py): the store counts every use of every record
    (StoreCounters.key_uses), exact since start-up. measure "uses".

Each cell also says where the expert sits now: 0 GPU slot, 1 host RAM, 2 disk.
"""

from __future__ import annotations

TIER_CODES = {"slots": 0, "host": 1, "disk": 2}
FREQ_PER_PICK = 1024  # ExpertCache.freq units (kernels/triton/cache_manager.py)


def store_heat(store) -> dict:
    """{"measure", "layers", "experts", "counts" [L][E], "tiers" [L][E]} of an ExpertStore."""
    uses, residency = store.c.key_uses, store.residency
    layers = store.moe_layers
    counts, tiers = [], []
    for layer in layers:
        keys = [store.key(layer, e) for e in range(store.manifest.experts_per_layer.get(layer, 0))]
        counts.append([uses.get(k, 0) for k in keys])
        tiers.append([TIER_CODES[residency.tier(k)] for k in keys])
    return {"measure": "uses", "layers": layers, "experts": store.num_experts, "counts": counts, "tiers": tiers}


def device_cache_heat(caches: dict) -> dict:
    """The same from the device cache's per-layer ExpertCaches ({layer: cache})."""
    import torch

    layers = sorted(caches)
    if not layers:
        return {"measure": "recent_picks", "layers": [], "experts": 0, "counts": [], "tiers": []}
    per_layer = [caches[layer] for layer in layers]
    sizes = [c.num_experts for c in per_layer]
    # one device->host copy for every layer: freq then expert_slot (>= 0: held in a GPU slot)
    flat = torch.cat([c.freq.long() for c in per_layer] + [c.expert_slot.long() for c in per_layer]).cpu().tolist()
    counts, tiers, at = [], [], 0
    for n in sizes:
        counts.append([round(f / FREQ_PER_PICK, 1) for f in flat[at:at + n]])
        at += n
    for n in sizes:
        # inclusive placement: every expert is in pinned host RAM, some also in a slot
        tiers.append([0 if s >= 0 else 1 for s in flat[at:at + n]])
        at += n
    return {"measure": "recent_picks", "layers": layers, "experts": max(sizes), "counts": counts, "tiers": tiers}
