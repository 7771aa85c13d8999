"""Rotary position embeddings.

cos/sin come from the family's own transformers RotaryEmbedding module (so default, linear,
yarn, llama3 and partial-rotary variants are computed by the reference code, and bit for bit the
way the installed transformers version forms them on this device), per token position.
"""

from __future__ import annotations

import torch
from torch import nn


class Rotary(nn.Module):
    def __init__(self, rotary_cls, hf_config):
        super().__init__()
        self.ref = rotary_cls(config=hf_config)

    @torch.no_grad()
    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, rotary_dim] in `dtype`."""
        probe = torch.empty(0, dtype=dtype, device=positions.device)  # carries dtype/device only
        cos, sin = self.ref(probe, positions[None, :])  # [1, T, R]
        return cos[0], sin[0]


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
