"""Per-architecture GGUF tensor maps and config builders.

Each converter reads a `GGUFFile`, streams HF-named tensors into a `ShardWriter` and returns
the config.json dict. It must consume every tensor of the file: an unknown tensor (say a
llama-3.1 `rope_freqs.weight`, which encodes a RoPE scaling we do not reproduce) is an error
that names it, rather than a silently wrong model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tiermoe.errors import UserError
from tiermoe.importers import moeify
from tiermoe.importers.gguf import GGUFFile, unpermute_qk
from tiermoe.importers.writer import ShardWriter


@dataclass
class ConversionResult:
    config: dict
    provenance: dict = field(default_factory=dict)
    # Called with (checkpoint dir, provenance) once config and tokenizer are written.
    finish: Callable[[Path, dict], None] | None = None


@dataclass(frozen=True)
class _Common:
    """Hyper-parameters shared by every family, read from `{arch}.*` fields."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int
    rms_eps: float
    rope_theta: float
    tied: bool

    def config_fields(self) -> dict:
        return {
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.context,
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": 1.0},
            "tie_word_embeddings": self.tied,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
        }


def _common(g: GGUFFile) -> _Common:
    scaling = g.arch_get("rope.scaling.type", "none")
    if scaling not in ("none", "", None):
        raise UserError(f"{g.path}: GGUF field '{g.arch}.rope.scaling.type' = '{scaling}' is not supported")
    hidden = g.arch_int("embedding_length")
    heads = g.arch_int("attention.head_count")
    head_dim = g.arch_int("attention.key_length", hidden // heads)
    if g.arch_int("attention.value_length", head_dim) != head_dim:
        raise UserError(f"{g.path}: GGUF field '{g.arch}.attention.value_length' differs from key_length")
    rot = g.arch_int("rope.dimension_count", head_dim)
    if rot != head_dim:
        raise UserError(f"{g.path}: GGUF field '{g.arch}.rope.dimension_count' = {rot} (partial RoPE) unsupported")
    embd = g._tensors["token_embd.weight"] if g.has_tensor("token_embd.weight") else None
    if embd is None:
        raise UserError(f"{g.path}: GGUF tensor 'token_embd.weight' is missing")
    vocab = int(embd.shape[-1])  # ggml dims: [H, V]
    return _Common(
        layers=g.arch_int("block_count"),
        hidden=hidden,
        heads=heads,
        kv_heads=g.arch_int("attention.head_count_kv", heads),
        head_dim=head_dim,
        vocab=vocab,
        context=g.arch_int("context_length", 4096),
        rms_eps=float(g.arch_get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(g.arch_get("rope.freq_base", 10000.0)),
        tied=not g.has_tensor("output.weight"),
    )


def _attention(g: GGUFFile, w: ShardWriter, c: _Common, i: int, cast, *, permute: bool, qk_norm: bool) -> bool:
    """Write one layer's attention and norms; returns whether it has q/k/v biases."""
    src, dst = f"blk.{i}", f"model.layers.{i}"
    for proj, name in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v")):
        n_head = c.heads if proj == "q" else c.kv_heads
        for kind in ("weight", "bias"):
            key = f"{src}.{name}.{kind}"
            if kind == "bias" and not g.has_tensor(key):
                continue
            t = g.tensor(key)
            if permute and proj in "qk":
                t = unpermute_qk(t, n_head)
            w.add(f"{dst}.self_attn.{proj}_proj.{kind}", cast(t))
    has_bias = g.has_tensor(f"{src}.attn_q.bias")
    w.add(f"{dst}.self_attn.o_proj.weight", cast(g.tensor(f"{src}.attn_output.weight")))
    if qk_norm:
        w.add(f"{dst}.self_attn.q_norm.weight", cast(g.tensor(f"{src}.attn_q_norm.weight")))
        w.add(f"{dst}.self_attn.k_norm.weight", cast(g.tensor(f"{src}.attn_k_norm.weight")))
    w.add(f"{dst}.input_layernorm.weight", cast(g.tensor(f"{src}.attn_norm.weight")))
    w.add(f"{dst}.post_attention_layernorm.weight", cast(g.tensor(f"{src}.ffn_norm.weight")))
    return has_bias


def _embeddings(g: GGUFFile, w: ShardWriter, c: _Common, cast) -> None:
    w.add("model.embed_tokens.weight", cast(g.tensor("token_embd.weight")))  # [V, H]
    w.add("model.norm.weight", cast(g.tensor("output_norm.weight")))
    if not c.tied:
        w.add("lm_head.weight", cast(g.tensor("output.weight")))


def _check_all_used(g: GGUFFile) -> None:
    left = g.unused_tensors()
    if left:
        more = f" (+{len(left) - 3} more)" if len(left) > 3 else ""
        raise UserError(f"{g.path}: GGUF tensors not understood for '{g.arch}': {', '.join(left[:3])}{more}")


def convert_dense(
    g: GGUFFile,
    out: Path,
    *,
    torch_dtype: torch.dtype,
    experts_per_layer: int,
    top_k: int | None,
    shared_slices: int | None,
) -> ConversionResult:
    """Dense llama / qwen2 / qwen3 -> glm4_moe whose experts are slices of each dense MLP."""
    if g.has_tensor("blk.0.ffn_gate_exps.weight") or g.arch_int("expert_count", 0):
        raise UserError(f"{g.path}: GGUF field '{g.arch}.expert_count' is set; MoE '{g.arch}' files are unsupported")
    c = _common(g)
    qk_norm = g.has_tensor("blk.0.attn_q_norm.weight")
    plan = moeify.plan_experts(
        g.arch_int("feed_forward_length"), experts_per_layer, top_k, shared_slices, source=str(g.path)
    )
    w = ShardWriter(out)
    cast = lambda t: t.to(torch_dtype)  # noqa: E731
    _embeddings(g, w, c, cast)
    routers: dict[str, torch.Tensor] = {}
    has_bias = False
    for i in range(c.layers):
        has_bias |= _attention(g, w, c, i, cast, permute=g.arch == "llama", qk_norm=qk_norm)
        src, prefix = f"blk.{i}", f"model.layers.{i}.mlp"
        gate = g.tensor(f"{src}.ffn_gate.weight")  # [I, H]
        up = g.tensor(f"{src}.ffn_up.weight")  # [I, H]
        down = g.tensor(f"{src}.ffn_down.weight")  # [H, I]
        for name, t in moeify.split_mlp(prefix, gate, up, down, plan).items():
            w.add(name, cast(t))
        routers.update(moeify.zero_router(prefix, c.hidden, plan))
    _check_all_used(g)
    # Routers (fp32) go into a shard of their own so calibration can rewrite just that file.
    w.flush()
    for name, t in routers.items():
        w.add(name, t)
    shards = w.close()
    config = {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        **c.config_fields(),
        "partial_rotary_factor": 1.0,
        "intermediate_size": plan.intermediate_size,
        "attention_bias": has_bias,
        "use_qk_norm": qk_norm,
        "num_nextn_predict_layers": 0,
        **moeify.glm4_moe_moe_fields(plan),
    }
    provenance = {
        "family": "glm4_moe",
        "moe_from_dense": {
            "experts_per_layer": plan.routed,
            "shared_slices": plan.shared_slices,
            "slice_size": plan.slice_size,
            "top_k": plan.top_k,
            "exact": plan.exact,
            "router": "zero (all experts, weight 1.0 each)" if plan.exact else "calibrated",
        },
    }
    finish = None
    if not plan.exact:
        from tiermoe.importers import router_fit

        router_shard = shards[-1]
        finish = lambda d, prov: router_fit.calibrate(d, router_shard.name, plan, prov)  # noqa: E731
    return ConversionResult(config=config, provenance=provenance, finish=finish)


def convert_qwen3moe(
    g: GGUFFile,
    out: Path,
    *,
    torch_dtype: torch.dtype,
    experts_per_layer: int,
    top_k: int | None,
    shared_slices: int | None,
) -> ConversionResult:
    """qwen3moe -> qwen3_moe: same model; stacked expert tensors become per-expert keys."""
    del experts_per_layer, shared_slices  # the file fixes its experts
    c = _common(g)
    n_exp = g.arch_int("expert_count")
    used = g.arch_int("expert_used_count")
    k = used if top_k is None else top_k
    if not 1 <= k <= n_exp:
        raise UserError(f"{g.path}: top_k must be in [1, {n_exp}] (got {k})")
    w = ShardWriter(out)
    cast = lambda t: t.to(torch_dtype)  # noqa: E731
    _embeddings(g, w, c, cast)
    for i in range(c.layers):
        if _attention(g, w, c, i, cast, permute=False, qk_norm=True):
            raise UserError(f"{g.path}: GGUF tensor 'blk.{i}.attn_q.bias' is unexpected for qwen3moe")
        src, prefix = f"blk.{i}", f"model.layers.{i}.mlp"
        w.add(f"{prefix}.gate.weight", cast(g.tensor(f"{src}.ffn_gate_inp.weight")))  # [E, H]
        stacks = {p: g.tensor(f"{src}.ffn_{p}_exps.weight") for p in ("gate", "up", "down")}  # [E, I, H] / [E, H, I]
        for e in range(n_exp):
            for p, t in stacks.items():
                w.add(f"{prefix}.experts.{e}.{p}_proj.weight", cast(t[e]))
    _check_all_used(g)
    w.close()
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **c.config_fields(),
        "intermediate_size": g.arch_int("feed_forward_length", 0) or g.arch_int("expert_feed_forward_length"),
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": g.arch_int("expert_feed_forward_length"),
        "num_experts": n_exp,
        "num_experts_per_tok": k,
        "norm_topk_prob": True,
    }
    return ConversionResult(config=config, provenance={"family": "qwen3_moe", "top_k": k, "file_top_k": used})


CONVERTERS: dict[str, Callable[..., ConversionResult]] = {
    "llama": convert_dense,
    "qwen2": convert_dense,
    "qwen3": convert_dense,
    "qwen3moe": convert_qwen3moe,
}
