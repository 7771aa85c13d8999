"""ModelSpec: everything the generic decoder needs to know about one checkpoint.

A family file (qwen3_moe.py, glm4_moe.py, ...) turns a Hugging Face config into a ModelSpec;
the decoder, loader and KV cache read only the spec. The HF config object itself rides along
(`hf_config`) so rotary embeddings are computed by transformers' own code for every rope type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek V2/V3) dimensions."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool


@dataclass(frozen=True)
class MoESpec:
    """Routed experts of one MoE layer kind (all MoE layers of a model share it)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    scoring: str  # "softmax" | "sigmoid_noaux"
    norm_topk_prob: bool
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gated: bool = False  # qwen2_moe: sigmoid(shared_expert_gate(x)) * shared(x)
    shared_expert_name: str = "shared_experts"  # checkpoint module name of the shared expert
    swiglu_limit: float | None = None
    fp32_combine_weights: bool = False  # softmax routers: keep combine weights fp32 (mixtral) or cast


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    hf_config: Any
    vocab_size: int
    hidden_size: int
    num_layers: int
    rms_norm_eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention: str = "gqa"  # "gqa" | "mla"
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str = "none"  # "none" | "head" (per head, qwen3/glm4) | "full" (whole projection, olmoe)
    clip_qkv: float | None = None
    mla: MLASpec | None = None
    attn_scale: float | None = None  # None: head_dim ** -0.5
    rotary_cls: Callable | None = None  # transformers' RotaryEmbedding class of the family
    rope_interleave: bool = False
    dense_intermediate_size: int = 0
    moe: MoESpec | None = None
    moe_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    mlp_name: str = "mlp"  # checkpoint module name of the feed-forward block
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 4096
    expert_proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # mixtral: w1, w3, w2
    recurrent_state: bool = False  # per-sequence recurrent state (KDA): a cached prefix cannot be resumed
    prefill_chunk_multiple: int = 1  # prefill chunks end on multiples of this (KDA's blocks)

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def expert_keys(self, layer: int, expert: int) -> tuple[str, str, str]:
        """Checkpoint keys (gate, up, down) of one routed expert."""
        base = f"model.layers.{layer}.{self.mlp_name}.experts.{expert}"
        gate, up, down = self.expert_proj_names
        return f"{base}.{gate}.weight", f"{base}.{up}.weight", f"{base}.{down}.weight"
