"""Per-layer expert heat (MoE layers x routed experts) for the web dashboard's heat map.

Each expert backend answers for itself (`ExpertBackend.heat()`; the counts and their meaning
are in moe/heat.py): the store backends from the store's per-record use counts, the device
cache from its decayed pick frequencies, resident experts with None. LLMEngine.expert_heat asks
the runner's backend; this function is the same question for any backend, or none.
"""

from __future__ import annotations

from tiermoe.moe.experts import ExpertBackend
from tiermoe.moe.heat import FREQ_PER_PICK, TIER_CODES

__all__ = ["FREQ_PER_PICK", "TIER_CODES", "expert_heat_map"]


def expert_heat_map(backend: ExpertBackend | None) -> dict | None:
    """{"measure", "layers", "experts", "counts" [L][E], "tiers" [L][E]} or None when there are
    no tiers (resident experts, or no backend)."""
    return None if backend is None else backend.heat()
