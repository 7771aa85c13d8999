"""glm5_next's KDA layers: the shared block (`models/blocks/kda.py`) sized from `Glm5NextConfig`.

The block takes plain sizes so other hybrid families can use it; this module maps the
family's `linear_*` config fields onto it and re-exports the names other modules of this
family (and its tests) import from here.
"""

from __future__ import annotations

from tiermoe.models.blocks.kda import KDA_CHUNK, ForgetGate, KDAttention, kda_chunked, kda_recurrent, l2norm

from .config import Glm5NextConfig

__all__ = ["KDA_CHUNK", "ForgetGate", "KDAttention", "kda_attention", "kda_chunked", "kda_recurrent", "l2norm"]


def kda_attention(cfg: Glm5NextConfig, layer_idx: int) -> KDAttention:
    """The KDA token mixer of layer `layer_idx` (state keyed by that index in `KDAStates`)."""
    return KDAttention(
        layer_idx, cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim,
        cfg.rms_norm_eps, cfg.linear_lower_bound,
    )
