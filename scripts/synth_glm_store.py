"""Write a synthetic packed store with GLM-5.3-Flash's MoE shape, ready for `tiermoe serve`.

    python scripts/synth_glm_store.py OUT [--moe-layers 8] [--kind int4] [--device cuda]
        [--cold-kind int3 [--cold-group 64] [--mixed-share 0.6]]

The model is a glm4_moe checkpoint (one dense layer, then MoE layers of hidden 4096, 288 routed
experts of intermediate 2048, top-8, one shared expert; 32 attention heads) with random
fan-in-scaled dense weights and random valid expert records (int4 group 128, int3, int8 or
bf16; with --cold-kind a mixed store as `pack --cold-quant` makes one: per layer the experts
holding --mixed-share of the real counts' picks in --kind, the rest in --cold-kind), written
directly in the store format (manifest.json + experts.bin + dense safetensors shards), so no
multi-GB bf16 checkpoint has to be written and quantized first.

Routing realism: each MoE layer's router gets an expert score-correction bias proportional to
the standardized log pick count of a real GLM-5.3-Flash layer (store/data), with the factor
bisected so that, for unit-variance router logits, the share of picks landing on the 11 % most
popular experts matches that real layer. The same counts are written to OUT/expert-stats.json
(`--expert-stats`, cache warm start). The tokenizer is the tiny models' one (vocabulary 512).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from safetensors.torch import save_file  # noqa: E402

from tiermoe.bench.records import random_records  # noqa: E402
from tiermoe.kernels.layout import expert_layout  # noqa: E402
from tiermoe.store.mixed import hot_experts  # noqa: E402
from tiermoe.store.planner import counts_for_model, load_stats  # noqa: E402
from tiermoe.store.records import EXPERTS_NAME, FORMAT_VERSION, RecordLayout, write_manifest  # noqa: E402

STATS = ROOT / "src" / "tiermoe" / "store" / "data" / "glm53-flash-decode-expert-counts.json"
SHARD_BYTES = 2 << 30


def glm_config(base: dict, a) -> dict:
    cfg = dict(base)
    cfg.update(hidden_size=a.hidden, moe_intermediate_size=a.inter, n_routed_experts=a.experts,
               num_experts_per_tok=a.top_k, n_shared_experts=1, n_group=1, topk_group=1,
               first_k_dense_replace=1, num_hidden_layers=1 + a.moe_layers, intermediate_size=a.dense_inter,
               num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.hidden // a.heads,
               max_position_embeddings=a.max_position,
               dtype="bfloat16")
    return cfg


def real_counts(n_layers: int, experts: int) -> list[np.ndarray]:
    """Pick counts of n_layers real layers, spread over the 42 measured ones (the mapping
    `--routing-replay` uses too)."""
    return counts_for_model(load_stats(STATS), n_layers, experts)


def calibrated_bias(counts: np.ndarray, top_k: int, share: float, rng: np.random.Generator) -> np.ndarray:
    """Score-correction bias [E] making the top `share` of experts (by count) take the same
    fraction of picks as in `counts`, for router logits ~ N(0, 1)."""
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
        picks = np.argpartition(-(scores + beta * z), top_k, axis=1)[:, :top_k]
        return float(is_hot[picks].mean())

    lo, hi = 0.0, 4.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if coverage(mid) < target else (lo, mid)
    return (lo + hi) / 2 * z


def dense_tensors(cfg: dict, biases: list[np.ndarray], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Every non-routed-expert tensor of the model, random, bf16 (names as transformers saves them)."""
    import transformers

    fields = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")}
    with torch.device("meta"):
        model = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**fields))
    out = {}
    for name, t in model.state_dict().items():
        if ".mlp.experts." in name:
            continue  # routed experts live in experts.bin
        shape = tuple(t.shape)
        if name.endswith("e_score_correction_bias"):
            layer = int(name.split(".")[2])
            v = torch.from_numpy(biases[layer - 1]).float()
        elif len(shape) >= 2:
            std = 1.0 if "embed_tokens" in name else 1.0 / math.sqrt(shape[-1])
            v = torch.randn(shape, generator=gen) * std
        elif "norm" in name:
            v = 1.0 + 0.05 * torch.randn(shape, generator=gen)
        else:
            v = 0.02 * torch.randn(shape, generator=gen)
        out[name] = v.to(torch.bfloat16).contiguous()
    return out


def write_dense(out: Path, tensors: dict[str, torch.Tensor]) -> dict:
    groups, cur, size = [], [], 0
    for k in sorted(tensors):
        nb = tensors[k].numel() * 2
        if cur and size + nb > SHARD_BYTES:
            groups.append(cur)
            cur, size = [], 0
        cur.append(k)
        size += nb
    groups.append(cur)
    weight_map, names = {}, []
    for n, keys in enumerate(groups, 1):
        name = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k] for k in keys}, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in keys})
        names.append(name)
    total = sum(t.numel() * 2 for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    return {"index": "model.safetensors.index.json", "shards": names, "tensors": len(weight_map)}


def write_experts(out: Path, a, layers: list[int], counts: list[np.ndarray], device: torch.device,
                  log) -> tuple[list[RecordLayout], list[dict]]:
    """experts.bin: layer-major, expert-minor random records at their own lengths; returns (layouts,
    manifest records). A mixed store's layer keeps its most-picked experts (by `counts`) in layout 0."""
    kinds = [(a.kind, a.group)] + ([(a.cold_kind, a.cold_group)] if a.cold_kind else [])
    layouts, klays = [], []
    for kind, group in kinds:
        layouts.append(RecordLayout.build(kind, a.hidden, a.inter, group if kind != "bf16" else None))
        klays.append(expert_layout(kind, a.hidden, a.inter, group))
        assert klays[-1].length == layouts[-1].length
    gen = torch.Generator(device=device).manual_seed(a.seed)
    records, offset = [], 0
    chunk = max(1, (512 << 20) // max(lay.length for lay in layouts))  # records per write (~512 MiB)
    with open(out / EXPERTS_NAME, "wb") as f, ThreadPoolExecutor(16) as pool:
        for layer, c in zip(layers, counts):
            hot = hot_experts(c.tolist(), a.mixed_share) if a.cold_kind else set(range(a.experts))
            which = [0 if e in hot else 1 for e in range(a.experts)]
            for e0 in range(0, a.experts, chunk):
                n = min(chunk, a.experts - e0)
                bufs = [random_records(k, n, device, gen).cpu().numpy() for k in klays]  # per kind [n, R_k]
                rows = [bufs[which[e0 + j]][j] for j in range(n)]
                hashes = [pool.submit(lambda b: hashlib.sha256(b).hexdigest(), r) for r in rows]
                for j, (r, h) in enumerate(zip(rows, hashes)):
                    f.write(memoryview(r).cast("B"))
                    records.append({"layer": layer, "expert": e0 + j, "offset": offset, "length": r.size,
                                    "sha256": h.result(), "layout": which[e0 + j]})
                    offset += r.size
            n_cold = which.count(1)
            log(f"layer {layer}: {a.experts - n_cold} records of {layouts[0].length / 2**20:.2f} MiB"
                + (f", {n_cold} of {layouts[1].length / 2**20:.2f} MiB" if n_cold else ""))
    return layouts, records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--moe-layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=288)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=2048, help="routed (and shared) expert intermediate size")
    p.add_argument("--dense-inter", type=int, default=10944, help="intermediate size of the first, dense layer")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument(
        "--max-position",
        type=int,
        default=20480,
        help="context length of the model (the benchmarks' 4k and 16k prompts must fit)",
    )
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--kind", choices=("int4", "int8", "int3", "bf16"), default="int4")
    p.add_argument("--cold-kind", choices=("int4", "int8", "int3", "bf16"), default=None,
                   help="a mixed store: the experts outside --mixed-share of each layer's picks in this kind")
    p.add_argument("--cold-group", type=int, default=64, help="--cold-kind's group size")
    p.add_argument("--mixed-share", type=float, default=0.6, help="pick share kept at --kind (pack's --hot-share)")
    p.add_argument("--hot-share", type=float, default=0.11, help="expert share whose pick share the bias matches")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where records are drawn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tiny", action="store_true", help="tiny shapes (H 64, I 32, 16 experts, top-4, G 32) for a CPU check"
    )
    a = p.parse_args(argv)
    if a.tiny:
        a.hidden, a.inter, a.dense_inter, a.experts, a.top_k, a.group, a.heads, a.kv_heads = (
            64,
            32,
            128,
            16,
            4,
            32,
            4,
            2,
        )
        a.cold_group = min(a.cold_group, a.group)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)
    log = lambda s: print(s, flush=True)  # noqa: E731
    from tiermoe.models.tiny import write_tiny

    with tempfile.TemporaryDirectory() as tmp:  # tokenizer, chat template and config template
        tiny = write_tiny("glm4_moe", Path(tmp) / "t", dtype="bfloat16")
        base = json.loads((tiny / "config.json").read_text())
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
            if (tiny / f).exists():
                shutil.copyfile(tiny / f, out / f)
    cfg = glm_config(base, a)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    layers = list(range(1, 1 + a.moe_layers))
    counts = real_counts(a.moe_layers, a.experts)
    rng = np.random.default_rng(a.seed)
    biases = [calibrated_bias(c, a.top_k, a.hot_share, rng) for c in counts]
    (out / "expert-stats.json").write_text(
        json.dumps({f"model.layers.{L}.mlp": c.tolist() for L, c in zip(layers, counts)})
    )
    dense = write_dense(out, dense_tensors(cfg, biases, torch.Generator().manual_seed(a.seed)))
    log(f"dense: {dense['tensors']} tensors in {len(dense['shards'])} shard(s)")
    layouts, records = write_experts(out, a, layers, counts, torch.device(a.device), log)
    layout = layouts[0]
    quantization = {"kind": a.kind, "group_size": layout.group_size}
    if a.cold_kind:
        quantization.update(cold_kind=a.cold_kind, cold_group_size=layouts[1].group_size, hot_share=a.mixed_share,
                            expert_stats="expert-stats.json",
                            records_per_layout=[sum(1 for r in records if r["layout"] == i) for i in (0, 1)])
    write_manifest(
        out,
        {
            "format_version": FORMAT_VERSION,
            "model_config": cfg,
            "quantization": quantization,
            "dtype": "bfloat16",
            "source_dtype": "bfloat16",
            "num_layers": 1 + a.moe_layers,
            "moe_layers": layers,
            "experts_per_layer": {str(L): a.experts for L in layers},
            "expert_prefixes": {str(L): f"model.layers.{L}.mlp.experts" for L in layers},
            "experts_file": EXPERTS_NAME,
            "record_align": 4096,
            "layouts": [lay.to_json() for lay in layouts],
            "records": records,
            "dense": dense,
        },
    )
    total = sum(r["length"] for r in records)
    log(
        json.dumps(
            {
                "store": str(out),
                "moe_layers": a.moe_layers,
                "experts": len(records),
                "record_bytes": max(lay.length for lay in layouts),
                "expert_gib": round(total / 2**30, 2),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
