"""Triton helpers both MoE kernels use: typed pointers into an expert record, exact int3/int4/int8
weight values; the block plan of the picks (moe_align), which the block kernel's launches of every
record layout share, and the pick-order sum (sum_pairs) that ends every path.

They live here, not in fused_moe.py, so that imports run one way: fused_moe.py (the block
kernel, and the entry point that picks a kernel) imports moe_gemv.py (the few-token kernel), and
both import this module; neither kernel module imports the other's internals. (fused_moe.py
re-exports moe_align and nb_max: callers and tests reach them there.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KIND_ID = {"bf16": 0, "int4": 1, "int8": 2, "int3": 3}  # the KIND constexpr of the kernels


@triton.jit
def int4_value(nib):
    """float32 (nib - 8) of int4 nibbles nib in 0..15, exactly, without an int -> float conversion
    (a slow instruction on NVIDIA GPUs, one per weight here): 2^23 + nib as float bits, minus
    2^23 + 8. Same values as `(nib - 8).to(float32)`, so the kernels' results do not change."""
    return (nib.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0


@triton.jit
def int8_value(q):
    """float32 of int8 weights q, exactly, by the same trick as int4_value (q + 128 in 0..255)."""
    return ((q.to(tl.int32) + 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def int3_value(lo, hi, C: tl.constexpr):
    """float32 (u - 4) of the int3 weight at position C of each element, exactly, without an
    int -> float conversion (as int4_value): lo holds the low two bits of positions 0, 1, ... at
    bits 2 * C, hi their high bits at bit C (int32 either; the record's two bit planes as loaded).

    The kernels pass C in 0..3 with lo = one low-plane byte and hi = its high-plane nibble, or C
    in 0..7 with lo = two consecutive low-plane bytes as one little-endian word and hi = one
    high-plane byte: the same function either way, so one helper serves both tile forms."""
    u = ((lo >> (2 * C)) & 3) | ((hi << 2 >> C) & 4)
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388612.0


@triton.jit
def record_pointers(base, Q_OFF: tl.constexpr, S_OFF: tl.constexpr, KIND: tl.constexpr):
    """Typed pointers to one matrix of the record at address `base` and to its bf16 scales.

    The 16-byte alignment hint goes on the record's base pointer, before the section offset is
    added: records are 4096-aligned and offsets (constexpr multiples of 256) keep that, which the
    compiler can then see. A hint on base + offset is lost for any nonzero offset, and every load
    of the down projection and of the scales came out unvectorized (byte loads)."""
    if KIND == 0:
        wp = tl.multiple_of(base.to(tl.pointer_type(tl.bfloat16)), 16) + Q_OFF // 2
    elif KIND == 1 or KIND == 3:  # int4 nibbles, int3 bit planes: bytes
        wp = tl.multiple_of(base.to(tl.pointer_type(tl.uint8)), 16) + Q_OFF
    else:
        wp = tl.multiple_of(base.to(tl.pointer_type(tl.int8)), 16) + Q_OFF
    sp = tl.multiple_of(base.to(tl.pointer_type(tl.bfloat16)), 16) + S_OFF // 2
    return wp, sp


# ----------------------------------------------------------------------------- the pick-order sum


@triton.jit
def _sum_pairs_kernel(y_ptr, out_ptr, K: tl.constexpr, H: tl.constexpr, BH: tl.constexpr):
    """out[t, :] = out dtype(y[t*K] + y[t*K+1] + ... ), strictly in pick order (bf16, or fp32: no rounding)."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BH + tl.arange(0, BH)
    ok = offs < H  # H need not be a multiple of BH (e.g. 2880)
    acc = tl.load(y_ptr + (t * K).to(tl.int64) * H + offs, mask=ok, other=0.0)
    for k in tl.static_range(1, K):
        acc += tl.load(y_ptr + (t * K + k).to(tl.int64) * H + offs, mask=ok, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * H + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def sum_pairs(y: torch.Tensor, t: int, k: int, h: int, out: torch.Tensor | None) -> torch.Tensor:
    """out [T, H] = each token's K rows of y fp32 [T * K, H] summed in pick order, rounded once to out's dtype:
    bf16 (the default), or fp32, which keeps the sum unrounded so that fast mode can add the CPU lane's fp32
    part before the one rounding exact mode makes (moe/device_cache.lane_forward)."""
    if out is None:
        out = torch.empty(t, h, dtype=torch.bfloat16, device=y.device)
    if out.dtype not in (torch.bfloat16, torch.float32) or out.shape != (t, h):
        raise ValueError(f"out must be bf16 or fp32 [{t}, {h}], got {out.dtype} {tuple(out.shape)}")
    bh = min(1024, triton.next_power_of_2(h))
    _sum_pairs_kernel[(t, triton.cdiv(h, bh))](y, out, K=k, H=h, BH=bh)
    return out


# ----------------------------------------------------------------------------- the block plan


@triton.jit(do_not_specialize=["P", "NB"])  # counts of a step's picks: one compile for every step (kernels README)
def _align_small_kernel(
    ids_ptr, P, sorted_pairs_ptr, block_expert_ptr, NB, BM: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_NB: tl.constexpr
):
    """One program: canonical block plan when every expert has at most BM picks."""
    offs = tl.arange(0, BLOCK_P)
    ok = offs < P
    ids = tl.load(ids_ptr + offs, mask=ok, other=-1)
    same = (ids[:, None] == ids[None, :]) & ok[:, None] & ok[None, :]  # [BP, BP]
    earlier = offs[None, :] < offs[:, None]  # j < i
    rank = tl.sum((same & earlier).to(tl.int32), axis=1)  # picks of my expert before me
    first = ok & (rank == 0)
    first_pos = tl.min(tl.where(same, offs[None, :], BLOCK_P), axis=1)  # my expert's first pick
    uidx = tl.sum((first[None, :] & (offs[None, :] < first_pos[:, None])).to(tl.int32), axis=1)
    n_u = tl.sum(first.to(tl.int32), axis=0)
    offs_nb = tl.arange(0, BLOCK_NB)
    # fill, then scatter (one CTA: the barrier orders the two phases)
    for r in tl.static_range(BM):
        tl.store(sorted_pairs_ptr + offs_nb * BM + r, P, mask=offs_nb < NB)
    tl.store(block_expert_ptr + offs_nb, -1, mask=(offs_nb >= n_u) & (offs_nb < NB))
    tl.debug_barrier()
    tl.store(block_expert_ptr + uidx, ids, mask=first)
    tl.store(sorted_pairs_ptr + uidx * BM + rank, offs, mask=ok)


def nb_max(num_pairs: int, num_experts: int, block_m: int, tokens: int) -> int:
    """Upper bound on blocks of the plan (fixed, so the plan's shape never depends on data)."""
    used = min(num_pairs, num_experts)
    return used if tokens <= block_m else used + num_pairs // block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block plan of the picks (see reference.moe_align_ref): (sorted_pairs, block_expert).

    topk_ids [T, K] integer rows of the pointer table; a token must not pick an expert twice.
    No host synchronisation, fixed output shapes: safe inside CUDA graph capture.
    """
    t, k = topk_ids.shape
    p = t * k
    nb = nb_max(p, num_experts, block_m, t)
    dev = topk_ids.device
    if t <= block_m and p <= 256:
        sorted_pairs = torch.empty(nb * block_m, dtype=torch.int32, device=dev)
        block_expert = torch.empty(nb, dtype=torch.int32, device=dev)
        ids = topk_ids.reshape(-1).to(torch.int32)
        bp = max(16, triton.next_power_of_2(p))
        _align_small_kernel[(1,)](
            ids,
            p,
            sorted_pairs,
            block_expert,
            nb,
            BM=block_m,
            BLOCK_P=bp,
            BLOCK_NB=max(16, triton.next_power_of_2(nb)),
            num_warps=4 if bp <= 64 else 8,
        )
        return sorted_pairs, block_expert
    return _align_torch(topk_ids, num_experts, block_m, nb)


def _align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int, nb: int) -> tuple[torch.Tensor, torch.Tensor]:
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).to(torch.int64)  # [P]
    p = ids.numel()
    e = num_experts
    pos = torch.arange(p, device=dev)
    first = torch.full((e,), p, dtype=torch.int64, device=dev).scatter_reduce_(0, ids, pos, "amin")  # [E]
    counts = torch.zeros(e, dtype=torch.int64, device=dev).scatter_add_(0, ids, torch.ones_like(ids))  # [E]
    nblk = (counts + block_m - 1) // block_m  # [E]
    order = torch.sort(first, stable=True).indices  # experts by first pick, unused last
    nblk_sorted = nblk[order]
    blk_end_sorted = torch.cumsum(nblk_sorted, 0)  # [E]
    blk_start = torch.empty_like(nblk).scatter_(0, order, blk_end_sorted - nblk_sorted)  # [E]
    by_id = torch.sort(ids, stable=True).indices  # pairs grouped by expert, ascending
    grp_start = torch.cumsum(counts, 0) - counts  # [E]
    rank = torch.empty_like(ids).scatter_(0, by_id, pos - grp_start[ids[by_id]])  # [P]
    dest = blk_start[ids] * block_m + rank  # [P]
    sorted_pairs = torch.full((nb * block_m,), p, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, pos.to(torch.int32))
    j = torch.searchsorted(blk_end_sorted, torch.arange(nb, device=dev), right=True)  # [NB]
    block_expert = torch.where(j < e, order[j.clamp(max=e - 1)], -1).to(torch.int32)
    return sorted_pairs, block_expert
