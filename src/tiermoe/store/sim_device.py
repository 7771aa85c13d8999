"""The device cache's own policy in `tiermoe sim`: per-layer CLOCK with the frequency filter.

The serving engine's GPU slot cache (`kernels/triton/cache_manager.py`) decides admissions on
the device, one layer at a time, with a warm start from the statistics and an admission filter
on decayed pick frequencies; its slots are split over the layers by popularity
(`store.slot_split`). The shared-pool policies of
`store/sim.py` cannot say how close that policy comes to the bounds, so this runs the policy's
plain-torch twin (`kernels.reference.cache_step_ref`, tested bit for bit against the kernel)
on the same picks: the simulated hits are the ones the kernel would count.
"""

from __future__ import annotations

import numpy as np

from tiermoe.kernels.cache_policy import DECAY_SHIFT
from tiermoe.store.slot_split import split_by_popularity


def _layer_state(n_experts: int, n_slots: int, rates: np.ndarray, decay_shift: int):
    """A CPU cache state (fake, distinct addresses) warm-started like `DeviceCacheExperts`."""
    import torch

    i32, i64 = dict(dtype=torch.int32), dict(dtype=torch.int64)
    host = torch.arange(n_experts, **i64) * 2 + 1  # [E] odd: never a slot address
    slot_addr = torch.arange(n_slots, **i64) * 2  # [S] even
    st = {
        "host_addr": host, "ptr_table": host.clone(), "slot_addr": slot_addr,
        "slot_expert": torch.full((n_slots,), -1, **i32), "expert_slot": torch.full((n_experts,), -1, **i32),
        "ref": torch.zeros(n_slots, **i32), "clock": torch.zeros(2, **i32),
        "copy_src": torch.zeros(max(1, n_experts), **i64), "copy_dst": torch.zeros(max(1, n_experts), **i64),
        "n_copy": torch.zeros(1, **i32), "stats": torch.zeros(5, **i64),
        "freq": torch.zeros(n_experts, **i32), "step_table": host.clone(),
    }
    rate_t = torch.tensor(rates, dtype=torch.float64)  # [E] expected picks per token
    warm = torch.argsort(rate_t, descending=True, stable=True)[:n_slots]
    st["slot_expert"][: len(warm)] = warm.to(torch.int32)
    st["expert_slot"][warm] = torch.arange(len(warm), **i32)
    st["ptr_table"][warm] = slot_addr[: len(warm)]
    st["freq"].copy_((rate_t.clamp(min=0, max=1.0) * (1024 << decay_shift)).round().to(torch.int32))
    return st


def cache_states(slots: int, rates: np.ndarray, decay_shift: int = DECAY_SHIFT) -> list[dict]:
    """Each layer's warm-started cache state, `slots` split over the layers by popularity as the engine splits
    them (rates [L, E] expected picks per token; all zero: evenly, and a cold start)."""
    split = rates if rates.any() else np.ones_like(rates)
    per_layer = split_by_popularity(slots, [list(r) for r in split])
    return [_layer_state(rates.shape[1], per_layer[i], rates[i], decay_shift) for i in range(rates.shape[0])]


def run_device_policy(trace: np.ndarray, slots: int, warmup: int, rates: np.ndarray | None,
                      decay_shift: int = DECAY_SHIFT) -> tuple[float, float]:
    """trace int64 [T, L, k] of per-layer expert ids; rates [L, E] expected picks per token.

    Returns per-token (slot hits, slot misses) over the tokens after `warmup`, one decode step
    of one token at a time (batch 1), `slots` split over the L layers by popularity as the engine
    splits them (evenly without rates).
    """
    import torch

    from tiermoe.kernels.reference import cache_step_ref

    n_tok, n_layers, _ = trace.shape
    if rates is None:
        rates = np.zeros((n_layers, int(trace.max()) + 1))
    states = cache_states(slots, rates, decay_shift)
    hits = lookups = 0
    ids = torch.from_numpy(np.ascontiguousarray(trace))  # [T, L, k]
    for t in range(n_tok):
        if t == warmup:
            hits = lookups = 0
        for i, st in enumerate(states):
            before = st["stats"][:2].clone()
            if st["slot_addr"].numel():
                cache_step_ref(st, ids[t, i], admit_max=st["slot_addr"].numel(), decay_shift=decay_shift)
                d = st["stats"][:2] - before
                lookups += int(d[0])
                hits += int(d[1])
            else:
                lookups += len(set(ids[t, i].tolist()))
    n = n_tok - warmup
    return hits / n, (lookups - hits) / n
