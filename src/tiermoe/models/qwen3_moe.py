"""Qwen3-MoE family (softmax top-k routing, GQA, RoPE, per-head q/k norm).

The same generic block covers checkpoints whose configs differ only in fields:
qwen2_moe (qkv bias, gated shared expert, no q/k norm), olmoe (full-width q/k norm,
clip_qkv) and mixtral (w1/w3/w2 expert names, no q/k norm).
"""

from __future__ import annotations

from tiermoe.models.families_common import ConfigReader
from tiermoe.models.spec import ModelSpec, MoESpec


def _moe_layers(r: ConfigReader, num_layers: int) -> tuple[int, ...]:
    mlp_only = set(r.get("mlp_only_layers") or [])
    step = r.get("decoder_sparse_step", 1) or 1
    n_exp = r.require("num_experts") if r.get("num_experts") is not None else r.require("num_local_experts")
    return tuple(i for i in range(num_layers) if i not in mlp_only and n_exp > 0 and (i + 1) % step == 0)


def build_spec(hf_config, path: str) -> ModelSpec:
    r = ConfigReader(hf_config, path)
    arch = hf_config.model_type
    if r.get("use_sliding_window"):
        raise r.unsupported("use_sliding_window", "sliding-window attention")
    r.rope_type()
    hidden, heads = r.require("hidden_size"), r.require("num_attention_heads")
    num_layers = r.require("num_hidden_layers")
    num_experts = r.get("num_experts") if r.get("num_experts") is not None else r.require("num_local_experts")
    head_dim = r.get("head_dim") or hidden // heads
    shared = 0
    qk_norm, qkv_bias, o_bias = "head", bool(r.get("attention_bias", False)), bool(r.get("attention_bias", False))
    moe_inter = r.get("moe_intermediate_size")
    norm_topk = bool(r.get("norm_topk_prob", False))
    mlp_name = "mlp"
    proj_names = ("gate_proj", "up_proj", "down_proj")
    if arch == "qwen2_moe":
        qk_norm, qkv_bias, o_bias = "none", bool(r.get("qkv_bias", True)), False
        shared = r.get("shared_expert_intermediate_size", 0) or 0
    elif arch == "olmoe":
        qk_norm = "full"
        moe_inter = r.require("intermediate_size")
    elif arch == "mixtral":
        qk_norm, qkv_bias, o_bias, norm_topk = "none", False, False, True
        moe_inter = r.require("intermediate_size")
        mlp_name = "block_sparse_moe"
        proj_names = ("w1", "w3", "w2")
    moe = MoESpec(
        num_experts=num_experts,
        top_k=r.require("num_experts_per_tok"),
        intermediate_size=moe_inter or r.require("moe_intermediate_size"),
        scoring="softmax",
        norm_topk_prob=norm_topk,
        shared_intermediate_size=shared,
        shared_expert_gated=bool(shared),
        shared_expert_name="shared_expert",
        fp32_combine_weights=arch == "mixtral",
    )
    return ModelSpec(
        arch=arch,
        hf_config=hf_config,
        vocab_size=r.require("vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        rms_norm_eps=r.get("rms_norm_eps", 1e-6),
        num_heads=heads,
        num_kv_heads=r.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=qk_norm,
        clip_qkv=r.get("clip_qkv"),
        rotary_cls=_rotary_cls(arch),
        dense_intermediate_size=r.get("intermediate_size") or 0,
        moe=moe,
        moe_layers=_moe_layers(r, num_layers),
        tie_word_embeddings=bool(r.get("tie_word_embeddings", False)),
        mlp_name=mlp_name,
        eos_token_ids=r.eos_ids(),
        max_position_embeddings=r.get("max_position_embeddings", 4096),
        expert_proj_names=proj_names,
    )


def _rotary_cls(arch: str):
    import importlib

    module = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    name = {"qwen3_moe": "Qwen3Moe", "qwen2_moe": "Qwen2Moe", "olmoe": "Olmoe", "mixtral": "Mixtral"}[arch]
    return getattr(module, f"{name}RotaryEmbedding")
