"""The real GLM-5.3-Flash routing statistics, fitted to a synthetic model's shape.

Random-weight models route nearly the same experts for every token, so their tiered speed says
nothing about a real model's. Every synthetic generator writes these counts beside the model
(`expert-stats.json`), and the benchmark scripts serve it with `--routing-replay` on them.
"""

from __future__ import annotations

import json
from pathlib import Path

REAL_STATS = Path(__file__).resolve().parents[1] / "store" / "data" / "glm53-flash-decode-expert-counts.json"
STATS_NAME = "expert-stats.json"


def write_real_stats(path: str | Path, moe_layers: list[int], experts: int) -> Path:
    """Write per-layer pick counts for a model whose MoE layers are `moe_layers` (model layer
    indices) of `experts` experts: the real layers spread over them, each popularity curve
    resampled to `experts` (store.planner.counts_for_model). Same format as --expert-stats."""
    from tiermoe.store.planner import counts_for_model, load_stats

    counts = counts_for_model(load_stats(REAL_STATS), len(moe_layers), experts)
    data = {f"model.layers.{layer}.mlp": [round(float(c), 3) for c in row] for layer, row in zip(moe_layers, counts)}
    path = Path(path)
    path.write_text(json.dumps(data) + "\n")
    return path
