"""What `ExpertStore.open` settles before a store object exists: the checked manifest, the device,
the tier plan (logged, one line a row) and each record's expected picks per token."""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from dataclasses import replace

import torch

from tiermoe.errors import UserError
from tiermoe.store.planner import TierPlan, build_plan, config_top_k, key_rates
from tiermoe.store.policy import POLICIES
from tiermoe.store.records import Manifest, check_experts_file, load_manifest

log = logging.getLogger("tiermoe.store")


def open_parts(path: str | os.PathLike, *, device: str, gpu_expert_gb: float | None, host_expert_gb: float | None,
               policy: str, stats_file: str | os.PathLike | None, only: Collection[int] | None = None
               ) -> tuple[Manifest, torch.device, TierPlan, dict[int, float]]:
    """(manifest, device, tier plan, {record key: expected picks per token}); UserError for a bad
    policy, a missing CUDA device or a store whose files do not match its manifest. only: the records the
    store will be asked for (an expert-parallel rank's share): rates of those alone, tiers no larger."""
    if policy not in POLICIES:
        raise UserError(f"--policy {policy!r}: choose one of {', '.join(POLICIES)}")
    m = load_manifest(path)
    check_experts_file(m)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {device!r} requested but CUDA is not available")
    plan = build_plan(m, device=device, gpu_expert_gb=gpu_expert_gb, host_expert_gb=host_expert_gb,
                      stats_file=stats_file)
    for line in plan.table().splitlines():
        log.info(line)
    rates, _, _ = key_rates(m, stats_file, config_top_k(m.config))
    if only is not None:
        keep = set(only)
        rates = {k: r for k, r in rates.items() if k in keep}
        slots = min(plan.n_slots, len(keep))
        plan = replace(plan, n_slots=slots, n_host=min(plan.n_host, len(keep) - slots))
        log.info("this rank's share: %d of %d experts (%d in slots, %d in host RAM at most)", len(keep),
                 plan.total_experts, plan.n_slots, plan.n_host)
    return m, dev, plan, rates
