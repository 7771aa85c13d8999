"""DeepSeek-V3 family: multi-head latent attention (latent KV cache) + sigmoid noaux_tc MoE
with group-limited routing, shared experts and the first k layers dense."""

from __future__ import annotations

import math

from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

from tiermoe.models.families_common import ConfigReader, sigmoid_noaux_moe
from tiermoe.models.spec import MLASpec, ModelSpec


def yarn_softmax_scale(rope_parameters: dict, scale: float) -> float:
    """DeepSeek's softmax scale under YaRN: scale * mscale(factor, mscale_all_dim) ** 2."""
    if rope_parameters.get("rope_type", "default") != "default":
        mscale_all_dim = rope_parameters.get("mscale_all_dim", 0)
        factor = rope_parameters.get("factor", 1.0)
        if mscale_all_dim and factor > 1:
            m = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale = scale * m * m
    return scale


def build_spec(hf_config, path: str) -> ModelSpec:
    r = ConfigReader(hf_config, path)
    r.rope_type()
    for name, allowed in (("topk_method", ("noaux_tc", None)), ("scoring_func", ("sigmoid", None))):
        if r.get(name) not in allowed:
            raise r.unsupported(name, f"expected {allowed[0]}")
    num_layers = r.require("num_hidden_layers")
    mla = MLASpec(
        q_lora_rank=r.get("q_lora_rank"),
        kv_lora_rank=r.require("kv_lora_rank"),
        qk_nope_head_dim=r.require("qk_nope_head_dim"),
        qk_rope_head_dim=r.require("qk_rope_head_dim"),
        v_head_dim=r.require("v_head_dim"),
        rope_interleave=bool(r.get("rope_interleave", True)),
    )
    qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    moe = sigmoid_noaux_moe(r)
    first_dense = r.get("first_k_dense_replace", 0) or 0
    heads = r.require("num_attention_heads")
    return ModelSpec(
        arch="deepseek_v3",
        hf_config=hf_config,
        vocab_size=r.require("vocab_size"),
        hidden_size=r.require("hidden_size"),
        num_layers=num_layers,
        rms_norm_eps=r.get("rms_norm_eps", 1e-6),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=qk_head_dim,
        attention="mla",
        qkv_bias=bool(r.get("attention_bias", False)),
        o_bias=bool(r.get("attention_bias", False)),
        mla=mla,
        attn_scale=yarn_softmax_scale(hf_config.rope_parameters or {}, qk_head_dim**-0.5),
        rotary_cls=DeepseekV3RotaryEmbedding,
        dense_intermediate_size=r.require("intermediate_size"),
        moe=moe,
        moe_layers=tuple(range(first_dense, num_layers)),
        tie_word_embeddings=bool(r.get("tie_word_embeddings", False)),
        eos_token_ids=r.eos_ids(),
        max_position_embeddings=r.get("max_position_embeddings", 4096),
    )
