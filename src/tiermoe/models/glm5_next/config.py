"""GLM-5.3-Flash (`glm5_next`) text configuration, read from a checkpoint's config.json.

The checkpoint may be the multimodal layout (`text_config` nested under a `glm5_next` config,
as `Glm5NextForConditionalGeneration.save_pretrained` writes it) or a flat text-only layout.
Derived per-layer schedules (`layer_types`, `mlp_layer_types`, `indexer_types`) follow the same
defaults as transformers' `Glm5NextTextConfig`, so a config that omits them means the same model
here as there. Anything this implementation cannot run raises a one-line `UserError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from tiermoe.errors import UserError

ARCH_NAMES = ("Glm5NextForConditionalGeneration", "Glm5NextForCausalLM", "Glm5NextModel")
MODEL_TYPES = ("glm5_next", "glm5_next_text")


@dataclass(frozen=True)
class Glm5NextConfig:
    """Text-model hyperparameters; field names match the Hugging Face config keys."""

    vocab_size: int = 154880
    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 288
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int = 1536
    qk_rope_head_dim: int = 0
    v_head_dim: int = 256
    qk_nope_head_dim: int = 256
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    swiglu_limit: float = 10.0
    linear_head_dim: int = 128
    linear_num_heads: int = 64
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    num_nextn_predict_layers: int = 0
    max_position_embeddings: int = 1048576
    pad_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    layer_types: tuple[str, ...] = field(default=())
    mlp_layer_types: tuple[str, ...] = field(default=())
    indexer_types: tuple[str, ...] = field(default=())

    # ---- derived views -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def linear_qkv_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    @property
    def mtp_layer_idx(self) -> int:
        """Checkpoint layer index of the multi-token-prediction block (after the trunk)."""
        return self.num_hidden_layers

    def is_kda(self, i: int) -> bool:
        return self.layer_types[i] == "linear_attention"

    def is_moe(self, i: int) -> bool:
        """True for MoE layers; the MTP layer (index num_hidden_layers) is always MoE."""
        return i >= self.num_hidden_layers or self.mlp_layer_types[i] == "sparse"

    def shares_topk(self, i: int) -> bool:
        """True when MLA layer i reuses the previous layer's DSA selection instead of indexing."""
        return i < self.num_hidden_layers and self.indexer_types[i] == "shared"

    def hands_topk_on(self, i: int) -> bool:
        """True when MLA layer i's selection is passed to layer i+1 (transformers' next_skip_topk)."""
        nxt = self.indexer_types[min(i + 1, self.num_hidden_layers - 1)]
        return not self.shares_topk(i) and nxt == "shared"

    def moe_layers(self) -> list[int]:
        """Layer indices that own routed experts, including the MTP layer when present."""
        out = [i for i in range(self.num_hidden_layers) if self.is_moe(i)]
        if self.num_nextn_predict_layers > 0:
            out.append(self.mtp_layer_idx)
        return out

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "Glm5NextConfig":
        """Build from a config dict (nested `text_config` or flat); `source` names it in errors."""
        text = dict(raw.get("text_config") or raw)
        # Kimi-style nested linear attention block, as transformers accepts it.
        lin = text.get("linear_attn_config")
        if isinstance(lin, dict):
            text.setdefault("linear_head_dim", lin.get("head_dim", 128))
            text.setdefault("linear_num_heads", lin.get("num_heads", 64))
            text.setdefault("linear_conv_kernel_dim", lin.get("short_conv_kernel_size", 4))
            lb = lin.get("gate_lower_bound", -5.0)
            if lb is None and lin.get("safe_gate", True):
                lb = -5.0
            text.setdefault("linear_lower_bound", lb)
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in text.items() if k in known}
        n = int(kw.get("num_hidden_layers", 45))
        kw["num_hidden_layers"] = n
        if not kw.get("mlp_layer_types"):
            kw["mlp_layer_types"] = ["dense"] * min(3, n) + ["sparse"] * (n - 3)
        if not kw.get("layer_types"):
            kw["layer_types"] = ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)]
        kw["layer_types"] = ["indexed_attention" if t == "full_attention" else t for t in kw["layer_types"]]
        if not kw.get("indexer_types"):
            pattern = text.get("index_topk_pattern")
            if pattern is not None:
                kw["indexer_types"] = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(
                    pattern, str
                ) else list(pattern)
            else:
                freq = max(int(text.get("index_topk_freq", 1)), 1)
                offset = int(text.get("index_skip_topk_offset", 2))
                kw["indexer_types"] = [
                    "full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n)
                ]
        if "num_nextn_predict_layers" not in kw:
            kw["num_nextn_predict_layers"] = int(text.get("num_mtp_layers", 0) or 0)
        for k in ("layer_types", "mlp_layer_types", "indexer_types"):
            kw[k] = tuple(kw[k])
        cfg = cls(**kw)
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config.json") -> None:
        """Raise a one-line UserError for configurations this implementation cannot run."""

        def bad(msg: str) -> None:
            raise UserError(f"{source}: {msg}")

        n = self.num_hidden_layers
        for name in ("layer_types", "mlp_layer_types", "indexer_types"):
            if len(getattr(self, name)) != n:
                bad(f"{name} has {len(getattr(self, name))} entries, expected num_hidden_layers={n}")
        if set(self.layer_types) - {"linear_attention", "indexed_attention"}:
            bad(f"layer_types: unknown entry in {sorted(set(self.layer_types))}")
        if set(self.mlp_layer_types) - {"dense", "sparse"}:
            bad(f"mlp_layer_types: unknown entry in {sorted(set(self.mlp_layer_types))}")
        if set(self.indexer_types) - {"full", "shared"}:
            bad(f"indexer_types: unknown entry in {sorted(set(self.indexer_types))}")
        if self.qk_rope_head_dim != 0:
            bad(f"qk_rope_head_dim={self.qk_rope_head_dim}: glm5_next attention is NoPE (expects 0)")
        if self.hidden_act != "silu":
            bad(f"hidden_act={self.hidden_act!r}: only 'silu' is supported")
        if self.index_kpool < 1 or self.index_topk % self.index_kpool:
            bad(f"index_topk={self.index_topk} must be a positive multiple of index_kpool={self.index_kpool}")
        if self.n_routed_experts % self.n_group:
            bad(f"n_routed_experts={self.n_routed_experts} not divisible by n_group={self.n_group}")
        if self.num_nextn_predict_layers > 1:
            bad(f"num_nextn_predict_layers={self.num_nextn_predict_layers}: at most one MTP layer is supported")
        for i in range(n):
            if self.layer_types[i] == "indexed_attention" and self.shares_topk(i):
                prev_ok = i > 0 and self.layer_types[i - 1] == "indexed_attention" and not self.shares_topk(i - 1)
                if not prev_ok:
                    bad(f"indexer_types[{i}]='shared' needs layer {i - 1} to be a 'full' indexed_attention layer")


def load_config(model_dir: str | Path) -> Glm5NextConfig:
    """Read `<model_dir>/config.json`; a missing/unreadable file or foreign model is a UserError."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: not found") from None
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: cannot read ({e.__class__.__name__})") from None
    mt = raw.get("model_type")
    if mt not in MODEL_TYPES and not set(raw.get("architectures") or []) & set(ARCH_NAMES):
        raise UserError(f"{path}: model_type={mt!r} is not glm5_next")
    return Glm5NextConfig.from_dict(raw, str(path))
