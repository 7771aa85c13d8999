"""GLM-4.5 / 4.6 / 4.7 family: sigmoid noaux_tc routing with score-correction bias,
routed_scaling_factor, a shared expert, the first k layers dense, partial RoPE, optional
q/k norm and qkv bias."""

from __future__ import annotations

from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding

from tiermoe.models.families_common import ConfigReader, sigmoid_noaux_moe
from tiermoe.models.spec import ModelSpec


def build_spec(hf_config, path: str) -> ModelSpec:
    r = ConfigReader(hf_config, path)
    r.rope_type()
    hidden, heads = r.require("hidden_size"), r.require("num_attention_heads")
    num_layers = r.require("num_hidden_layers")
    moe = sigmoid_noaux_moe(r)
    first_dense = r.get("first_k_dense_replace", 0) or 0
    return ModelSpec(
        arch="glm4_moe",
        hf_config=hf_config,
        vocab_size=r.require("vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        rms_norm_eps=r.get("rms_norm_eps", 1e-5),
        num_heads=heads,
        num_kv_heads=r.get("num_key_value_heads") or heads,
        head_dim=r.get("head_dim") or hidden // heads,
        qkv_bias=bool(r.get("attention_bias", False)),
        qk_norm="head" if r.get("use_qk_norm", False) else "none",
        rotary_cls=Glm4MoeRotaryEmbedding,
        dense_intermediate_size=r.require("intermediate_size"),
        moe=moe,
        moe_layers=tuple(range(first_dense, num_layers)),
        tie_word_embeddings=bool(r.get("tie_word_embeddings", False)),
        eos_token_ids=r.eos_ids(),
        max_position_embeddings=r.get("max_position_embeddings", 4096),
    )
