"""Rotary position embeddings.

inv_freq and the attention scaling come from the family's own transformers RotaryEmbedding
class (so default, linear, yarn, llama3 and partial-rotary variants are all computed by the
reference code); cos/sin are formed the same way the reference does, per token position.
"""

from __future__ import annotations

import torch
from torch import nn


class Rotary(nn.Module):
    def __init__(self, rotary_cls, hf_config):
        super().__init__()
        ref = rotary_cls(config=hf_config)
        self.register_buffer("inv_freq", ref.inv_freq.detach().clone().float(), persistent=False)
        self.scaling = float(ref.attention_scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, rotary_dim] in `dtype`."""
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)[None, :]  # [T, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; rotates the first cos.shape[-1] dims (partial rotary), rest passes."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved pairs (x0, x1), (x2, x3), ... each rotated by one frequency."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
