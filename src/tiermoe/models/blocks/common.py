"""Norms, the dense SwiGLU MLP and weight-slot helpers.

Numerics mirror transformers' reference modules op for op (fp32 normalisation, cast back,
then scale), because every family is held to top-1 == 1.0 and KL < 1e-6 against them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tiermoe.kernels.reference_norm import rms_norm_ref


class _ReferenceOps(threading.local):
    on = False  # inside `reference_ops`: the twins everywhere, in this thread


_REFERENCE_OPS = _ReferenceOps()


@contextlib.contextmanager
def reference_ops(on: bool = True) -> Iterator[None]:
    """Within (when `on`): `device_kernels` answers False, so every block computes with its plain-torch twin, which
    are transformers' own ops. Why: a prefill step then gives transformers' bf16 logits bit for bit on a GPU too
    (the Triton kernels round in their own order, and at near-ties that flips a top-1), at little cost, since a
    prefill chunk's work is a few large launches either way; decode steps keep the kernels (one graph, few
    launches, rows independent of the batch)."""
    before = _REFERENCE_OPS.on
    _REFERENCE_OPS.on = bool(on)
    try:
        yield
    finally:
        _REFERENCE_OPS.on = before


def device_kernels(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels serve these inputs: on a CUDA device (the first tensor's), outside
    `reference_ops`, with no gradient to carry (the kernels define no backward, so anything that trains through
    them takes their plain-torch twins)."""
    return tensors[0].is_cuda and not _REFERENCE_OPS.on and not (
        torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def empty_param(*shape: int) -> nn.Parameter:
    """A parameter slot with no storage; the loader assigns the checkpoint tensor."""
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = empty_param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> [..., D]: fp32 statistics, cast back, then the weight (transformers' order). One Triton
        launch on CUDA (no gradient) instead of the twin's six small kernels, which a decode step pays for every
        norm of every layer; the twin (kernels/reference_norm.rms_norm_ref) elsewhere and under `reference_ops`."""
        if device_kernels(x, self.weight):
            from tiermoe.kernels.triton.norm import MAX_DIM, rms_norm, supported_dtype
            if x.shape[-1] <= MAX_DIM and supported_dtype(x) and supported_dtype(self.weight):
                return rms_norm(x, self.weight, self.eps)
        return rms_norm_ref(x, self.weight, self.eps)  # elsewhere, and for float64 or rows too wide to hold


class Linear(nn.Module):
    """nn.Linear without initialisation; weights come from the checkpoint."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = empty_param(out_features, in_features)
        self.bias = empty_param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class SwiGLU(nn.Module):
    """Dense MLP: down(silu(gate(x)) * up(x)); also the shared expert of MoE layers."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
