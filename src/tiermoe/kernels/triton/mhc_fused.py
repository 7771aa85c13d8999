"""The torch ops around each mHC sub-block, fused: four launches per sub-block instead of ~150.

models/blocks/hyperconnection.py wraps each sub-block (attention, FFN) of glm5_next in a hyper-connection
over N residual streams [T, N, D]. In eager torch each sub-block is a dozen tiny kernels besides the ~130 of
the mixing coefficients: the fp32 cast and unweighted RMS norm of the flattened streams, their fp32
projection by fn [(2+N)*N, N*D], the collapse to the sub-block input and its weighted RMSNorm, and the spread
of the output plus the N x N mix of the residual. At decode each is a launch of a few microseconds even
replayed from a CUDA graph, and glm5_next runs 90 sub-blocks per token. Here:

  hc_mix_coefficients(streams, fn, ...)     -> pre, post, comb  flat norm + projection + mhc.py's mixing, 2 launches
  hc_collapse_norm(streams, pre, w, eps)    -> [T, D]           collapse + weighted RMSNorm (one per token)
  hc_post(out, residual, post, comb)        -> [T, N, D]        the new streams (one per token and D block)

hc_mix_coefficients splits the projection over K: at glm5_next's size the fp32 weight is 24 x 16384 (1.5 MB)
and a token holds 16384 values, so one program per token would read the weight from one SM. Instead each
program takes a slice of a token's values (grid T x S, S = 64 there) with the matching columns of fn, and
writes its partial dot products and sum of squares to a small fp32 workspace; mhc.py's kernel adds the S
partials in a fixed order, scales the dots by the norm's rsqrt(sum of squares / (N*D) + eps) (the
projection of the normed vector, one multiply instead of one per value) and computes the coefficients. The
fp32 values are not cuBLAS's bit for bit (another summation order, FMA contraction allowed in the dots):
they match the twin to fp32 rounding. What cuBLAS cannot give is kept instead: a token's result does not
depend on T or the other tokens, so the coefficients of a token verified in a batch of draft tokens are
those it gets decoded alone.

Twins: kernels/reference_mhc.py (hc_mix_coefficients_ref, hc_collapse_norm_ref, hc_post_ref), the CPU path.
hc_collapse_norm and hc_post follow the twins operation by operation, as eager torch computes them on a
CUDA device (norm.py's conventions: mean as sum times fp32(1 / count), libdevice rsqrt, no FMA contraction,
round-to-nearest-even casts where torch casts). The collapse and the mix add the streams in index
order, as torch's reduction over the stream dimension and a K = N matmul do; bf16 x bf16 products are
exact in fp32, so at bf16 only the order of those few additions could differ from cuBLAS. The sums of
squares run in a tree of their own: their last bit may differ from torch's, which moves a rare element of
a bf16 result by one ulp (fp32 results by a few fp32 ulps).

Each token's result depends on that token alone (batch-invariant), no host synchronisation, outputs and
workspaces of fixed shape for T: the launches are captured in a decode step's CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tiermoe.kernels.triton.mhc import MAX_STREAMS, mhc_mix_partials
from tiermoe.kernels.triton.norm import (MAX_DIM, PRECISE, check_dtype, inv_count, round_to, row_warps,
                                         weighted_rms_norm_row)

PROJ_SPLITS = 64  # most programs per token for the projection: glm5_next's 1.5 MB weight read by 64 SMs at once
PROJ_MIN_SLICE = 64  # fewest values of a token per projection program (narrow streams take fewer programs)
PROJ_BLOCK = 128  # values per step of a projection program: a [32, 128] fp32 weight tile over 4 warps
POST_BLOCK = 512  # columns of D per hc_post program: D = 4096 spreads one token over 8 programs


@triton.jit
def _proj_partials_kernel(x_ptr, fn_ptr, ws_ptr, L: tl.constexpr, W: tl.constexpr, BW: tl.constexpr,
                          SPLITS: tl.constexpr, SLICE: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (token, slice of SLICE values of its flattened streams x [L]): the dot products of the
    slice with the same columns of fn's W rows ([W, L]) and its sum of squares -> ws[t, k] [W + 1], fp32.

    Each value's products accumulate in a [BW, BLOCK] tile over the slice's steps, then one reduction tree
    along the columns: the same order for every token whatever T is. Launched with FMA contraction (named, not
    left to Triton's changing default): the dots need not round as cuBLAS does, only the same for every T."""
    t = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1)
    rows = tl.arange(0, BW)  # [BW] rows of fn, padded to a power of two
    live = rows < W
    acc = tl.zeros([BW, BLOCK], tl.float32)
    sq = tl.zeros([BLOCK], tl.float32)
    for start in tl.static_range(0, SLICE, BLOCK):
        cols = k * SLICE + start + tl.arange(0, BLOCK)  # [BLOCK]
        ok = cols < L
        x = tl.load(x_ptr + t * L + cols, mask=ok, other=0.0).to(tl.float32)  # [BLOCK]
        w = tl.load(fn_ptr + rows[:, None] * L + cols[None, :], mask=live[:, None] & ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]  # [BW, BLOCK]
        sq += x * x
    out = ws_ptr + (t * SPLITS + k) * (W + 1)
    tl.store(out + rows, tl.sum(acc, axis=1), mask=live)
    tl.store(out + W, tl.sum(sq, axis=0))


def _check_streams(streams: torch.Tensor) -> tuple[int, int, int]:
    check_dtype("streams", streams)
    if streams.dim() != 3 or not 1 <= streams.shape[1] <= MAX_STREAMS:
        raise ValueError(f"streams must be [T, N, D] with N of 1 to {MAX_STREAMS}, got {tuple(streams.shape)}")
    return streams.shape[0], streams.shape[1], streams.shape[2]


def _check_fp32(name: str, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    if x.dtype != torch.float32 or tuple(x.shape) != shape:
        raise ValueError(f"{name} must be float32 {list(shape)}, got {x.dtype} {tuple(x.shape)}")


def hc_mix_coefficients(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float, base: torch.Tensor,
                        scale: torch.Tensor, n: int, iters: int,
                        hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, N, D], fn [(2+N)*N, N*D] (fp32 as the model hands it; bf16 or fp16 are read as their exact fp32
    values), base fp32 [(2+N)*N], scale fp32 [3] (on the device) -> (pre fp32 [T, N], post fp32 [T, N],
    comb fp32 [T, N, N]) in two launches; twin: reference_mhc.hc_mix_coefficients_ref.

    Launch 1 splits each token's L = N*D values into slices, one program each, and writes per slice the dot
    products with fn's rows and the sum of squares (a fp32 workspace [T, S, (2+N)*N + 1]); launch 2 (mhc.py)
    adds the slices in a fixed order, scales the dots by the flat norm's rsqrt and computes the coefficients.
    The workspace has a fixed shape for T and nothing is read back on the host: CUDA-graph capturable."""
    t, n_streams, d = _check_streams(streams)
    if n_streams != n:
        raise ValueError(f"streams hold {n_streams} streams, n is {n}")
    width, length = (2 + n) * n, n * d
    check_dtype("fn", fn)
    if tuple(fn.shape) != (width, length):
        raise ValueError(f"fn must be [{width}, {length}], got {tuple(fn.shape)}")
    piece = max(PROJ_MIN_SLICE, triton.next_power_of_2(triton.cdiv(length, PROJ_SPLITS)))
    splits = triton.cdiv(length, piece)
    ws = torch.empty(t, splits, width + 1, dtype=torch.float32, device=streams.device)  # [T, S, (2+N)*N + 1]
    if t:
        _proj_partials_kernel[(t, splits)](streams.contiguous(), fn.contiguous(), ws, L=length, W=width,
                                           BW=triton.next_power_of_2(width), SPLITS=splits, SLICE=piece,
                                           BLOCK=min(piece, PROJ_BLOCK), num_warps=4, enable_fp_fusion=True)
    return mhc_mix_partials(ws, base, scale, n, iters, hc_eps, inv_count(length), norm_eps)


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
