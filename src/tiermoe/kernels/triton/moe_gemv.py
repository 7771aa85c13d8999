"""Decode-shape MoE projections as one matrix-vector product per (pick, row slice) (Triton).

At decode a batch of T <= 4 tokens gives each expert one or a few picks, and the block GEMM of
fused_moe.py pads every expert's block to BLOCK_M >= 16 rows for its tensor-core dots, so a
tuned int4 decode layer streams its weights far below the HBM copy rate (docs/results.md has
the measurement), while a decode step is a pure weight stream.
Here each program takes one pick p (expert e = ptr_table row ids[p]) and BLOCK_N output rows,
streams those rows' weights once along K (k contiguous in the record, so every load is a run
of contiguous bytes), multiplies them with the pick's activation row in fp32 registers and
reduces once at the end. No block plan (moe_align) is needed: the pick order is the grid.
int3 rows are read as words of 8 columns (two low-plane bytes as one 16-bit load, one high-plane
byte), so both planes stream as contiguous runs; the activation row is split into 8 phases.

Numerics, as in the block kernel and kernels/reference.py: each weight is dequantized to
bf16(float32(q) * float32(scale)), products and sums are fp32, act = bf16(silu(g) * u), the
down projection times the routing weight is fp32 and `_sum_pairs_kernel` sums a token's picks
in pick order. Only the summation order inside one dot product differs from the block kernel,
so results agree with the twin to rounding; every tier reads the same bytes through the same
kernel and configuration, so exact mode stays bit-identical across budgets.

A weight is re-read once per pick of its expert (no sharing across a block's tokens), so this
wins only for few tokens: the tuned decode configuration says up to how many
(`configs.json`, decode bucket, "gemv": {..., "max_tokens": n}; `tiermoe bench tune-moe`).
Like the decode/prefill bucket boundary, that switch makes a sequence's rounding depend on how
many tokens share its step (a tuned GPU at C1 vs C4); batch invariance is not promised, and
every tier of one step still runs the same kernel, so exactness across budgets holds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tiermoe.kernels.layout import ExpertLayout
from tiermoe.kernels.triton.common import KIND_ID, int3_value, int4_value, int8_value, record_pointers


@triton.jit
def _dequant_nk(qf, s_row, k0, BN: tl.constexpr, C: tl.constexpr, G: tl.constexpr, BK: tl.constexpr):
    """bf16(q * scale) as fp32 for an n-major tile qf fp32 [BN, C] whose C columns cover K
    columns k0 .. k0 + BK (C = BK/2 for int4: one byte, two columns, per tile column).

    s_row [BN]: each output row's first scale. A tile within one group (BK <= G) takes one
    scale per row; a tile spanning BK / G groups loads [BN, BK / G] scales (16-byte runs, not a
    gather per column) and applies them to column groups of C * G / BK through a reshape.
    """
    if BK > G:
        s = tl.load(s_row[:, None] + (k0 // G + tl.arange(0, BK // G))[None, :]).to(tl.float32)  # [BN, BK/G]
        w = tl.reshape(tl.reshape(qf, (BN, BK // G, C * G // BK)) * s[:, :, None], (BN, C))
    else:
        w = qf * tl.load(s_row + k0 // G).to(tl.float32)[:, None]
    return w.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _scales_nk(s_row, k0, BN: tl.constexpr, C: tl.constexpr, G: tl.constexpr, BK: tl.constexpr):
    """fp32 scales of an n-major tile [BN, C] whose C columns cover K columns k0 .. k0 + BK in
    order (each column within one group): [BN, C] for a tile spanning BK / G groups (loaded as
    [BN, BK / G] runs, repeated over each group's C * G / BK columns), else [BN, 1].

    Loaded once for a tile that several phase tiles share (int3's eight), where `_dequant_nk`
    would load them once per phase."""
    if BK > G:
        s = _scales_nk_groups(s_row, k0, BN, C, G, BK)
    else:
        s = tl.load(s_row + k0 // G).to(tl.float32)[:, None]
    return s


@triton.jit
def _scales_nk_groups(s_row, k0, BN: tl.constexpr, C: tl.constexpr, G: tl.constexpr, BK: tl.constexpr):
    """[BN, C] fp32: each tile column's group scale (a tile spanning BK / G groups)."""
    s = tl.load(s_row[:, None] + (k0 // G + tl.arange(0, BK // G))[None, :]).to(tl.float32)  # [BN, BK/G]
    return tl.reshape(tl.broadcast_to(s[:, :, None], (BN, BK // G, C * G // BK)), (BN, C))


@triton.jit
def _split8(x, BK: tl.constexpr):
    """Activation row x [BK] -> its eight phases [BK/8] (phase c: columns 8m + c)."""
    r0, r1 = tl.split(tl.reshape(x, (BK // 8, 2, 2, 2)))  # [BK/8, 2, 2]: columns 8m + 4p + 2q (+ 1)
    q00, q01 = tl.split(r0)  # [BK/8, 2]: columns 8m + 4p (+ 2)
    q10, q11 = tl.split(r1)  # columns 8m + 4p + 1 (+ 2)
    x0, x4 = tl.split(q00)
    x2, x6 = tl.split(q01)
    x1, x5 = tl.split(q10)
    x3, x7 = tl.split(q11)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _int3_phase(lo, hi, s, C: tl.constexpr):
    """bf16(q * scale) as fp32 of phase C (columns 8m + C) of an int3 tile of words (int32)."""
    return (int3_value(lo, hi, C) * s).to(tl.bfloat16).to(tl.float32)


@triton.jit
def _dot_rows(wp, sp, a_ptr, offs_n, k0, KD: tl.constexpr, G: tl.constexpr, KIND: tl.constexpr,
              BN: tl.constexpr, BK: tl.constexpr):
    """[BN, BK] fp32 products of one K tile ([BN, BK/2] for int4, [BN, BK/8] for int3: one
    column a byte or word): rows offs_n of the matrix at wp (scales at sp) times the activation
    row at a_ptr (columns k0 .. k0 + BK)."""
    n64 = offs_n.to(tl.int64)
    x = tl.load(a_ptr + k0 + tl.arange(0, BK)).to(tl.float32)  # [BK], one contiguous run
    if KIND == 1:  # int4: low nibble = even column
        offs_kh = tl.arange(0, BK // 2)
        q = tl.load(wp + n64[:, None] * (KD // 2) + (k0 // 2 + offs_kh)[None, :])  # [BN, BK/2] u8
        x_even, x_odd = tl.split(tl.reshape(x, (BK // 2, 2)))  # [BK/2] each
        s_row = sp + n64 * (KD // G)
        w_lo = _dequant_nk(int4_value(q & 15), s_row, k0, BN, BK // 2, G, BK)
        w_hi = _dequant_nk(int4_value(q >> 4), s_row, k0, BN, BK // 2, G, BK)
        prod = w_lo * x_even[None, :] + w_hi * x_odd[None, :]
    elif KIND == 3:
        # int3: tile column m covers columns 8m .. 8m + 7: low-plane bytes 2m and 2m + 1 loaded as
        # one little-endian 16-bit word (low bits of column 8m + c at bits 2c), high-plane byte m
        # (high bit at bit c); both runs contiguous. check_gemv_config keeps them aligned.
        row3: tl.constexpr = 3 * KD // 8  # bytes of one stored row
        offs_w = tl.arange(0, BK // 8)
        lo_p = wp.to(tl.pointer_type(tl.uint16)) + n64[:, None] * (row3 // 2) + (k0 // 8 + offs_w)[None, :]
        lo = tl.load(lo_p).to(tl.int32)  # [BN, BK/8]
        hi = tl.load(wp + n64[:, None] * row3 + (KD // 4 + k0 // 8 + offs_w)[None, :]).to(tl.int32)  # [BN, BK/8]
        s = _scales_nk(sp + n64 * (KD // G), k0, BN, BK // 8, G, BK)  # [BN, BK/8 or 1]
        x0, x1, x2, x3, x4, x5, x6, x7 = _split8(x, BK)  # [BK/8] each
        prod = _int3_phase(lo, hi, s, 0) * x0[None, :] + _int3_phase(lo, hi, s, 1) * x1[None, :]
        prod += _int3_phase(lo, hi, s, 2) * x2[None, :] + _int3_phase(lo, hi, s, 3) * x3[None, :]
        prod += _int3_phase(lo, hi, s, 4) * x4[None, :] + _int3_phase(lo, hi, s, 5) * x5[None, :]
        prod += _int3_phase(lo, hi, s, 6) * x6[None, :] + _int3_phase(lo, hi, s, 7) * x7[None, :]
    else:
        w_offs = n64[:, None] * KD + (k0 + tl.arange(0, BK))[None, :]  # [BN, BK] elements
        if KIND == 0:
            w = tl.load(wp + w_offs).to(tl.float32)
        else:
            w = _dequant_nk(int8_value(tl.load(wp + w_offs)), sp + n64 * (KD // G), k0, BN, BK, G, BK)
        prod = w * x[None, :]
    return prod


@triton.jit
def _moe_gemv_kernel(
    a_ptr,  # [rows, KD] bf16: x (row = pair // A_DIV) or act (row = pair)
    out_ptr,  # GATED: act [P, N] bf16; else y [P, N] fp32
    ids_ptr,  # [P] int32 pointer-table row of each pair
    ptr_table_ptr,  # [E] int64 record addresses
    kinds_ptr,  # [E] int8/int32 layout index of each table row (read only when SEL >= 0)
    weights_ptr,  # [P] fp32 routing weights (not GATED)
    A_DIV,
    LIMIT,  # SwiGLU clamp (used when CLAMP)
    Q_OFF: tl.constexpr,  # byte offset of the weight matrix in the record
    S_OFF: tl.constexpr,  # byte offset of its scales (quantized kinds)
    N: tl.constexpr,  # output rows of one matrix (I when GATED, else H)
    KD: tl.constexpr,  # reduction dim
    G: tl.constexpr,  # group size (quantized kinds)
    KIND: tl.constexpr,  # 0 bf16, 1 int4, 2 int8, 3 int3
    GATED: tl.constexpr,
    CLAMP: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    KW: tl.constexpr,  # accumulator width: a tile's (BK // 2 for int4, BK // 8 for int3, else BK; reduced
    # once at the end: fewer reductions, more registers) or 1 (each tile reduced into [BN, 1] as it comes)
    SEL: tl.constexpr,  # -1: every record has this layout; else only picks whose expert's kinds entry is SEL
):
    p = tl.program_id(0)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN]
    e = tl.load(ids_ptr + p)
    if SEL >= 0:  # a mixed store: a pick of another layout's expert is that launch's
        if tl.load(kinds_ptr + e).to(tl.int32) != SEL:
            return
    base = tl.load(ptr_table_ptr + e)
    wp, sp = record_pointers(base, Q_OFF, S_OFF, KIND)
    a_row = a_ptr + (p // A_DIV).to(tl.int64) * KD
    if KIND == 0:
        up_w = N * KD  # elements
    elif KIND == 1:
        up_w = N * (KD // 2)  # bytes
    elif KIND == 3:
        up_w = N * (3 * KD // 8)  # bytes
    else:
        up_w = N * KD
    up_s = N * (KD // G)
    acc = tl.zeros((BN, KW), dtype=tl.float32)
    acc_u = tl.zeros((BN, KW), dtype=tl.float32)
    for k0 in range(0, KD, BK):
        prod = _dot_rows(wp, sp, a_row, offs_n, k0, KD, G, KIND, BN, BK)
        if KW == 1:
            acc += tl.sum(prod, axis=1, keep_dims=True)
        else:
            acc += prod
        if GATED:
            prod_u = _dot_rows(wp + up_w, sp + up_s, a_row, offs_n, k0, KD, G, KIND, BN, BK)
            if KW == 1:
                acc_u += tl.sum(prod_u, axis=1, keep_dims=True)
            else:
                acc_u += prod_u
    g = tl.sum(acc, axis=1)  # [BN]
    out_offs = p.to(tl.int64) * N + offs_n
    if GATED:
        u = tl.sum(acc_u, axis=1)
        if CLAMP:
            g = tl.minimum(g, LIMIT)
            u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
        act = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + out_offs, act.to(tl.bfloat16))
    else:
        wt = tl.load(weights_ptr + p)
        tl.store(out_ptr + out_offs, g * wt)


def check_gemv_config(layout: ExpertLayout, cfg: dict) -> None:
    """BN must divide each stage's rows, BK its reduction dim; BK and the group size must
    divide one another (quantized kinds); int4 needs BK >= 2; "acc" is "tile" (default) or "row".

    int3 reads a tile as words of 8 columns (two low-plane bytes as one 16-bit load, one
    high-plane byte): BK a multiple of 8, the reduction dim of 16 (so every row's 16-bit loads are
    aligned) and, for tiles spanning several groups, a group size that is a multiple of 8."""
    for stage, (n, kd) in (("gate_up", (layout.inter, layout.hidden)), ("down", (layout.hidden, layout.inter))):
        c = cfg[stage]
        if c.get("acc", "tile") not in ("tile", "row"):
            raise ValueError(f"gemv {stage}: acc={c['acc']!r}: choose tile or row")
        if n % c["BN"] or kd % c["BK"] or (layout.kind == "int4" and c["BK"] < 2):
            raise ValueError(f"gemv {stage}: BN={c['BN']}/BK={c['BK']} must divide N={n}/K={kd}")
        if layout.kind != "bf16" and layout.group_size % c["BK"] and c["BK"] % layout.group_size:
            raise ValueError(
                f"gemv {stage}: BK={c['BK']} and the group size {layout.group_size} must divide one another"
            )
        g = layout.group_size
        if layout.kind == "int3" and (c["BK"] % 8 or kd % 16 or (c["BK"] > g and g % 8)):
            raise ValueError(
                f"gemv {stage}: int3 needs BK={c['BK']} a multiple of 8, K={kd} a multiple of 16 and, for "
                f"tiles spanning several groups, a group size ({g}) that is a multiple of 8"
            )


def moe_projections_gemv(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    ptr_table: torch.Tensor,
    layout: ExpertLayout,
    cfg: dict,
    k: int,
    swiglu_limit: float | None,
    *,
    kinds: tuple[torch.Tensor, int] | None = None,
    act: torch.Tensor | None = None,
    y: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated and down projections of every pick: y fp32 [P, H] (routing weight applied).

    x [T, H] bf16; ids [P] int32 pointer-table rows (P = T * k, pick order); weights [P] fp32.
    Fixed shapes, no host sync (graph-capturable).

    kinds = (kind table int8/int32 [E] on the device, index): a mixed store's launches of one
    layout: only the picks whose expert's entry is that index are computed, into their rows of
    act bf16 [P, I] and y (given by the caller, which runs the other layouts into the other rows).
    """
    check_gemv_config(layout, cfg)
    p = ids.numel()
    h, i = layout.hidden, layout.inter
    kind = KIND_ID[layout.kind]
    g = layout.group_size or 1
    kind_table, sel = kinds if kinds is not None else (ptr_table, -1)  # the table is never read at -1
    if act is None:
        act = torch.empty(p, i, dtype=torch.bfloat16, device=x.device)  # [P, I]
    if y is None:
        y = torch.empty(p, h, dtype=torch.float32, device=x.device)  # [P, H]
    for stage, a, out, n, kd, a_div, gated in (("gate_up", x, act, i, h, k, True), ("down", act, y, h, i, 1, False)):
        c = cfg[stage]
        q_off, s_off = (layout.gate_up_q, layout.gate_up_s) if gated else (layout.down_q, layout.down_s)
        _moe_gemv_kernel[(p, n // c["BN"])](
            a,
            out,
            ids,
            ptr_table,
            kind_table,
            weights,
            a_div,
            float(swiglu_limit or 0.0),
            Q_OFF=q_off,
            S_OFF=max(s_off, 0),
            N=n,
            KD=kd,
            G=g,
            KIND=kind,
            GATED=gated,
            CLAMP=gated and swiglu_limit is not None,
            BN=c["BN"],
            BK=c["BK"],
            KW=1 if c.get("acc") == "row" else c["BK"] // {1: 2, 3: 8}.get(kind, 1),
            SEL=sel,
            num_warps=c["num_warps"],
            num_stages=c["num_stages"],
        )
    return y
