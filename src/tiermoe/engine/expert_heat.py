"""Per-layer expert heat (MoE layers x routed experts) for the web dashboard's heat map.

Read on the engine thread between steps (AsyncEngine.expert_heat -> LLMEngine.expert_heat), at
most every few seconds and only while a dashboard is open: never inside a step, so never inside
a recorded CUDA graph. Plain lists go out, because the server process never imports torch.

The counts come from counters the expert tiers already keep, whichever serves the experts:

  - the device slot cache (moe/device_cache.py): each layer's ExpertCache keeps `freq`, its
    decayed pick count per expert (1024 per pick, decayed every cache step; what its admission
    filter compares). All layers are concatenated on the device and copied to the host once
    (one wait for the queued steps, as stats() already does). measure "recent_picks".
  - the store paths (moe/store_backends.py over store/facade.py): the store counts every use
    of every record (StoreCounters.key_uses), exact since start-up. measure "uses".

Each cell also says where the expert sits now: 0 GPU slot, 1 host RAM, 2 disk.
"""

from __future__ import annotations

from tiermoe.moe.device_cache import DeviceCacheExperts
from tiermoe.moe.lane import LaneExperts
from tiermoe.moe.store_backends import StoreBackend

TIER_CODES = {"slots": 0, "host": 1, "disk": 2}
FREQ_PER_PICK = 1024  # ExpertCache.freq units (kernels/triton/cache_manager.py)


def expert_heat_map(backend) -> dict | None:
    """{"measure", "layers", "experts", "counts" [L][E], "tiers" [L][E]} or None when the
    experts are resident (no tiers, nothing counted per expert)."""
    if isinstance(backend, LaneExperts):  # fast mode: the CPU lane around the backend that keeps the counts
        backend = backend.inner
    if isinstance(backend, DeviceCacheExperts):
        return _device_cache_heat(backend)
    if isinstance(backend, StoreBackend):
        return _store_heat(backend.store)
    return None


def _store_heat(store) -> dict:
    uses, residency = store.c.key_uses, store.residency
    layers = store.moe_layers
    counts, tiers = [], []
    for layer in layers:
        keys = [store.key(layer, e) for e in range(store.manifest.experts_per_layer.get(layer, 0))]
        counts.append([uses.get(k, 0) for k in keys])
        tiers.append([TIER_CODES[residency.tier(k)] for k in keys])
    return {"measure": "uses", "layers": layers, "experts": store.num_experts, "counts": counts, "tiers": tiers}


def _device_cache_heat(cache) -> dict:
    import torch

    layers = sorted(cache.caches)
    if not layers:
        return {"measure": "recent_picks", "layers": [], "experts": 0, "counts": [], "tiers": []}
    caches = [cache.caches[layer] for layer in layers]
    sizes = [c.num_experts for c in caches]
    # one device->host copy for every layer: freq then expert_slot (>= 0: held in a GPU slot)
    flat = torch.cat([c.freq.long() for c in caches] + [c.expert_slot.long() for c in caches]).cpu().tolist()
    counts, tiers, at = [], [], 0
    for n in sizes:
        counts.append([round(f / FREQ_PER_PICK, 1) for f in flat[at:at + n]])
        at += n
    for n in sizes:
        # inclusive placement: every expert is in pinned host RAM, some also in a slot
        tiers.append([0 if s >= 0 else 1 for s in flat[at:at + n]])
        at += n
    return {"measure": "recent_picks", "layers": layers, "experts": max(sizes), "counts": counts, "tiers": tiers}
