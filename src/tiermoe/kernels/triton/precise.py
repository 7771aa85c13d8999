"""Accurate transcendental functions for the Triton kernels that mirror a torch computation.

On a GPU, Triton's `tl.exp` / `tl.log` are the fast approximate instructions (ex2.approx and
friends), whereas torch's CUDA kernels call CUDA's accurate expf / logf; a kernel that must round
like its torch twin calls libdevice's versions instead. Triton's interpreter (the CPU tests) has no
libdevice, so there the plain `tl.*` functions (numpy's) stand in. `PRECISE` says which applies to
this process: launch with `PRECISE=PRECISE` (a constexpr).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

PRECISE = os.environ.get("TRITON_INTERPRET", "0") != "1"  # libdevice when compiled, tl.* under the interpreter


@triton.jit
def precise_exp(x, PRECISE: tl.constexpr):
    """exp(x): libdevice's accurate expf compiled (what torch's CUDA kernels call), numpy's interpreted."""
    if PRECISE:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def precise_log(x, PRECISE: tl.constexpr):
    """log(x): libdevice's logf compiled, numpy's interpreted."""
    if PRECISE:
        y = libdevice.log(x)
    else:
        y = tl.log(x)
    return y


@triton.jit
def precise_sigmoid(x, PRECISE: tl.constexpr):
    """1 / (1 + exp(-x)), the form of torch's CUDA sigmoid (saturates to 0 and 1 without NaN)."""
    return tl.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + precise_exp(-x, PRECISE))


@triton.jit
def precise_rsqrt(x, PRECISE: tl.constexpr):
    """1 / sqrt(x): libdevice's rsqrtf compiled (what torch's CUDA rsqrt calls), numpy's 1 / sqrt interpreted."""
    if PRECISE:
        y = libdevice.rsqrt(x)
    else:
        y = tl.rsqrt(x)
    return y
