"""Write a tiny random glm5_next checkpoint that exercises every code path.

The trunk is built and saved with transformers' own `Glm5NextForConditionalGeneration`
(with a one-block vision tower, which the text path ignores), so its files are exactly what a
real checkpoint looks like. The layout is chosen for coverage:

| layer | 0   | 1   | 2        | 3          | 4   | 5   | 6   | 7        | 8 (MTP)   |
|-------|-----|-----|----------|------------|-----|-----|-----|----------|-----------|
| mixer | KDA | KDA | MLA full | MLA shared | KDA | KDA | KDA | MLA full | MLA full  |
| FFN   | MLP | MLP | MLP      | MoE        | MoE | MoE | MoE | MoE      | MoE       |

index_topk=8 with index_kpool=4 makes DSA sparse beyond 11 tokens, so ordinary prompts use
the sparse path; 16 indexer heads make an all-ReLU-zero pool score (an exact tie, which the
reference breaks arbitrarily) rare; swiglu_limit=1.0 makes the clamp bite. Weights are drawn with scales that
keep activations O(1) and logits peaked (so top-1 is well defined). The MTP block (not part
of transformers' class) is appended under `layers.8.*` in the hub key layout.

`branch_scale` < 1 shrinks every residual branch's output projection of the trunk (attention
and KDA `o_proj`, MLP / shared / routed `down_proj`), so each position's own token dominates
its residual stream as in trained models. With the default 1.0 the random trunk's next token
is close to a chaotic function of the whole context (a next-token table built from its own
continuations predicts about 5 % of held-out ones), which no small draft head can learn; at
0.25 about half. `distill.distill_mtp` then trains the MTP layer on what the trunk says.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from tiermoe.models.tiny_tokenizer import save_tokenizer

TINY_TEXT_CONFIG = dict(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=8,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, v_head_dim=16,
    index_topk=8, index_head_dim=16, index_n_heads=16, index_kpool=4, linear_head_dim=16,
    linear_num_heads=4, linear_conv_kernel_dim=4, hc_mult=4, hc_sinkhorn_iters=20,
    swiglu_limit=1.0, routed_scaling_factor=2.5, max_position_embeddings=4096,
    layer_types=["linear_attention", "linear_attention", "indexed_attention", "indexed_attention",
                 "linear_attention", "linear_attention", "linear_attention", "indexed_attention"],
    indexer_types=["full", "full", "full", "shared", "full", "full", "full", "full"],
    mlp_layer_types=["dense"] * 3 + ["sparse"] * 5,
)
TINY_VISION_CONFIG = dict(
    depth=1, hidden_size=32, num_heads=2, out_hidden_size=64, intermediate_size=32,
    projection_intermediate_size=32, patch_size=2, spatial_merge_size=1, temporal_patch_size=1,
)


def init_value(name: str, p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random value for parameter `name` with a scale that keeps the network well behaved.

    Shared with the full-width synthetic store (bench/synthetic_glm5.py), so both draw every
    tensor kind at the same scale; only `p.shape` is read, so `p` may be a meta tensor."""

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(p.shape, generator=gen, dtype=torch.float32) * std + mean

    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    if name.endswith("lm_head.weight"):
        return normal(4.0 / math.sqrt(p.shape[1]))
    if leaf in ("A_log",):
        return normal(0.5)
    if leaf == "dt_bias":
        return normal(1.0)
    if name.endswith(("hc.base", "hc_attn_base", "hc_ffn_base")):
        return normal(0.5)
    if name.endswith(("hc.scale", "hc_attn_scale", "hc_ffn_scale")):
        return normal(0.1, 1.0)
    if name.endswith("e_score_correction_bias"):
        return normal(0.1)
    if name.endswith("index_kpool_compress_ape"):
        return normal(0.5)
    if name.endswith("k_norm.bias"):
        return normal(0.1)
    if p.dim() == 1:  # norm weights
        return normal(0.1, 1.0)
    if "conv1d" in name:
        return normal(1.0 / math.sqrt(p.shape[-1]))
    return normal(1.0 / math.sqrt(p.shape[-1]))  # linear weights [out, in], hc fn


_BRANCH_OUTPUTS = ("o_proj.weight", "down_proj.weight", "experts.down_proj")


def write_tiny_checkpoint(out_dir: str | Path, seed: int = 0, with_mtp: bool = True, branch_scale: float = 1.0) -> Path:
    """Create `out_dir` with config.json, model.safetensors and tokenizer files; returns it.
    branch_scale: factor on the trunk's residual-branch output projections (see above)."""
    from transformers import AutoTokenizer, Glm5NextForConditionalGeneration
    from transformers import Glm5NextConfig as HFConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = save_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(str(out))
    text = dict(TINY_TEXT_CONFIG, vocab_size=vocab, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    cfg = HFConfig(text_config=text, vision_config=TINY_VISION_CONFIG, tie_word_embeddings=False)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".visual." not in name:
                value = init_value(name, p, gen)
                if branch_scale != 1.0 and name.endswith(_BRANCH_OUTPUTS):
                    value = value * branch_scale
                p.copy_(value.to(p.dtype))
    model.save_pretrained(str(out))

    if with_mtp:
        _append_mtp(out, gen)
    return out


def _append_mtp(out: Path, gen: torch.Generator) -> None:
    """Add random MTP weights (hub key layout, layer index num_hidden_layers) to the checkpoint."""
    from safetensors.torch import load_file, save_file

    from .config import load_config
    from .loader import detect_prefix, expert_weight_keys
    from .model import MTPLayer
    from .weights import Checkpoint

    conf_path = out / "config.json"
    raw = json.loads(conf_path.read_text())
    raw["text_config"]["num_nextn_predict_layers"] = 1
    conf_path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    cfg = load_config(out)
    prefix = detect_prefix(Checkpoint(out))
    n = cfg.mtp_layer_idx
    with torch.device("meta"):
        mtp = MTPLayer(cfg)
    tensors = {}
    for name, p in mtp.named_parameters():
        tensors[f"{prefix}layers.{n}.{name}"] = init_value(name, p, gen).contiguous()
    i, h = cfg.moe_intermediate_size, cfg.hidden_size
    for e in range(cfg.n_routed_experts):
        keys = expert_weight_keys(prefix, n, e)
        tensors[keys["gate_proj"]] = torch.randn(i, h, generator=gen) / math.sqrt(h)
        tensors[keys["up_proj"]] = torch.randn(i, h, generator=gen) / math.sqrt(h)
        tensors[keys["down_proj"]] = torch.randn(h, i, generator=gen) / math.sqrt(i)
    path = out / "model.safetensors"
    state = load_file(str(path))
    state.update(tensors)
    save_file(state, str(path), metadata={"format": "pt"})
