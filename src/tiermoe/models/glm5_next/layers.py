"""Small building blocks shared by the glm5_next layers: RMSNorm and the clamped SwiGLU MLP.

Every function mirrors the dtype handling of transformers' `glm5_next` so that fp32 results
agree to rounding and bf16 results agree to bf16 rounding: norms compute in fp32 and cast back
before the weight multiply. The mHC hyper-connection is the shared block
`models/blocks/hyperconnection.py`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """Weighted RMSNorm: fp32 statistics, result cast to the input dtype, then the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit): GLM-5.3's swiglu_limit, applied to the
    dense MLPs, the shared expert and every routed expert alike."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class MLP(nn.Module):
    """Dense SwiGLU MLP with the swiglu_limit clamp (dense layers and the shared expert)."""

    def __init__(self, hidden: int, inter: int, limit: float):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))
