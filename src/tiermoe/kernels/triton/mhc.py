"""The mixing coefficients of a manifold-constrained hyper-connection (mHC) in one launch per sub-block.

`models/blocks/hyperconnection.py` turns each token's projection `mix` [T, (2+N)*N] into the weights
that collapse, spread and mix its N residual streams: two sigmoids, a softmax and a Sinkhorn loop
that makes the N x N mixing matrix doubly stochastic. In plain torch that is ~130 tiny kernels per
sub-block (20 Sinkhorn iterations, each two sums, two adds and two divides), and a model such as
glm5_next runs 90 sub-blocks per token: at decode every one of them costs a launch of a few
microseconds even when replayed from a CUDA graph, far more than the arithmetic. Here one program
per token does it all in registers.

The kernel takes mix in one of two forms (a constexpr switch): the mix rows themselves (`mhc_mix`), or
the partials of the projection that mhc_fused.hc_mix_coefficients writes, one per slice of a token's
flattened streams (`mhc_mix_partials`: dot products with fn's rows and a sum of squares). Then it first
adds the slices in one fixed order (a reduction tree set by their count alone, so a token's result does
not depend on the batch) and multiplies the dots by the flat RMS norm's rsqrt: the projection and the
coefficients cost two launches per sub-block, and no cuBLAS GEMV whose rounding varies with the row count.

From mix on, numerics follow the twin (`kernels.reference_mhc.mhc_mix_ref`, the torch code) operation by
operation, in the same order, so that a GPU run matches what eager torch on the GPU computes as closely as
the kernel can:
  - every product and sum is rounded on its own (launched with `enable_fp_fusion=False`: no FMA
    contraction, which eager torch does not do either);
  - divisions are IEEE (`tl.div_rn`; Triton's plain `/` on fp32 is an approximate division);
  - exp is CUDA's accurate `expf` (libdevice; `tl.exp` is `ex2.approx` on the GPU), sigmoid is
    1 / (1 + exp(-x)) as torch's CUDA kernel writes it. Triton links libdevice flushing subnormals:
    an exp below ~1e-38 becomes 0 where torch keeps a subnormal, which the + hc_eps after the
    softmax (and the 1 + in the sigmoid) absorbs either way;
  - the softmax denominator adds the exps pairwise, halving (the xor-butterfly order of torch's
    warp softmax for short rows), the Sinkhorn row and column sums add in index order.
Triton's interpreter (CPU tests) has no libdevice: there exp is numpy's, so interpreter runs differ
from the torch twin by float32 rounding (tests use a tight tolerance).

No host synchronisation, no data-dependent shapes: the launch is captured in a decode step's CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tiermoe.kernels.triton.precise import PRECISE, precise_exp, precise_rsqrt, precise_sigmoid

MAX_STREAMS = 8  # N up to 8: the [N, N] matrix of one token stays a handful of registers per lane


@triton.jit
def _col(c, idx, j):
    """Column j of c [BN, BN] as [BN] (rows), exactly: one value plus zeros per row."""
    return tl.sum(tl.where(idx[None, :] == j, c, 0.0), axis=1)


@triton.jit
def _row_sums(c, idx, N: tl.constexpr):
    """sum_j c[:, j] [BN] in index order: ((c0 + c1) + c2) + ..."""
    s = _col(c, idx, 0)
    for j in tl.static_range(1, N):
        s = s + _col(c, idx, j)
    return s


@triton.jit
def _col_sums(c, idx, N: tl.constexpr):
    """sum_i c[i, :] [BN] in index order: the row sums of c's transpose."""
    return _row_sums(tl.trans(c), idx, N)


@triton.jit
def _halving_row_sums(e, idx, BN: tl.constexpr):
    """sum_j e[:, j] [BN] pairwise, halving: column j + BN/2 onto column j, then BN/4, ..., the order of
    torch's warp softmax reduction for rows of up to 8 (padded columns hold 0, as torch's padded lanes)."""
    if BN == 1:
        s = _col(e, idx, 0)
    elif BN == 2:
        s = _col(e, idx, 0) + _col(e, idx, 1)
    elif BN == 4:
        s = (_col(e, idx, 0) + _col(e, idx, 2)) + (_col(e, idx, 1) + _col(e, idx, 3))
    else:
        s = (((_col(e, idx, 0) + _col(e, idx, 4)) + (_col(e, idx, 2) + _col(e, idx, 6)))
             + ((_col(e, idx, 1) + _col(e, idx, 5)) + (_col(e, idx, 3) + _col(e, idx, 7))))
    return s


@triton.jit
def _vec_from_splits(row, offs, ok, W: tl.constexpr, SPLITS: tl.constexpr, BS: tl.constexpr):
    """Columns offs [BN] of a token's partials [SPLITS, W + 1] summed over the splits -> [BN]: one tile, one
    reduction tree whose order depends on SPLITS alone (not on T)."""
    s = tl.arange(0, BS)  # [BS]
    p = tl.load(row + s[:, None] * (W + 1) + offs[None, :], mask=(s < SPLITS)[:, None] & ok[None, :], other=0.0)
    return tl.sum(p, axis=0)


@triton.jit
def _mat_from_splits(row, offs, ok, W: tl.constexpr, SPLITS: tl.constexpr, BS: tl.constexpr):
    """As _vec_from_splits for columns offs [BN, BN] -> [BN, BN]."""
    s = tl.arange(0, BS)[:, None, None]  # [BS, 1, 1]
    p = tl.load(row + s * (W + 1) + offs[None, :, :], mask=(s < SPLITS) & ok[None, :, :], other=0.0)
    return tl.sum(p, axis=0)


@triton.jit(do_not_specialize=["iters"])
def _mhc_mix_kernel(mix_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, hc_eps, iters, inv_l, norm_eps,
                    N: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr, BS: tl.constexpr,
                    PRECISE: tl.constexpr):
    """One program per token: its mix row [(2+N)*N] -> pre [N], post [N], comb [N, N] (see mhc_mix_ref).

    SPLITS == 0: mix_ptr holds mix [T, (2+N)*N]. SPLITS > 0: it holds the projection's partials
    [T, SPLITS, (2+N)*N + 1] (mhc_fused.hc_mix_coefficients: per slice of the flattened streams, the dot
    products with fn's rows and the sum of squares); they are summed over the splits here and the dots
    scaled by the flat norm's rsqrt(sum of squares * inv_l + norm_eps), which is the projection of the
    normed streams.

    Padded lanes (N < BN) never enter a sum: the softmax sees -inf there (exp 0, as torch's padded
    lanes), the Sinkhorn sums run over indices below N only, and nothing padded is stored."""
    t = tl.program_id(0).to(tl.int64)
    W: tl.constexpr = (2 + N) * N
    idx = tl.arange(0, BN)  # [BN]
    ok = idx < N  # [BN]
    ok2 = ok[:, None] & ok[None, :]  # [BN, BN]
    ij = idx[:, None] * N + idx[None, :]  # [BN, BN] offsets of comb[i, j]
    pre_s = tl.load(scale_ptr).to(tl.float32)
    post_s = tl.load(scale_ptr + 1).to(tl.float32)
    comb_s = tl.load(scale_ptr + 2).to(tl.float32)

    if SPLITS == 0:
        row = mix_ptr + t * W
        pre_w = tl.load(row + idx, mask=ok, other=0.0)  # [BN]
        post_w = tl.load(row + N + idx, mask=ok, other=0.0)  # [BN]
        comb_w = tl.load(row + 2 * N + ij, mask=ok2, other=0.0)  # [BN, BN]
    else:
        row = mix_ptr + t * (SPLITS * (W + 1))
        s = tl.arange(0, BS)  # [BS]
        sumsq = tl.sum(tl.load(row + s * (W + 1) + W, mask=s < SPLITS, other=0.0), axis=0)
        r = precise_rsqrt(sumsq * inv_l + norm_eps, PRECISE)
        pre_w = _vec_from_splits(row, idx, ok, W, SPLITS, BS) * r  # [BN]
        post_w = _vec_from_splits(row, N + idx, ok, W, SPLITS, BS) * r  # [BN]
        comb_w = _mat_from_splits(row, 2 * N + ij, ok2, W, SPLITS, BS) * r  # [BN, BN]

    pre_b = tl.load(base_ptr + idx, mask=ok, other=0.0).to(tl.float32)
    pre = precise_sigmoid(pre_w * pre_s + pre_b, PRECISE) + hc_eps
    post_b = tl.load(base_ptr + N + idx, mask=ok, other=0.0).to(tl.float32)
    post = 2.0 * precise_sigmoid(post_w * post_s + post_b, PRECISE)

    comb_b = tl.load(base_ptr + 2 * N + ij, mask=ok2, other=0.0).to(tl.float32)
    logits = tl.where(ok[None, :], comb_w * comb_s + comb_b, float("-inf"))  # padded rows stay finite
    top = tl.max(logits, axis=1)  # [BN]
    e = precise_exp(logits - top[:, None], PRECISE)  # [BN, BN]
    comb = tl.div_rn(e, _halving_row_sums(e, idx, BN)[:, None]) + hc_eps  # softmax over j, + eps
    comb = tl.div_rn(comb, (_col_sums(comb, idx, N) + hc_eps)[None, :])
    for _ in range(1, iters):  # Sinkhorn: rows, then columns
        comb = tl.div_rn(comb, (_row_sums(comb, idx, N) + hc_eps)[:, None])
        comb = tl.div_rn(comb, (_col_sums(comb, idx, N) + hc_eps)[None, :])

    tl.store(pre_ptr + t * N + idx, pre, mask=ok)
    tl.store(post_ptr + t * N + idx, post, mask=ok)
    tl.store(comb_ptr + t * (N * N) + ij, comb, mask=ok2)


def _check_params(base: torch.Tensor, scale: torch.Tensor, n: int) -> int:
    """The mixing parameters for n streams -> their width (2+N)*N."""
    if not 1 <= n <= MAX_STREAMS:
        raise ValueError(f"{n} streams: the kernel takes 1 to {MAX_STREAMS}")
    if base.numel() != (2 + n) * n or scale.numel() != 3:
        raise ValueError(f"base must hold {(2 + n) * n} values and scale 3, got {base.numel()} and {scale.numel()}")
    return (2 + n) * n


def _launch(src: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, hc_eps: float,
            splits: int, inv_l: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """src: mix [T, (2+N)*N] (splits 0) or partials [T, splits, (2+N)*N + 1] -> (pre, post, comb)."""
    t = src.shape[0]
    pre = torch.empty(t, n, dtype=torch.float32, device=src.device)  # [T, N]
    post = torch.empty(t, n, dtype=torch.float32, device=src.device)  # [T, N]
    comb = torch.empty(t, n, n, dtype=torch.float32, device=src.device)  # [T, N, N]
    if t:
        _mhc_mix_kernel[(t,)](src.contiguous(), base.contiguous(), scale.contiguous(), pre, post, comb,
                              float(hc_eps), int(iters), float(inv_l), float(norm_eps), N=n,
                              BN=triton.next_power_of_2(n), SPLITS=splits, BS=triton.next_power_of_2(max(splits, 1)),
                              PRECISE=PRECISE, num_warps=1, enable_fp_fusion=False)
    return pre, post, comb


def mhc_mix(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
            hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mix fp32 [T, (2+N)*N], base fp32 [(2+N)*N], scale fp32 [3] (on the device) ->
    (pre fp32 [T, N], post fp32 [T, N], comb fp32 [T, N, N]), one launch; twin: mhc_mix_ref.

    For a mix computed elsewhere; hyperconnection.py takes mhc_fused.hc_mix_coefficients, which hands this
    kernel the projection's partials instead (mhc_mix_partials). Reads base and scale on the device (no host
    sync) and allocates outputs of fixed shape for T: safe inside CUDA graph capture."""
    width = _check_params(base, scale, n)
    if mix.dtype != torch.float32 or mix.dim() != 2 or mix.shape[1] != width:
        raise ValueError(f"mix must be float32 [T, {width}], got {mix.dtype} {tuple(mix.shape)}")
    return _launch(mix, base, scale, n, iters, hc_eps, 0, 1.0, 0.0)


def mhc_mix_partials(partials: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
                     hc_eps: float, inv_l: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """partials fp32 [T, S, (2+N)*N + 1] (per slice s of a token's L flattened stream values: the dot products
    with the projection's (2+N)*N rows, then the sum of squares), base, scale as mhc_mix, inv_l = fp32(1 / L) ->
    (pre, post, comb) as mhc_mix of mix = rsqrt(sum of squares * inv_l + norm_eps) * dots, one launch.

    The S slices are added in one fixed order that depends on S alone, so a token's result does not depend on
    the other tokens or their count. Used by mhc_fused.hc_mix_coefficients, which writes the partials."""
    width = _check_params(base, scale, n)
    shape_ok = partials.dim() == 3 and partials.shape[1] >= 1 and partials.shape[2] == width + 1
    if partials.dtype != torch.float32 or not shape_ok:
        raise ValueError(f"partials must be float32 [T, S >= 1, {width + 1}], got {partials.dtype} "
                         f"{tuple(partials.shape)}")
    return _launch(partials, base, scale, n, iters, hc_eps, partials.shape[1], inv_l, norm_eps)
