"""The weighted RMSNorm (every family's norms) and glm5_next's clamped SwiGLU, one launch each, not ~8.

At decode every torch op is a launch of a few microseconds even replayed from a CUDA graph, far more than
its arithmetic: RMSNorm is float, pow, mean, add, rsqrt, mul, cast and the weight mul; the clamped SwiGLU
is two clamps, silu and a mul. models/blocks/common.RMSNorm (every family's norms) and
models/glm5_next/layers.py run these kernels on CUDA (no gradient) and the twins (kernels/reference_norm.py:
rms_norm_ref, clamped_swiglu_ref) elsewhere. The helpers below
(rounding to the model dtype, rsqrt, the weighted norm of one row) are shared with mhc_fused.py.

Numerics follow what eager torch computes on a CUDA device, operation by operation:
  - fp32 statistics: the mean is the sum times fp32(1 / D) (torch's CUDA mean multiplies by that
    factor; its CPU mean divides: the same value whenever D is a power of two), + eps, rsqrt;
  - rsqrt is libdevice's (`rsqrt.approx`, what CUDA's rsqrtf is), silu is x / (1 + exp(-x)) with
    the accurate expf and an IEEE division, as torch's CUDA silu writes it;
  - every product and sum is rounded on its own (launched with `enable_fp_fusion=False`);
  - every cast to the model dtype rounds to nearest even, where torch rounds: the normalised value
    before the weight, the weighted result, the silu and the product.
The one difference left is the order of the fp32 sum of squares (a tree in registers here, torch's own
reduction tree there): the statistic may differ in its last bit, which after the rsqrt and the rounding
to bf16 moves a rare element by one bf16 ulp.

Under Triton's interpreter (CPU tests) libdevice is absent: rsqrt is numpy's 1 / sqrt, exp numpy's, and
a float32 -> bfloat16 cast truncates there, so `round_to` rounds bf16 by its bits instead (the same
result as the GPU's cvt.rn). Batch-invariant (one program per token, or per block of elements for the
elementwise activation), no host synchronisation, fixed shapes: CUDA-graph capturable.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tiermoe.kernels.triton.precise import PRECISE, precise_exp, precise_rsqrt

MAX_DIM = 16384  # one row in registers: 16 warps hold 16384 fp32 values at 32 a lane

_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def round_to(x, DTYPE: tl.constexpr, PRECISE: tl.constexpr):
    """fp32 x -> x rounded to nearest even in DTYPE, as a DTYPE tensor (what torch's `.to(dtype)` gives).

    Compiled, a plain cast (cvt.rn). The interpreter truncates float32 -> bfloat16 (and loses
    subnormals), so there the rounding is done on the bits: add 0x7FFF plus the lowest kept bit, keep
    the high half (a NaN keeps its high half, made quiet)."""
    if DTYPE == tl.float32:
        y = x
    elif PRECISE or DTYPE != tl.bfloat16:
        y = x.to(DTYPE)
    else:
        u = x.to(tl.uint32, bitcast=True)
        hi = tl.where(x != x, (u >> 16) | 0x40, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)
        y = hi.to(tl.uint16).to(DTYPE, bitcast=True)
    return y


@triton.jit
def weighted_rms_norm_row(x, w, inv_d, eps, DTYPE: tl.constexpr, OUT: tl.constexpr, PRECISE: tl.constexpr):
    """One row, x fp32 [BLOCK] (values of DTYPE, 0 in padded lanes), w fp32 [BLOCK] -> OUT [BLOCK]:
    OUT(w * DTYPE(x * rsqrt(sum(x * x) * inv_d + eps))), rms_norm_ref's operations in its order."""
    ms = tl.sum(x * x, axis=0) * inv_d
    h = round_to(x * precise_rsqrt(ms + eps, PRECISE), DTYPE, PRECISE).to(tl.float32)
    return round_to(w * h, OUT, PRECISE)


@functools.lru_cache(maxsize=None)
def inv_count(d: int) -> float:
    """fp32(1 / d) as a Python float (exact as a kernel's fp32 argument): torch's CUDA mean factor."""
    return (torch.ones((), dtype=torch.float32) / d).item()


def row_warps(block: int) -> int:
    """Warps for one row of `block` fp32 values in registers: about 16 values a lane, 1 to 16 warps."""
    return max(1, min(16, block // 512))


def supported_dtype(t: torch.Tensor) -> bool:
    """Whether the kernels here take t's dtype (float32, bfloat16, float16)."""
    return t.dtype in _TL_DTYPE


def check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _TL_DTYPE:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, inv_d, eps, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     PRECISE: tl.constexpr):
    """One program per row: x [D] (row stride stride_x) -> out [D] (contiguous), see rms_norm_ref."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    ok = offs < D
    x = tl.load(x_ptr + t * stride_x + offs, mask=ok, other=0.0).to(tl.float32)  # [BLOCK_D]
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    y = weighted_rms_norm_row(x, w, inv_d, eps, x_ptr.dtype.element_ty, out_ptr.dtype.element_ty, PRECISE)
    tl.store(out_ptr + t * D + offs, y, mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] (on the device) -> weight * x.dtype(x / rms(x)) [..., D] in the promoted dtype of
    weight and x, one launch (one program per row); twin: reference_norm.rms_norm_ref.

    Rows may be strided (a column slice of a wider projection is read in place)."""
    check_dtype("x", x)
    check_dtype("weight", weight)
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"weight must be [{d}], got {tuple(weight.shape)}")
    if not 1 <= d <= MAX_DIM:
        raise ValueError(f"rows of {d} values: the kernel takes 1 to {MAX_DIM}")
    rows = x.reshape(-1, d)  # [R, D], a view where the layout allows
    if rows.shape[0] and rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)  # [R, D]
    if rows.shape[0]:
        block = triton.next_power_of_2(d)
        _rms_norm_kernel[(rows.shape[0],)](rows, weight.contiguous(), out, rows.stride(0), inv_count(d), float(eps),
                                           D=d, BLOCK_D=block, PRECISE=PRECISE, num_warps=row_warps(block),
                                           enable_fp_fusion=False)
    return out.reshape(x.shape)


@functools.lru_cache(maxsize=None)
def _bound(limit: float, dtype: torch.dtype) -> float:
    """limit rounded to dtype, as torch's CPU clamp converts a scalar bound (on the host: no device sync)."""
    return torch.tensor(limit, dtype=torch.float32).to(dtype).item()


@triton.jit
def _clamped_swiglu_kernel(g_ptr, u_ptr, out_ptr, g_stride, u_stride, width, limit, BLOCK: tl.constexpr,
                           PRECISE: tl.constexpr):
    """Grid (rows, column blocks): out = silu(min(g, limit)) * clamp(u, -limit, limit) over BLOCK columns of one
    row (g and u rows strided, out contiguous), see clamped_swiglu_ref."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    ok = offs < width
    dtype = g_ptr.dtype.element_ty
    g = tl.load(g_ptr + r * g_stride + offs, mask=ok, other=0.0).to(tl.float32)
    g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)  # torch's clamp keeps a NaN
    silu = round_to(tl.div_rn(g, 1.0 + precise_exp(-g, PRECISE)), dtype, PRECISE).to(tl.float32)
    u = tl.load(u_ptr + r * u_stride + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL)
    u = tl.minimum(u, limit, propagate_nan=tl.PropagateNan.ALL)
    tl.store(out_ptr + r * width + offs, round_to(silu * u, dtype, PRECISE), mask=ok)


def _row_view(x: torch.Tensor) -> torch.Tensor:
    """x [..., I] as rows [R, I] with contiguous columns, without a copy where x already is (a column slice of
    a wider projection, e.g. the halves of a merged gate|up GEMM's output, is read in place)."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return rows if rows.stride(-1) == 1 or rows.shape[-1] <= 1 else rows.contiguous()


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """gate, up [..., I] of one dtype -> silu(min(gate, limit)) * clamp(up, -limit, limit) [..., I], one launch;
    twin: reference_norm.clamped_swiglu_ref.

    The limit is rounded to the inputs' dtype first, as torch's CPU clamp rounds its scalar bounds (its
    CUDA clamp compares in fp32 and rounds the result: for inputs of that dtype both give the same values)."""
    check_dtype("gate", gate)
    if up.shape != gate.shape or up.dtype != gate.dtype:
        raise ValueError(f"gate and up must match, got {gate.dtype} {tuple(gate.shape)} and {up.dtype} "
                         f"{tuple(up.shape)}")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)  # contiguous [..., I]
    if gate.numel():
        g, u = _row_view(gate), _row_view(up)  # [R, I] each
        block = 1024
        width = g.shape[1]
        _clamped_swiglu_kernel[(g.shape[0], triton.cdiv(width, block))](
            g, u, out, g.stride(0), u.stride(0), width, _bound(float(limit), gate.dtype), BLOCK=block,
            PRECISE=PRECISE, num_warps=4, enable_fp_fusion=False)
    return out
