"""Small building blocks shared by the glm5_next layers: RMSNorm and the clamped SwiGLU MLP.

Every function mirrors the dtype handling of transformers' `glm5_next` so that fp32 results
agree to rounding and bf16 results agree to bf16 rounding: norms compute in fp32 and cast back
before the weight multiply. The math is the plain-torch twins' (kernels/reference_norm.py), which
is also the CPU path; on a CUDA device each is one Triton launch (kernels/triton/norm.py) instead of
a handful of tiny kernels. The mHC hyper-connection is the shared block
`models/blocks/hyperconnection.py`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tiermoe.kernels.reference_norm import clamped_swiglu_ref
from tiermoe.models.blocks import common
from tiermoe.models.blocks.common import device_kernels
from tiermoe.models.blocks.fused_linear import ProjectionGroup



class RMSNorm(common.RMSNorm):
    """The shared weighted RMSNorm (fp32 statistics, cast to the input dtype, then the weight; one Triton launch on
    CUDA), with its weight set to ones, as transformers' glm5_next builds it, instead of an empty slot."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        self.weight = nn.Parameter(torch.ones(dim))


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) [..., I]: GLM-5.3's swiglu_limit, applied to the
    dense MLPs and the shared expert here (routed experts apply it in their own backend). One Triton
    launch on CUDA (no gradient), the twin's four torch ops elsewhere."""
    if device_kernels(gate, up) and gate.dtype == up.dtype:
        from tiermoe.kernels.triton.norm import clamped_swiglu as swiglu
    else:
        swiglu = clamped_swiglu_ref
    return swiglu(gate, up, limit)


class MLP(nn.Module):
    """Dense SwiGLU MLP with the swiglu_limit clamp (dense layers and the shared expert)."""

    def __init__(self, hidden: int, inter: int, limit: float):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.limit = limit
        self.gate_up = ProjectionGroup([(self.gate_proj, "weight"), (self.up_proj, "weight")])  # one GEMM on CUDA

    def fuse_projections(self) -> None:
        """Merge gate and up into one weight buffer (no extra memory; see blocks/fused_linear.py)."""
        self.gate_up.fuse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        if self.gate_up.active(x):
            gate, up = self.gate_up(x).chunk(2, dim=-1)  # [T, I] each, strided rows of one GEMM's output
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(clamped_swiglu(gate, up, self.limit))
