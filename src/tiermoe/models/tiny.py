"""Small seeded random checkpoints of each supported family (`tiermoe tiny ARCH OUT_DIR`).

They are written by transformers' own model classes (so the reference implementation and the
checkpoint format agree by construction) with a real tokenizer and chat template, and weights
drawn with fan-in scaling so logits and routing are decisive: parity tests then check real
agreement rather than noise around near-ties. A few MB each; packable and servable.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from tiermoe.errors import UserError
from tiermoe.models.tiny_tokenizer import build_tokenizer

_COMMON = dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-6)


def _configs(vocab: int, eos: int, pad: int) -> dict[str, tuple[str, dict]]:
    ids = dict(vocab_size=vocab, eos_token_id=eos, pad_token_id=pad, bos_token_id=None, tie_word_embeddings=False)
    return {
        "qwen3_moe": ("Qwen3Moe", dict(
            **_COMMON, **ids, num_hidden_layers=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
            mlp_only_layers=[1], decoder_sparse_step=1)),
        "qwen2_moe": ("Qwen2Moe", dict(
            **_COMMON, **ids, num_hidden_layers=3, num_key_value_heads=2, intermediate_size=128,
            moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=False)),
        "olmoe": ("Olmoe", dict(
            **_COMMON, **ids, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=32,
            num_experts=8, num_experts_per_tok=2, clip_qkv=8.0)),
        "mixtral": ("Mixtral", dict(
            **_COMMON, **ids, num_hidden_layers=3, num_key_value_heads=2, intermediate_size=32,
            num_local_experts=8, num_experts_per_tok=2)),
        "glm4_moe": ("Glm4Moe", dict(
            **_COMMON, **ids, num_hidden_layers=3, num_key_value_heads=2, head_dim=16, intermediate_size=128,
            moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
            first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True)),
        "deepseek_v3": ("DeepseekV3", dict(
            **_COMMON, **ids, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=128,
            moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
            first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            rope_interleave=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 1.0})),
    }


from tiermoe.models.registry import TINY_ARCHS  # noqa: E402,F401  (re-exported)


@torch.no_grad()
def _decisive_init(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Fan-in scaled weights; biases and correction biases small but non-zero."""
    for name, p in model.named_parameters():
        if p.ndim >= 2:
            fan_in = p.shape[-1]
            std = 1.0 if "embed_tokens" in name else 1.0 / math.sqrt(fan_in)
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        elif name.endswith("norm.weight") or "layernorm" in name:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.05 * torch.randn(b.shape, generator=gen))


def write_tiny(arch: str, out_dir: str | Path, seed: int = 0, dtype: str = "float32") -> Path:
    """Write a tiny random `arch` checkpoint (config, safetensors, tokenizer) to out_dir."""
    import transformers

    if arch == "glm5_next":  # its own writer: vision stub, MTP layer appended
        from tiermoe.models.glm5_next.tiny import write_tiny_checkpoint

        return write_tiny_checkpoint(out_dir, seed=seed)
    tok = build_tokenizer()
    configs = _configs(len(tok), tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id)
    if arch not in configs:
        raise UserError(f"unknown architecture '{arch}' for tiny (choose from {', '.join(TINY_ARCHS)})")
    prefix, fields = configs[arch]
    config = getattr(transformers, f"{prefix}Config")(**fields)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    _decisive_init(model, gen)
    model = model.to(getattr(torch, dtype))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out
