"""Writing a synthetic packed store directly: the parts every GLM-shaped generator shares.

scripts/synth_glm_store.py (a glm4_moe checkpoint with GLM-5.3-Flash's MoE shape) and
`tiermoe bench make-glm5` (synthetic_glm5.py, the glm5_next architecture itself) both write
manifest.json + experts.bin + dense safetensors shards without a bf16 checkpoint in between,
because at full size the experts alone are hundreds of GB. What they share lives here, so the
two stores are built the same way:

- routing realism: per MoE layer, the real GLM-5.3-Flash pick counts (store/data) resampled to
  the layer's expert count, and a router score-correction bias calibrated so that random router
  logits reproduce that layer's skew (`calibrated_bias`); the counts go to expert-stats.json;
- random valid expert records (bench/records.py) in one kind, or two for a mixed store;
- dense shards streamed through the importers' ShardWriter, and the manifest, written last.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from tiermoe.bench.real_routing import REAL_STATS, STATS_NAME

SHARD_BYTES = 2 << 30
KINDS = ("int4", "int8", "int3", "bf16")


@dataclass(frozen=True)
class ExpertShape:
    """Routed experts of one store: shape, record kind(s) and the seed of their random bytes.

    cold_kind: a mixed store, as `pack --cold-quant` makes one: per layer the experts holding
    `mixed_share` of the real counts' picks are in `kind`, the rest in `cold_kind`."""

    hidden: int
    inter: int
    experts: int
    kind: str = "int4"
    group: int = 128
    cold_kind: str | None = None
    cold_group: int = 64
    mixed_share: float = 0.6
    seed: int = 0

    def kinds(self) -> list[tuple[str, int | None]]:
        out = [(self.kind, self.group)] + ([(self.cold_kind, self.cold_group)] if self.cold_kind else [])
        return [(k, None if k == "bf16" else g) for k, g in out]

    def layouts(self):
        """The store's RecordLayouts (layout 0 = `kind`, 1 = `cold_kind`)."""
        from tiermoe.store.records import RecordLayout

        return [RecordLayout.build(k, self.hidden, self.inter, g) for k, g in self.kinds()]

    def record_bytes(self) -> int:
        return max(lay.length for lay in self.layouts())


# ----------------------------------------------------------------------------- routing
def real_counts(n_layers: int, experts: int) -> list[np.ndarray]:
    """Pick counts of n_layers real layers, spread over the 42 measured ones (the mapping
    `--routing-replay` uses too), each resampled to `experts` experts."""
    from tiermoe.store.planner import counts_for_model, load_stats

    return counts_for_model(load_stats(REAL_STATS), n_layers, experts)


def calibrated_bias(counts: np.ndarray, top_k: int, share: float, rng: np.random.Generator) -> np.ndarray:
    """Score-correction bias [E] making the top `share` of experts (by count) take the same
    fraction of picks as in `counts`, for router logits ~ N(0, 1).

    Why: random router weights spread picks almost uniformly, so a store's tiered speed would
    say nothing about the real model's. The bias is proportional to the standardized log count;
    its factor is bisected on sampled sigmoid scores until the hot share's coverage matches."""
    e = counts.size
    s = max(1, round(share * e))
    hot = np.argsort(-counts)[:s]
    target = counts[hot].sum() / counts.sum()
    z = np.log1p(counts)
    z = (z - z.mean()) / (z.std() + 1e-9)
    scores = 1.0 / (1.0 + np.exp(-rng.standard_normal((4096, e))))  # [N, E] sigmoid router scores
    is_hot = np.zeros(e, dtype=bool)
    is_hot[hot] = True

    def coverage(beta: float) -> float:
        picks = np.argpartition(-(scores + beta * z), top_k, axis=1)[:, :top_k]  # [N, top_k]
        return float(is_hot[picks].mean())

    lo, hi = 0.0, 4.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if coverage(mid) < target else (lo, mid)
    return (lo + hi) / 2 * z


def routing(layers: list[int], experts: int, top_k: int, hot_share: float, seed: int,
            counts: list[np.ndarray] | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(per-layer real counts, per-layer calibrated biases) for MoE `layers`; `counts` overrides
    the real ones (one array per layer)."""
    counts = real_counts(len(layers), experts) if counts is None else counts
    rng = np.random.default_rng(seed)
    return counts, [calibrated_bias(c, top_k, hot_share, rng) for c in counts]


def write_stats(out: Path, layers: list[int], counts: list[np.ndarray]) -> Path:
    """OUT/expert-stats.json: the counts in the --expert-stats / --routing-replay format."""
    path = Path(out) / STATS_NAME
    path.write_text(json.dumps({f"model.layers.{L}.mlp": c.tolist() for L, c in zip(layers, counts)}))
    return path


# ----------------------------------------------------------------------------- files
def write_dense(out: Path, tensors: Iterable[tuple[str, torch.Tensor]], shard_bytes: int = SHARD_BYTES) -> dict:
    """Dense safetensors shards + index from (name, tensor) pairs, streamed (a shard is written
    once it is full, so the whole dense model never sits in memory); returns the manifest's
    `dense` entry."""
    from tiermoe.importers.writer import ShardWriter

    writer = ShardWriter(Path(out), shard_bytes)
    for name, t in tensors:
        writer.add(name, t)
    shards = writer.close()
    index = json.loads((Path(out) / "model.safetensors.index.json").read_text())
    return {"index": "model.safetensors.index.json", "shards": [p.name for p in shards],
            "tensors": len(index["weight_map"])}


def write_experts(out: Path, shape: ExpertShape, layers: list[int], counts: list[np.ndarray],
                  device: torch.device, log: Callable[[str], None]) -> tuple[list, list[dict]]:
    """experts.bin: layer-major, expert-minor random records at their own lengths; returns (layouts,
    manifest records). A mixed store's layer keeps its most-picked experts (by `counts`) in layout 0."""
    from tiermoe.bench.records import random_records
    from tiermoe.kernels.layout import expert_layout
    from tiermoe.store.mixed import hot_experts
    from tiermoe.store.records import EXPERTS_NAME

    layouts = shape.layouts()
    klays = [expert_layout(k, shape.hidden, shape.inter, g or shape.group) for k, g in shape.kinds()]
    for lay, klay in zip(layouts, klays):
        assert klay.length == lay.length
    n_exp = shape.experts
    gen = torch.Generator(device=device).manual_seed(shape.seed)
    records, offset = [], 0
    chunk = max(1, (512 << 20) // max(lay.length for lay in layouts))  # records per write (~512 MiB)
    with open(Path(out) / EXPERTS_NAME, "wb") as f, ThreadPoolExecutor(16) as pool:
        for layer, c in zip(layers, counts):
            hot = hot_experts(c.tolist(), shape.mixed_share) if shape.cold_kind else set(range(n_exp))
            which = [0 if e in hot else 1 for e in range(n_exp)]
            for e0 in range(0, n_exp, chunk):
                n = min(chunk, n_exp - e0)
                bufs = [random_records(k, n, device, gen).cpu().numpy() for k in klays]  # per kind [n, R_k]
                rows = [bufs[which[e0 + j]][j] for j in range(n)]
                hashes = [pool.submit(lambda b: hashlib.sha256(b).hexdigest(), r) for r in rows]
                for j, (r, h) in enumerate(zip(rows, hashes)):
                    f.write(memoryview(r).cast("B"))
                    records.append({"layer": layer, "expert": e0 + j, "offset": offset, "length": r.size,
                                    "sha256": h.result(), "layout": which[e0 + j]})
                    offset += r.size
            n_cold = which.count(1)
            log(f"layer {layer}: {n_exp - n_cold} records of {layouts[0].length / 2**20:.2f} MiB"
                + (f", {n_cold} of {layouts[1].length / 2**20:.2f} MiB" if n_cold else ""))
    return layouts, records


def write_store_manifest(out: Path, cfg: dict, shape: ExpertShape, num_layers: int, layers: list[int],
                         prefix: str, layouts: list, records: list[dict], dense: dict) -> dict:
    """manifest.json, written last (a directory without it is an unfinished store); `prefix`
    is the checkpoint key prefix of the decoder layers (e.g. "model.layers."). Returns the
    one-line summary the generators print."""
    from tiermoe.store.records import EXPERTS_NAME, FORMAT_VERSION, RECORD_ALIGN, write_manifest

    quantization = {"kind": shape.kind, "group_size": layouts[0].group_size}
    if shape.cold_kind:
        quantization.update(cold_kind=shape.cold_kind, cold_group_size=layouts[1].group_size,
                            hot_share=shape.mixed_share, expert_stats=STATS_NAME,
                            records_per_layout=[sum(1 for r in records if r["layout"] == i) for i in (0, 1)])
    write_manifest(Path(out), {
        "format_version": FORMAT_VERSION,
        "model_config": cfg,
        "quantization": quantization,
        "dtype": "bfloat16",
        "source_dtype": "bfloat16",
        "num_layers": num_layers,
        "moe_layers": layers,
        "experts_per_layer": {str(L): shape.experts for L in layers},
        "expert_prefixes": {str(L): f"{prefix}{L}.mlp.experts" for L in layers},
        "experts_file": EXPERTS_NAME,
        "record_align": RECORD_ALIGN,
        "layouts": [lay.to_json() for lay in layouts],
        "records": records,
        "dense": dense,
    })
    total = sum(r["length"] for r in records)
    return {"store": str(out), "moe_layers": len(layers), "experts": len(records),
            "record_bytes": max(lay.length for lay in layouts), "expert_gib": round(total / 2**30, 2)}
