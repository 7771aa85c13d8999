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
The store writing (routing calibration, records, shards, manifest) is shared with `tiermoe bench
make-glm5`, the glm5_next architecture itself: src/tiermoe/bench/synthetic_common.py.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from tiermoe.bench.synthetic_common import (  # noqa: E402
    ExpertShape,
    routing,
    write_dense,
    write_experts,
    write_stats,
    write_store_manifest,
)


def glm_config(base: dict, a) -> dict:
    cfg = dict(base)
    cfg.update(hidden_size=a.hidden, moe_intermediate_size=a.inter, n_routed_experts=a.experts,
               num_experts_per_tok=a.top_k, n_shared_experts=1, n_group=1, topk_group=1,
               first_k_dense_replace=1, num_hidden_layers=1 + a.moe_layers, intermediate_size=a.dense_inter,
               num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.hidden // a.heads,
               max_position_embeddings=a.max_position,
               dtype="bfloat16")
    return cfg


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
    counts, biases = routing(layers, a.experts, a.top_k, a.hot_share, a.seed)
    write_stats(out, layers, counts)
    tensors = dense_tensors(cfg, biases, torch.Generator().manual_seed(a.seed))
    dense = write_dense(out, sorted(tensors.items()))
    log(f"dense: {dense['tensors']} tensors in {len(dense['shards'])} shard(s)")
    shape = ExpertShape(a.hidden, a.inter, a.experts, a.kind, a.group, a.cold_kind, a.cold_group, a.mixed_share,
                        a.seed)
    layouts, records = write_experts(out, shape, layers, counts, torch.device(a.device), log)
    summary = write_store_manifest(out, cfg, shape, 1 + a.moe_layers, layers, "model.layers.", layouts, records,
                                   dense)
    log(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
