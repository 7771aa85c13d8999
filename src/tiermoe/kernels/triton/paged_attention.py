"""Paged decode attention with static launch shapes: one query token per sequence.

Why: in a decode step, attention over each sequence's context is the one piece whose shapes
change every step (the context grows by a token), so runner/decode_graph.py has to leave it
eager between graph pieces: about one graph launch plus an eager attention core per layer.
This kernel reads the context through a block table and a device-side length, so its launch
depends only on the batch size and the table width, and a whole decode step can be one
CUDA graph.

Split-K ("flash decoding"): the grid is (sequence, KV head, split). Each program takes its KV
head's G = Hq / Hk query heads over one contiguous share of the sequence's pages, with an
online softmax in fp32; a second kernel merges the splits. The split count depends only on the
KV heads and the table width (enough programs to fill the GPU at batch 1), never on the batch,
so a sequence's bits do not depend on what else is batched with it; short contexts leave some
splits empty.

Numerics (the twin is kernels/reference.py `paged_decode_attention_ref`): scores =
fp32(q . k) * scale, softmax in fp32, probabilities rounded to the cache dtype before
p @ v with fp32 accumulation (as flash attention does); outputs in q's dtype. Through
Triton's interpreter (CPU tests) every dot runs in fp32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _split_kernel(
    q_ptr,  # [B, HQ, D] query rows of this step
    k_ptr,  # [slots, HK, D] flat key cache (slot = page * PAGE + offset)
    v_ptr,  # [slots, HK, D] flat value cache
    table_ptr,  # [B, MAX_BLOCKS] int32 page of each block of each sequence
    lens_ptr,  # [B] int32 context length (this step's token included)
    acc_ptr,  # [B, HQ, S, BD] fp32 out: unnormalised partial outputs
    ml_ptr,  # [B, HQ, S, 2] fp32 out: running max and running sum of each split
    scale,
    MAX_BLOCKS: tl.constexpr,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    BD: tl.constexpr,
    G: tl.constexpr,
    BG: tl.constexpr,
    PAGE: tl.constexpr,
    S: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    n = tl.load(lens_ptr + b)
    n_blocks = tl.cdiv(n, PAGE)
    per = tl.cdiv(n_blocks, S)
    blk0 = s * per
    blk1 = tl.minimum(blk0 + per, n_blocks)
    g = tl.arange(0, BG)
    d = tl.arange(0, BD)
    t = tl.arange(0, PAGE)
    g_ok = g < G
    d_ok = d < D
    qh = h * G + g  # [BG] query heads served by KV head h
    q = tl.load(q_ptr + (b * HQ + qh)[:, None] * D + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    m = tl.full([BG], float("-inf"), tl.float32)
    l_sum = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BD], tl.float32)
    for blk in range(blk0, blk1):
        page = tl.load(table_ptr + b * MAX_BLOCKS + blk).to(tl.int64)
        t_ok = blk * PAGE + t < n  # [PAGE]
        rows = page * PAGE + t  # [PAGE] flat cache slots
        off = (rows * HK + h)[:, None] * D + d[None, :]  # [PAGE, BD]
        kv_ok = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + off, mask=kv_ok, other=0.0)  # [PAGE, BD]
        v = tl.load(v_ptr + off, mask=kv_ok, other=0.0)  # [PAGE, BD]
        if DOT_F32:
            sc = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))  # [BG, PAGE] fp32
        sc = tl.where(t_ok[None, :], sc * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(sc - m_new[:, None])  # [BG, PAGE]
        l_sum = l_sum * alpha + tl.sum(p, 1)
        if DOT_F32:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)  # [BG, BD] fp32
        acc = acc * alpha[:, None] + pv
        m = m_new
    base = (b * HQ + qh) * S + s  # [BG]
    tl.store(acc_ptr + base[:, None] * BD + d[None, :], acc, mask=g_ok[:, None])
    tl.store(ml_ptr + base * 2, m, mask=g_ok)
    tl.store(ml_ptr + base * 2 + 1, l_sum, mask=g_ok)


@triton.jit
def _merge_kernel(
    acc_ptr,  # [B, HQ, S, BD] fp32
    ml_ptr,  # [B, HQ, S, 2] fp32
    out_ptr,  # [B, HQ, D]
    D: tl.constexpr,
    BD: tl.constexpr,
    S: tl.constexpr,
    BS: tl.constexpr,
):
    row = tl.program_id(0)  # b * HQ + query head
    s = tl.arange(0, BS)
    d = tl.arange(0, BD)
    s_ok = s < S
    m = tl.load(ml_ptr + (row * S + s) * 2, mask=s_ok, other=float("-inf"))  # [BS]
    l_sum = tl.load(ml_ptr + (row * S + s) * 2 + 1, mask=s_ok, other=0.0)
    top = tl.max(m, 0)
    top = tl.where(top > float("-inf"), top, 0.0)  # every split empty (no context): no inf - inf
    w = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)  # empty splits weigh nothing
    acc = tl.load(acc_ptr + (row * S + s)[:, None] * BD + d[None, :], mask=s_ok[:, None], other=0.0)  # [BS, BD]
    den = tl.sum(l_sum * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(den > 0, den, 1.0)  # an empty context gives 0, not NaN
    tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def num_splits(kv_heads: int, max_blocks: int) -> int:
    """Splits per (sequence, KV head): about 256 programs per sequence, at most 32, at most the
    blocks. Not a function of the batch size (batch invariance, see the module doc)."""
    return max(1, min(32, 256 // max(1, kv_heads), max_blocks))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, page_size: int) -> torch.Tensor:
    """q [B, Hq, D]; k/v_cache [slots, Hk, D]; block_table [B, max_blocks] int32; seq_lens [B]
    int32 (>= 1) -> [B, Hq, D] in q's dtype. No host sync; shapes fixed by B and max_blocks."""
    bsz, hq, dim = q.shape
    hk = k_cache.shape[1]
    if hq % hk:
        raise ValueError(f"query heads {hq} not a multiple of KV heads {hk}")
    if page_size < 16 or page_size & (page_size - 1):
        raise ValueError(f"paged decode attention needs a power-of-two page size >= 16, not {page_size}")
    max_blocks = block_table.shape[1]
    g = hq // hk
    bg, bd = max(16, triton.next_power_of_2(g)), max(16, triton.next_power_of_2(dim))
    splits = num_splits(hk, max_blocks)
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    acc = torch.empty(bsz, hq, splits, bd, dtype=torch.float32, device=q.device)
    ml = torch.empty(bsz, hq, splits, 2, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    dot_f32 = _INTERPRET or q.dtype == torch.float32
    _split_kernel[(bsz, hk, splits)](
        q, k_cache, v_cache, block_table, seq_lens, acc, ml, float(scale),
        MAX_BLOCKS=max_blocks, HQ=hq, HK=hk, D=dim, BD=bd, G=g, BG=bg, PAGE=page_size, S=splits, DOT_F32=dot_f32,
    )
    _merge_kernel[(bsz * hq,)](acc, ml, out, D=dim, BD=bd, S=splits, BS=max(2, triton.next_power_of_2(splits)))
    return out
