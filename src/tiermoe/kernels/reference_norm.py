"""Plain-torch twins of kernels/triton/norm.py: glm5_next's weighted RMSNorm and clamped SwiGLU.

They are also the CPU path of models/glm5_next/layers.py, so they are written exactly as transformers'
glm5_next computes them (same operations, same order, same dtype casts): CPU results stay bit for bit
what the reference computes, and the Triton kernels are judged against this code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> weight * (x / rms(x)) [..., D].

    fp32 statistics, the normalised value cast back to x's dtype, then the weight multiply in the
    promoted dtype of (weight, x) (bf16 * bf16 at bf16: one rounding of an exact product)."""
    dtype = x.dtype
    h = x.float()  # [..., D]
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def clamped_swiglu_ref(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """gate, up [..., I] -> silu(min(gate, limit)) * clamp(up, -limit, limit) [..., I] (GLM-5.3's
    swiglu_limit): the clamps in the input dtype, silu in fp32 rounded to it, the product rounded once."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
