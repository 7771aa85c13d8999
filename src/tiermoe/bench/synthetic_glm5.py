"""`tiermoe bench make-glm5 OUT`: a random GLM-5.3-Flash (`glm5_next`) packed store at full width.

The flagship's own layers (KDA linear attention, NoPE MLA with the DSA indexer, mHC
hyper-connections, dense and shared-expert MLPs, the MTP layer) at the real model's widths, with
3 dense layers and --moe-layers MoE layers instead of 42, so a GPU machine can measure them at
graph speed without the checkpoint. Written directly in the store format (synthetic_common.py,
shared with scripts/synth_glm_store.py): random valid int4 records, random fan-in-scaled bf16
dense weights drawn on --device, routers biased to the real per-layer pick skew and the real
counts in OUT/expert-stats.json.

The dense tensors' names and shapes are not listed here: they are read off the family's own
model skeleton (`Glm5NextModel` on the meta device) and mapped to checkpoint keys with the
loader's own key rules, and each value is drawn at the scale the tiny generator uses
(`tiny.init_value`), so the store cannot drift from what the loader expects.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from tiermoe.errors import UserError

PREFIX = "model.language_model."  # the hub checkpoint's key prefix (multimodal class)


@dataclass(frozen=True)
class Glm5Spec:
    """Widths of the synthetic model (defaults: GLM-5.3-Flash's own, field-digest.md) and store options."""

    moe_layers: int = 12
    dense_layers: int = 3
    hidden: int = 4096
    dense_intermediate: int = 12288
    moe_intermediate: int = 2048
    experts: int = 288
    top_k: int = 8
    vocab: int = 154880
    kda_heads: int = 64
    kda_head_dim: int = 128
    heads: int = 64  # MLA query heads: the config class's default (a guess: the digest does not state it)
    q_lora: int = 1536
    kv_lora: int = 512
    qk_head_dim: int = 256
    v_head_dim: int = 256
    index_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    index_kpool: int = 16  # the digest says 4 or 16 tokens; the config class's default
    hc_mult: int = 4
    mtp: bool = True
    max_position: int = 1048576
    kind: str = "int4"
    group: int = 128
    cold_kind: str | None = None
    cold_group: int = 64
    mixed_share: float = 0.6
    hot_share: float = 0.11
    seed: int = 0


# Reduced widths for a CPU check in seconds (the tiny glm5_next's attention widths, 32 experts).
SMALL = dict(hidden=64, dense_intermediate=128, moe_intermediate=32, experts=32, top_k=4, vocab=1024,
             kda_heads=4, kda_head_dim=16, heads=4, q_lora=48, kv_lora=32, qk_head_dim=16, v_head_dim=16,
             index_heads=16, index_head_dim=16, index_topk=8, index_kpool=4, max_position=4096, group=32)


def check(spec: Glm5Spec) -> None:
    """One-line UserError for a shape the store or the model cannot take."""
    from tiermoe.bench.synthetic_common import KINDS

    for f in fields(spec):
        if f.type == "int" and f.name not in ("seed", "dense_layers") and getattr(spec, f.name) <= 0:
            raise UserError(f"--{f.name.replace('_', '-')} must be positive")
    if spec.dense_layers < 0:
        raise UserError("--dense-layers must not be negative")
    if spec.top_k > spec.experts:
        raise UserError(f"--top-k {spec.top_k} exceeds --experts {spec.experts}")
    for kind, group, flag in ((spec.kind, spec.group, "--group"), (spec.cold_kind, spec.cold_group, "--cold-group")):
        if kind is not None and kind not in KINDS:
            raise UserError(f"kind {kind!r}: choose one of {', '.join(KINDS)}")
        if kind not in (None, "bf16") and (group <= 0 or spec.hidden % group or spec.moe_intermediate % group):
            raise UserError(f"{flag} {group}: must divide --hidden {spec.hidden} and --moe-intermediate "
                            f"{spec.moe_intermediate}")
    if spec.index_topk % spec.index_kpool:
        raise UserError(f"index_topk {spec.index_topk} must be a multiple of index_kpool {spec.index_kpool}")
    if not 0.0 < spec.hot_share < 1.0 or not 0.0 < spec.mixed_share <= 1.0:
        raise UserError("--hot-share must be in (0, 1) and --mixed-share in (0, 1]")


def text_config(spec: Glm5Spec, pad_id: int | None = None, eos_id: int | None = None) -> dict:
    """The text_config of config.json: the family's defaults (the real model's) with the spec's
    widths, 3 dense + N MoE layers, and the per-layer schedules derived as transformers does."""
    from tiermoe.models.glm5_next.config import Glm5NextConfig

    n = spec.dense_layers + spec.moe_layers
    text = dict(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.dense_intermediate,
        moe_intermediate_size=spec.moe_intermediate, num_hidden_layers=n, num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads, n_routed_experts=spec.experts, num_experts_per_tok=spec.top_k,
        q_lora_rank=spec.q_lora, kv_lora_rank=spec.kv_lora, qk_nope_head_dim=spec.qk_head_dim, qk_rope_head_dim=0,
        v_head_dim=spec.v_head_dim, index_n_heads=spec.index_heads, index_head_dim=spec.index_head_dim,
        index_topk=spec.index_topk, index_kpool=spec.index_kpool, linear_num_heads=spec.kda_heads,
        linear_head_dim=spec.kda_head_dim, hc_mult=spec.hc_mult, max_position_embeddings=spec.max_position,
        mlp_layer_types=["dense"] * spec.dense_layers + ["sparse"] * spec.moe_layers,
        num_nextn_predict_layers=int(spec.mtp), pad_token_id=pad_id, eos_token_id=eos_id,
    )
    cfg = Glm5NextConfig.from_dict(text, "make-glm5")  # fills layer_types / indexer_types, validates
    out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()}
    out.update(model_type="glm5_next_text", qk_head_dim=spec.qk_head_dim, num_key_value_heads=spec.heads,
               dtype="bfloat16")
    return out


def hf_config(spec: Glm5Spec, tok) -> dict:
    """config.json in the hub's multimodal layout (transformers' Glm5NextConfig; the vision tower's
    fields are its defaults and its weights are not written: the text path never reads them)."""
    from transformers import Glm5NextConfig as HFConfig

    text = text_config(spec, tok.pad_token_id, tok.eos_token_id)
    hf = HFConfig(text_config={k: v for k, v in text.items() if k != "num_nextn_predict_layers"},
                  tie_word_embeddings=False).to_dict()
    hf["text_config"]["num_nextn_predict_layers"] = text["num_nextn_predict_layers"]  # not a transformers field
    hf.update(architectures=["Glm5NextForConditionalGeneration"], dtype="bfloat16")
    return hf


def model_config(spec: Glm5Spec):
    from tiermoe.models.glm5_next.config import Glm5NextConfig

    return Glm5NextConfig.from_dict(text_config(spec), "make-glm5")


def dense_plan(cfg) -> list[tuple[str, str, tuple]]:
    """(parameter name, checkpoint key, shape) of every non-routed-expert tensor, from the model
    skeleton: the loader's key rules (hub renames, MTP as layer num_hidden_layers, split conv)."""
    import re

    import torch

    from tiermoe.models.glm5_next.loader import layer_key_candidates
    from tiermoe.models.glm5_next.model import Glm5NextModel

    with torch.device("meta"):
        model = Glm5NextModel(cfg, with_mtp=cfg.num_nextn_predict_layers > 0)
    plan = []
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        if name == "lm_head.weight":
            plan.append((name, name, shape))
            continue
        if name in ("embed_tokens.weight", "norm.weight"):
            plan.append((name, PREFIX + name, shape))
            continue
        m = re.match(r"^(?:layers\.(\d+)|mtp)\.(.+)$", name)
        layer, rest = (int(m.group(1)) if m.group(1) else cfg.mtp_layer_idx), m.group(2)
        if rest == "self_attn.conv1d.weight":  # the hub splits the fused [3C, 1, K] conv into q, k, v
            c = shape[0] // 3
            for part in "qkv":
                plan.append((name, f"{PREFIX}layers.{layer}.self_attn.{part}_conv1d.weight", (c, *shape[1:])))
            continue
        plan.append((name, layer_key_candidates(PREFIX, layer, rest)[0], shape))
    return plan


def _is_bias(name: str) -> bool:
    return name.endswith("e_score_correction_bias")


def sizes(spec: Glm5Spec) -> dict:
    """What make-glm5 writes, in bytes, from the skeleton alone (nothing allocated or written);
    a mixed store's expert bytes are the upper bound with every record at --kind."""
    cfg = model_config(spec)
    plan = dense_plan(cfg)
    dense = sum((4 if _is_bias(n) else 2) * _numel(s) for n, _, s in plan)
    record = _shape(spec).layouts()[0].length  # --kind's record (a mixed store's cold ones are smaller)
    n_moe = len(cfg.moe_layers())
    experts = n_moe * spec.experts * record
    return {"layers": cfg.num_hidden_layers, "moe_layers": n_moe, "mtp": spec.mtp, "record_bytes": record,
            "expert_records": n_moe * spec.experts, "expert_bytes": experts, "expert_gib": round(experts / 2**30, 2),
            "dense_tensors": len(plan), "dense_bytes": dense, "dense_gib": round(dense / 2**30, 2),
            "total_gib": round((experts + dense) / 2**30, 2)}


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _shape(spec: Glm5Spec):
    from tiermoe.bench.synthetic_common import ExpertShape

    return ExpertShape(spec.hidden, spec.moe_intermediate, spec.experts, spec.kind, spec.group, spec.cold_kind,
                       spec.cold_group, spec.mixed_share, spec.seed)


def dense_tensors(cfg, spec: Glm5Spec, biases: dict, silenced: list[int], device):
    """Yield (checkpoint key, tensor) for every dense tensor: drawn on `device` at the tiny
    generator's scales, bf16 on the CPU; the routers' correction bias is the calibrated one
    (fp32, so the calibration is not rounded away). LM-head rows of silenced ids and of ids the
    tokenizer cannot produce are zero, so greedy streams neither stop early nor emit nothing."""
    import torch

    from tiermoe.models.glm5_next.tiny import init_value

    gen = torch.Generator(device=device).manual_seed(spec.seed)
    for name, key, shape in dense_plan(cfg):
        if _is_bias(name):
            layer = cfg.mtp_layer_idx if name.startswith("mtp.") else int(name.split(".")[1])
            yield key, torch.from_numpy(biases[layer]).float()
            continue
        with torch.device(device):
            v = init_value(name, torch.empty(shape, device="meta"), gen)  # [shape] fp32 on device
        if name == "lm_head.weight":
            v[silenced] = 0
        yield key, v.to(torch.bfloat16).cpu().contiguous()


def make_glm5(out: str | Path, spec: Glm5Spec, device: str = "auto", force: bool = False, log=print) -> dict:
    """Write the store under `out`; returns the summary (also OUT/synthetic-glm5.json)."""
    from tiermoe.bench import synthetic_common as common
    from tiermoe.bench.synthetic_qwen3 import _resolve_device, silenced_tokens
    from tiermoe.models.tiny_tokenizer import build_tokenizer

    check(spec)
    out = Path(out)
    if (out / "manifest.json").exists() and not force:
        raise UserError(f"{out}: holds a store already (use --force to replace it)")
    dev = _resolve_device(device)
    t0 = time.monotonic()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file in the way, no permission, a read-only filesystem
        raise UserError(f"{out}: cannot create the store directory ({exc.strerror or exc})") from None
    (out / "manifest.json").unlink(missing_ok=True)
    tok = build_tokenizer()
    tok.save_pretrained(str(out))
    config = hf_config(spec, tok)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    gen_cfg = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=1) + "\n")
    cfg = model_config(spec)
    layers = cfg.moe_layers()  # trunk MoE layers, then the MTP layer
    trunk = [L for L in layers if L < cfg.num_hidden_layers]
    counts = common.real_counts(len(trunk), spec.experts)
    counts += [counts[-1]] * (len(layers) - len(trunk))  # the MTP layer: the last layer's skew (a guess)
    counts, biases = common.routing(layers, spec.experts, spec.top_k, spec.hot_share, spec.seed, counts)
    common.write_stats(out, layers, counts)
    silenced = sorted(set(silenced_tokens(tok)) | set(range(len(tok), spec.vocab)))
    silenced = [i for i in silenced if i < spec.vocab]
    dense = common.write_dense(out, dense_tensors(cfg, spec, dict(zip(layers, biases)), silenced, dev))
    log(f"dense: {dense['tensors']} tensors in {len(dense['shards'])} shard(s) ({time.monotonic() - t0:.0f} s)")
    layouts, records = common.write_experts(out, _shape(spec), layers, counts, dev, log)
    summary = common.write_store_manifest(out, config, _shape(spec), cfg.num_hidden_layers, layers,
                                          f"{PREFIX}layers.", layouts, records, dense)
    summary.update(spec=asdict(spec), device=dev.type, seconds=round(time.monotonic() - t0, 1),
                   routing_stats=common.STATS_NAME)
    (out / "synthetic-glm5.json").write_text(json.dumps(summary, indent=1) + "\n")
    log(json.dumps({k: v for k, v in summary.items() if k != "spec"}))
    return summary


# ----------------------------------------------------------------------------- CLI
_REAL = ("real (GLM-5.3-Flash, field-digest.md): hidden 4096, dense intermediate 12288, 3 dense layers, 288 routed "
         "experts of intermediate 2048 + 1 shared, top-8, vocab 154880, KDA 64 heads x 128 (conv 4), MLA q_lora "
         "1536 / kv_lora 512 / qk 256 / v 256 (NoPE) on every 4th layer, DSA 32 heads x 128 top-2048, mHC 4 "
         "streams (Sinkhorn 20), one MTP layer, routed scaling 2.5, swiglu limit 10. Guesses (the config class's "
         "defaults, unstated in the digest): 64 MLA heads, k-pool 16, every indexer 'full'. Not the model's: "
         "3 + --moe-layers layers instead of 45, the tiny 512-token tokenizer (LM-head rows it cannot produce are "
         "zero), no vision tower, random weights, the MTP layer routed with the last layer's real skew.")


def register(sub) -> None:
    d = Glm5Spec()
    p = sub.add_parser("make-glm5", help="random-weight GLM-5.3-Flash (glm5_next) store at full width, written "
                       "directly (int4 G128 records, real routing statistics beside it)", description=_REAL)
    p.add_argument("out", help="output store directory (manifest.json, experts.bin, shards, expert-stats.json)")
    p.add_argument("--moe-layers", type=int, default=d.moe_layers, help="MoE layers after the dense ones (real: 42)")
    p.add_argument("--dense-layers", type=int, default=d.dense_layers, help="dense-MLP layers first (real: 3)")
    p.add_argument("--mtp", action=argparse.BooleanOptionalAction, default=True,
                   help="write the MTP layer (real: one); --no-mtp leaves it out")
    p.add_argument("--hidden", type=int, default=None, help=f"hidden size (real: {d.hidden})")
    p.add_argument("--experts", type=int, default=None, help=f"routed experts per layer (real: {d.experts})")
    p.add_argument("--moe-intermediate", type=int, default=None,
                   help=f"expert intermediate (real: {d.moe_intermediate})")
    p.add_argument("--dense-intermediate", type=int, default=None,
                   help=f"dense MLP intermediate (real: {d.dense_intermediate})")
    p.add_argument("--top-k", type=int, default=None, help=f"routed experts per token (real: {d.top_k})")
    p.add_argument("--vocab", type=int, default=None, help=f"embedding and LM-head rows (real: {d.vocab})")
    p.add_argument("--max-position", type=int, default=None, help=f"context length (real: {d.max_position})")
    p.add_argument("--small", action="store_true", help="reduced widths for a CPU check in seconds (hidden 64, 32 "
                   "experts of 32, top-4, vocab 1024, the tiny model's attention widths, group 32); flags still win")
    p.add_argument("--kind", default=d.kind, help="expert record kind: int4 (default), int3, int8, bf16")
    p.add_argument("--group", type=int, default=None, help=f"--kind's group size (default {d.group})")
    p.add_argument("--cold-kind", default=None, help="a mixed store: experts outside --mixed-share in this kind")
    p.add_argument("--cold-group", type=int, default=d.cold_group, help="--cold-kind's group size")
    p.add_argument("--mixed-share", type=float, default=d.mixed_share, help="pick share kept at --kind")
    p.add_argument("--hot-share", type=float, default=d.hot_share,
                   help="expert share whose pick share the bias matches")
    p.add_argument("--device", default="auto", help="where weights and records are drawn: auto (cuda if any), cpu")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the random weights")
    p.add_argument("--force", action="store_true", help="replace a store already in OUT")
    p.add_argument("--sizes-only", action="store_true", help="print the sizes as JSON and write nothing")
    p.set_defaults(handler=_run_make)


def spec_from_args(a) -> Glm5Spec:
    base = {**asdict(Glm5Spec()), **(SMALL if a.small else {})}
    for name in ("hidden", "experts", "moe_intermediate", "dense_intermediate", "top_k", "vocab", "max_position",
                 "group"):
        if getattr(a, name) is not None:
            base[name] = getattr(a, name)
    base.update(moe_layers=a.moe_layers, dense_layers=a.dense_layers, mtp=a.mtp, kind=a.kind,
                cold_kind=a.cold_kind, cold_group=a.cold_group, mixed_share=a.mixed_share, hot_share=a.hot_share,
                seed=a.seed)
    spec = Glm5Spec(**base)
    check(spec)
    return spec


def _run_make(args) -> int:
    spec = spec_from_args(args)
    if args.sizes_only:
        print(json.dumps(sizes(spec), indent=1))
        return 0
    make_glm5(args.out, spec, device=args.device, force=args.force)
    return 0
