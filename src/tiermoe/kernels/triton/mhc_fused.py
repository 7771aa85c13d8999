"""The torch ops around the mHC mixing kernel, fused: three launches per sub-block instead of ~16.

models/blocks/hyperconnection.py wraps each sub-block (attention, FFN) of glm5_next in a hyper-connection
over N residual streams [T, N, D]. Besides the projection (cuBLAS) and the mixing coefficients
(mhc.py), eager torch spends a dozen tiny kernels on each sub-block: the fp32 cast and unweighted RMS
norm of the flattened streams, the collapse to the sub-block input and its weighted RMSNorm, and the
spread of the output plus the N x N mix of the residual. At decode each is a launch of a few microseconds
even replayed from a CUDA graph, and glm5_next runs 90 sub-blocks per token. Here:

  hc_flat_norm(streams)                     -> fp32 [T, N*D]   the projection's input (one program per token)
  hc_collapse_norm(streams, pre, w, eps)    -> [T, D]          collapse + weighted RMSNorm (one per token)
  hc_post(out, residual, post, comb)        -> [T, N, D]       the new streams (one per token and D block)

Twins: kernels/reference_mhc.py (hc_flat_norm_ref, hc_collapse_norm_ref, hc_post_ref), the CPU path.
Numerics follow the twins operation by operation, as eager torch computes them on a CUDA device
(norm.py's conventions: mean as sum times fp32(1 / count), libdevice rsqrt, no FMA contraction,
round-to-nearest-even casts where torch casts). The collapse and the mix add the streams in index
order, as torch's reduction over the stream dimension and a K = N matmul do; bf16 x bf16 products are
exact in fp32, so at bf16 only the order of those few additions could differ from cuBLAS. The sums of
squares run in a tree of their own: their last bit may differ from torch's, which moves a rare element of
a bf16 result by one ulp (fp32 results by a few fp32 ulps).

Each token's result depends on that token alone (batch-invariant), no host synchronisation, outputs of
fixed shape for T: the launches are captured in a decode step's CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tiermoe.kernels.triton.mhc import MAX_STREAMS
from tiermoe.kernels.triton.norm import (MAX_DIM, PRECISE, check_dtype, inv_count, round_to, row_warps,
                                         weighted_rms_norm_row)
from tiermoe.kernels.triton.precise import precise_rsqrt

FLAT_BLOCK = 4096  # values of a token's flattened streams per step of the flat norm's two passes
POST_BLOCK = 512  # columns of D per hc_post program: D = 4096 spreads one token over 8 programs


@triton.jit
def _flat_norm_kernel(x_ptr, out_ptr, inv_l, eps, L: tl.constexpr, BLOCK: tl.constexpr, PRECISE: tl.constexpr):
    """One program per token: x [L] (L = N*D) -> fp32 x * rsqrt(sum(x * x) * inv_l + eps) [L], in two passes
    (squares into a [BLOCK] accumulator, then scale); the second pass reads the token again from cache."""
    t = tl.program_id(0).to(tl.int64)
    src = x_ptr + t * L
    dst = out_ptr + t * L
    acc = tl.zeros([BLOCK], tl.float32)  # [BLOCK]
    for start in range(0, L, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(src + offs, mask=offs < L, other=0.0).to(tl.float32)
        acc = acc + x * x
    r = precise_rsqrt(tl.sum(acc, axis=0) * inv_l + eps, PRECISE)
    for start in range(0, L, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(src + offs, mask=offs < L, other=0.0).to(tl.float32)
        tl.store(dst + offs, x * r, mask=offs < L)


def _check_streams(streams: torch.Tensor) -> tuple[int, int, int]:
    check_dtype("streams", streams)
    if streams.dim() != 3 or not 1 <= streams.shape[1] <= MAX_STREAMS:
        raise ValueError(f"streams must be [T, N, D] with N of 1 to {MAX_STREAMS}, got {tuple(streams.shape)}")
    return streams.shape[0], streams.shape[1], streams.shape[2]


def _check_fp32(name: str, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    if x.dtype != torch.float32 or tuple(x.shape) != shape:
        raise ValueError(f"{name} must be float32 {list(shape)}, got {x.dtype} {tuple(x.shape)}")


def hc_flat_norm(streams: torch.Tensor, eps: float) -> torch.Tensor:
    """streams [T, N, D] (on the device) -> fp32 [T, N*D]: each token's N*D values in fp32 divided by their
    root mean square, one launch; twin: reference_mhc.hc_flat_norm_ref.

    The projection that follows (F.linear with the fp32 [(2+N)*N, N*D] weight) stays in cuBLAS: a program
    per token would read the whole weight once per token."""
    t, n, d = _check_streams(streams)
    x = streams.contiguous()
    out = torch.empty(t, n * d, dtype=torch.float32, device=streams.device)  # [T, N*D]
    if t:
        block = min(triton.next_power_of_2(n * d), FLAT_BLOCK)
        _flat_norm_kernel[(t,)](x, out, inv_count(n * d), float(eps), L=n * d, BLOCK=block, PRECISE=PRECISE,
                                num_warps=row_warps(block), enable_fp_fusion=False)
    return out


@triton.jit
def _collapse_norm_kernel(s_ptr, pre_ptr, w_ptr, out_ptr, inv_d, eps, N: tl.constexpr, D: tl.constexpr,
                          BLOCK_D: tl.constexpr, PRECISE: tl.constexpr):
    """One program per token: streams [N, D], pre [N] -> rms_norm(dtype(sum_n pre[n] * streams[n])) [D]."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    ok = offs < D
    src = s_ptr + t * (N * D)
    dtype = s_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_D], tl.float32)  # torch's sum starts from 0, then adds the streams in order
    for k in tl.static_range(N):
        p = tl.load(pre_ptr + t * N + k)
        acc = acc + p * tl.load(src + k * D + offs, mask=ok, other=0.0).to(tl.float32)
    c = round_to(acc, dtype, PRECISE).to(tl.float32)  # the collapsed sub-block input, in the streams' dtype
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    y = weighted_rms_norm_row(c, w, inv_d, eps, dtype, out_ptr.dtype.element_ty, PRECISE)
    tl.store(out_ptr + t * D + offs, y, mask=ok)


def hc_collapse_norm(streams: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """streams [T, N, D], pre fp32 [T, N], weight [D] (on the device) -> [T, D] in the promoted dtype of weight
    and streams: the collapse sum_n pre[n] * streams[n] (fp32, rounded to the streams' dtype) and the
    sub-block's weighted RMSNorm, one launch; twin: reference_mhc.hc_collapse_norm_ref."""
    t, n, d = _check_streams(streams)
    _check_fp32("pre", pre, (t, n))
    check_dtype("weight", weight)
    if weight.shape != (d,) or not 1 <= d <= MAX_DIM:
        raise ValueError(f"weight must be [D] with D of 1 to {MAX_DIM}, got {tuple(weight.shape)} for D = {d}")
    out = torch.empty(t, d, dtype=torch.promote_types(weight.dtype, streams.dtype), device=streams.device)  # [T, D]
    if t:
        block = triton.next_power_of_2(d)
        _collapse_norm_kernel[(t,)](streams.contiguous(), pre.contiguous(), weight.contiguous(), out, inv_count(d),
                                    float(eps), N=n, D=d, BLOCK_D=block, PRECISE=PRECISE, num_warps=row_warps(block),
                                    enable_fp_fusion=False)
    return out


@triton.jit
def _post_kernel(out_ptr, res_ptr, post_ptr, comb_ptr, new_ptr, N: tl.constexpr, D: tl.constexpr,
                 BN: tl.constexpr, BLOCK_D: tl.constexpr, PRECISE: tl.constexpr):
    """One program per (token, block of D): new[i] = dtype(dtype(post[i] * out) + dtype(sum_k comb[k, i] * res[k]))
    for every stream i at once ([BN, BLOCK_D], padded streams masked), see hc_post_ref."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    ok = cols < D
    idx = tl.arange(0, BN)  # [BN] streams
    live = idx < N
    dtype = res_ptr.dtype.element_ty
    res = res_ptr + t * (N * D)
    o = tl.load(out_ptr + t * D + cols, mask=ok, other=0.0).to(tl.float32)  # [BLOCK_D]
    p = round_to(tl.load(post_ptr + t * N + idx, mask=live, other=0.0), dtype, PRECISE).to(tl.float32)  # [BN]
    spread = round_to(p[:, None] * o[None, :], dtype, PRECISE).to(tl.float32)  # [BN, BLOCK_D]
    mixed = tl.zeros([BN, BLOCK_D], tl.float32)
    for k in tl.static_range(N):  # comb[k, :] weighs residual stream k into every new stream
        c = round_to(tl.load(comb_ptr + t * (N * N) + k * N + idx, mask=live, other=0.0), dtype, PRECISE)
        r = tl.load(res + k * D + cols, mask=ok, other=0.0).to(tl.float32)  # [BLOCK_D]
        mixed = mixed + c.to(tl.float32)[:, None] * r[None, :]
    mixed = round_to(mixed, dtype, PRECISE).to(tl.float32)
    new = round_to(spread + mixed, dtype, PRECISE)  # [BN, BLOCK_D]
    tl.store(new_ptr + t * (N * D) + idx[:, None] * D + cols[None, :], new, mask=live[:, None] & ok[None, :])


def hc_post(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out [T, D], residual [T, N, D] of one dtype, post fp32 [T, N], comb fp32 [T, N, N] (on the device) ->
    new streams [T, N, D]: post[i] * out + sum_k comb[k, i] * residual[k] in the residual's dtype, one launch;
    twin: reference_mhc.hc_post_ref.

    No reduction runs along D, so a token's D columns are split over programs (still batch-invariant:
    every value depends on its own token only)."""
    t, n, d = _check_streams(residual)
    if out.dtype != residual.dtype or tuple(out.shape) != (t, d):
        raise ValueError(f"out must be {residual.dtype} [{t}, {d}], got {out.dtype} {tuple(out.shape)}")
    _check_fp32("post", post, (t, n))
    _check_fp32("comb", comb, (t, n, n))
    new = torch.empty(t, n, d, dtype=residual.dtype, device=residual.device)  # [T, N, D]
    if t:
        block = min(triton.next_power_of_2(d), POST_BLOCK)
        _post_kernel[(t, triton.cdiv(d, block))](out.contiguous(), residual.contiguous(), post.contiguous(),
                                                  comb.contiguous(), new, N=n, D=d, BN=triton.next_power_of_2(n),
                                                  BLOCK_D=block, PRECISE=PRECISE, num_warps=4, enable_fp_fusion=False)
    return new
