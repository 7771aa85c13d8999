"""Fused SwiGLU MoE over per-expert pointer tables (Triton).

    out[t] = sum_k w[t, k] * down_e( silu(gate_e x_t) * up_e x_t ),   e = topk_ids[t, k]

Every expert's weights are reached through `ptr_table[e]`, an int64 device-visible address of
the expert's record (layout.py): a GPU slot for resident experts, or the pinned host copy for
misses, which the kernel then reads in place over PCIe (zero-copy, no host sync). Moving an
expert between tiers only rewrites one table entry, so results are bit-identical whatever the
residency: the same kernel, configuration and summation order run in every case.

Pipeline (all launches are fixed-shape and sync-free, so a decode step can be graph-captured):
  1. moe_align: the flattened picks (pairs p = t*K + k) are grouped by expert into blocks of
     BLOCK_M rows (experts in order of first pick). Decode shapes (T <= 16) use a one-program
     Triton kernel; larger batches a fixed-shape torch formulation.
  2. _moe_gemm_kernel, GATED: one program per (block, BLOCK_N slice of I) reads the gate and
     up rows of its expert once, applies them to all the block's tokens and writes
     act = bf16(silu(g) * u) per pair (with a SwiGLU limit L, as GLM-5.3 uses:
     g = min(g, L), u = clamp(u, -L, L) first).
  3. _moe_gemm_kernel, not gated: down projection per pair, times the routing weight (fp32).
  4. _sum_pairs_kernel: out[t] = bf16(sum over k in pick order) - deterministic, no atomics.
(moe_align and the sum live in common.py.) A mixed store (`pack --cold-quant`: records of two
layouts) passes a kind table, each expert's layout index: steps 2-3 run once per layout over the
one plan, each launch returning early on blocks (or picks) whose expert is of another layout,
and step 4 runs once, so an expert's result never depends on the tier of any expert.

int3/int4/int8 weights are dequantized in registers exactly like reference.dequant_matrix
(bf16(float32(q) * float32(scale))) and multiplied with bf16 tensor-core dots (fp32 accum).
int4 nibbles are consumed as an even and an odd half-tile (low nibble = even column), so no
interleave is needed: the activations are split instead. int3 likewise: a tile of BK columns is
four phase tiles [BK/4, BN] (phase r = columns 4j + r, all in low-plane byte j at bits 2r, their
high bits in high-plane byte j // 2 at bit 4 * (j % 2) + r), each dotted with its activation phase.

Launch configurations (BLOCK_M/N/K, warps, stages) come from configs.json, keyed by device
name, record shape and a token bucket; `tiermoe bench tune-moe` (or `moe-gpu --tune`) regenerates them. A
decode configuration may carry "gemv" (launch shape and max_tokens): steps of that many tokens
or fewer run the two projections as matrix-vector products instead (moe_gemv.py).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Sequence

import torch
import triton
import triton.language as tl

from tiermoe.kernels.layout import ExpertLayout
from tiermoe.kernels.triton.common import (  # noqa: F401  (moe_align, nb_max: this module's API too)
    KIND_ID, int3_value, int4_value, int8_value, moe_align, nb_max, record_pointers, sum_pairs,
)

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
CONFIG_PATH = Path(__file__).with_name("configs.json")
DECODE_MAX_TOKENS = 16  # decode path (one block per expert) up to this many tokens


@triton.jit
def _scales(s_ptrs, k0, k_rows, G: tl.constexpr, BK: tl.constexpr):
    """fp32 scales of one weight tile whose rows are columns k0 + k_rows of the matrix.

    s_ptrs [BN]: each output row's first scale. A tile within one group (BK <= G) takes one
    scale per output row: [1, BN]. A tile spanning BK / G groups (small groups such as Q4_0's
    32, where a K tile capped at the group size leaves tensor-core dots of K = 16) gathers the
    scale of each of its rows: [rows, BN]. Either way each weight is q * its group's scale.
    """
    # Two helpers, not two returns: the compiler wants one return type per function even when
    # the branch is decided at compile time.
    if BK > G:
        s = _scales_per_row(s_ptrs, k0, k_rows, G)
    else:
        s = _scales_per_tile(s_ptrs, k0, G)
    return s


@triton.jit
def _scales_per_row(s_ptrs, k0, k_rows, G: tl.constexpr):
    """[rows, BN] fp32: the scale of each tile row's group (tiles spanning several groups)."""
    return tl.load(s_ptrs[None, :] + ((k0 + k_rows) // G)[:, None]).to(tl.float32)


@triton.jit
def _scales_per_tile(s_ptrs, k0, G: tl.constexpr):
    """[1, BN] fp32: one scale per output row (a tile within one group)."""
    return tl.load(s_ptrs + k0 // G).to(tl.float32)[None, :]


@triton.jit
def _dot(acc, a, w, DOT_F32: tl.constexpr):
    """acc + a @ w (fp32 accumulation); DOT_F32: in fp32, for the interpreter."""
    if DOT_F32:
        acc += tl.dot(a.to(tl.float32), w.to(tl.float32))
    else:
        acc += tl.dot(a, w)
    return acc


@triton.jit
def _split4(a, BM: tl.constexpr, BK: tl.constexpr):
    """Activation tile a [BM, BK] -> its four phases [BM, BK/4] (phase r: columns 4j + r)."""
    even, odd = tl.split(tl.reshape(a, (BM, BK // 4, 2, 2)))  # [BM, BK/4, 2]: columns 4j + 2p (+ 1)
    a0, a2 = tl.split(even)
    a1, a3 = tl.split(odd)
    return a0, a1, a2, a3


@triton.jit
def _int3_dot(acc, a0, a1, a2, a3, lo, hi, s, DOT_F32: tl.constexpr):
    """acc + the four phase dots of one int3 tile: lo [BK/4, BN] low-plane bytes (row j: columns
    4j .. 4j + 3), hi [BK/4, BN] their high bits at bits 0..3 (int32), s [1 or BK/4, BN] fp32
    scales; each weight dequantized to bf16(q * scale) as in reference.dequant_matrix."""
    acc = _dot(acc, a0, (int3_value(lo, hi, 0) * s).to(tl.bfloat16), DOT_F32)
    acc = _dot(acc, a1, (int3_value(lo, hi, 1) * s).to(tl.bfloat16), DOT_F32)
    acc = _dot(acc, a2, (int3_value(lo, hi, 2) * s).to(tl.bfloat16), DOT_F32)
    acc = _dot(acc, a3, (int3_value(lo, hi, 3) * s).to(tl.bfloat16), DOT_F32)
    return acc


@triton.jit(do_not_specialize=["P"])  # a step's pick count: one compile for every step (kernels README)
def _moe_gemm_kernel(
    a_ptr,  # [rows, KD] bf16: x (row = pair // A_DIV) or act (row = pair)
    out_ptr,  # GATED: act [P, N] bf16; else y [P, N] fp32
    sorted_pairs_ptr,  # [NB * BM] int32, P = padding
    block_expert_ptr,  # [NB] int32, -1 = unused block
    ptr_table_ptr,  # [E] int64 record addresses
    kinds_ptr,  # [E] int8/int32 layout index of each table row (read only when SEL >= 0)
    weights_ptr,  # [P] fp32 routing weights (not GATED)
    P,
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
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    DOT_F32: tl.constexpr,  # interpreter only: its bf16 dot is unreliable
    SEL: tl.constexpr,  # -1: every record has this layout; else only blocks whose expert's kinds entry is SEL
):
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_b)
    if SEL >= 0:  # a mixed store: a block of another layout's expert is that launch's
        e = tl.where(tl.load(kinds_ptr + tl.maximum(e, 0)).to(tl.int32) == SEL, e, -1)
    if e < 0:
        return
    offs_m = pid_b * BM + tl.arange(0, BM)
    pairs = tl.load(sorted_pairs_ptr + offs_m)  # [BM]
    m_ok = pairs < P
    rows = tl.where(m_ok, pairs // A_DIV, 0).to(tl.int64)
    base = tl.load(ptr_table_ptr + e)
    offs_n = pid_n * BN + tl.arange(0, BN)  # [BN]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    wp, sp = record_pointers(base, Q_OFF, S_OFF, KIND)
    offs_k = tl.arange(0, BK)
    a_ptrs = a_ptr + rows[:, None] * KD + offs_k[None, :]  # [BM, BK]
    if KIND == 1:
        offs_kh = tl.arange(0, BK // 2)
        w_ptrs = wp + offs_kh[:, None] + offs_n[None, :] * (KD // 2)  # [BK/2, BN], k contiguous
        w_step: tl.constexpr = BK // 2
        w_up: tl.constexpr = N * (KD // 2)
    elif KIND == 3:
        row3: tl.constexpr = 3 * KD // 8  # bytes of one stored row: low plane KD/4, high plane KD/8
        offs_kq = tl.arange(0, BK // 4)
        w_ptrs = wp + offs_kq[:, None] + offs_n[None, :] * row3  # [BK/4, BN] low-plane bytes, k contiguous
        # [BK/4, BN]: high-plane byte j // 2 for low byte j (each loaded twice), its nibble j % 2 taken below
        h_ptrs = wp + KD // 4 + (offs_kq // 2)[:, None] + offs_n[None, :] * row3
        h_shift = 4 * (offs_kq % 2)[:, None]  # [BK/4, 1]
        w_step: tl.constexpr = BK // 4
        w_up: tl.constexpr = N * row3
    else:
        w_ptrs = wp + offs_k[:, None] + offs_n[None, :] * KD  # [BK, BN]
        w_step: tl.constexpr = BK
        w_up: tl.constexpr = N * KD
    s_ptrs = sp + offs_n * (KD // G)  # [BN]
    s_up: tl.constexpr = N * (KD // G)
    for k0 in range(0, KD, BK):
        a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)  # [BM, BK]
        if KIND == 1:
            a_even, a_odd = tl.split(tl.reshape(a, (BM, BK // 2, 2)))  # [BM, BK/2] each
            q = tl.load(w_ptrs)  # [BK/2, BN] u8
            s = _scales(s_ptrs, k0, 2 * offs_kh, G, BK)  # [1 or BK/2, BN]
            w_lo = (int4_value(q & 15) * s).to(tl.bfloat16)
            w_hi = (int4_value(q >> 4) * s).to(tl.bfloat16)
            if DOT_F32:
                acc += tl.dot(a_even.to(tl.float32), w_lo.to(tl.float32))
                acc += tl.dot(a_odd.to(tl.float32), w_hi.to(tl.float32))
            else:
                acc += tl.dot(a_even, w_lo)
                acc += tl.dot(a_odd, w_hi)
            if GATED:
                q = tl.load(w_ptrs + w_up)
                s = _scales(s_ptrs + s_up, k0, 2 * offs_kh, G, BK)
                w_lo = (int4_value(q & 15) * s).to(tl.bfloat16)
                w_hi = (int4_value(q >> 4) * s).to(tl.bfloat16)
                if DOT_F32:
                    acc_u += tl.dot(a_even.to(tl.float32), w_lo.to(tl.float32))
                    acc_u += tl.dot(a_odd.to(tl.float32), w_hi.to(tl.float32))
                else:
                    acc_u += tl.dot(a_even, w_lo)
                    acc_u += tl.dot(a_odd, w_hi)
        elif KIND == 3:
            a0, a1, a2, a3 = _split4(a, BM, BK)  # [BM, BK/4] each
            # one scale per 4 columns (the config check keeps G % 4 == 0 when a tile spans groups)
            s = _scales(s_ptrs, k0, 4 * offs_kq, G, BK)  # [1 or BK/4, BN]
            hi = tl.load(h_ptrs).to(tl.int32) >> h_shift  # [BK/4, BN]
            acc = _int3_dot(acc, a0, a1, a2, a3, tl.load(w_ptrs).to(tl.int32), hi, s, DOT_F32)
            if GATED:
                s = _scales(s_ptrs + s_up, k0, 4 * offs_kq, G, BK)
                hi = tl.load(h_ptrs + w_up).to(tl.int32) >> h_shift
                acc_u = _int3_dot(acc_u, a0, a1, a2, a3, tl.load(w_ptrs + w_up).to(tl.int32), hi, s, DOT_F32)
        else:
            if KIND == 0:
                w = tl.load(w_ptrs)  # [BK, BN] bf16
            else:
                s = _scales(s_ptrs, k0, offs_k, G, BK)
                w = (int8_value(tl.load(w_ptrs)) * s).to(tl.bfloat16)  # [BK, BN]
            if DOT_F32:
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32))
            else:
                acc += tl.dot(a, w)
            if GATED:
                if KIND == 0:
                    w = tl.load(w_ptrs + w_up)
                else:
                    s = _scales(s_ptrs + s_up, k0, offs_k, G, BK)
                    w = (int8_value(tl.load(w_ptrs + w_up)) * s).to(tl.bfloat16)
                if DOT_F32:
                    acc_u += tl.dot(a.to(tl.float32), w.to(tl.float32))
                else:
                    acc_u += tl.dot(a, w)
        a_ptrs += BK
        w_ptrs += w_step
        if KIND == 3:
            h_ptrs += BK // 8
    out_offs = pairs.to(tl.int64)[:, None] * N + offs_n[None, :]
    if GATED:
        if CLAMP:
            acc = tl.minimum(acc, LIMIT)
            acc_u = tl.minimum(tl.maximum(acc_u, -LIMIT), LIMIT)
        act = acc / (1.0 + tl.exp(-acc)) * acc_u
        tl.store(out_ptr + out_offs, act.to(tl.bfloat16), mask=m_ok[:, None])
    else:
        wt = tl.load(weights_ptr + pairs, mask=m_ok, other=0.0)
        tl.store(out_ptr + out_offs, acc * wt[:, None], mask=m_ok[:, None])


# ----------------------------------------------------------------------------- host side


@functools.lru_cache(maxsize=None)
def _load_configs(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def shape_key(layout: ExpertLayout) -> str:
    return f"{layout.kind}/H{layout.hidden}/I{layout.inter}/G{layout.group_size}"


def token_bucket(tokens: int) -> str:
    return "decode" if tokens <= DECODE_MAX_TOKENS else "prefill"


def default_config(layout: ExpertLayout, tokens: int) -> dict:
    """Heuristic launch configuration when configs.json has no entry (fits any record shape)."""
    g = layout.group_size or 128
    dims = {"gate_up": (layout.inter, layout.hidden), "down": (layout.hidden, layout.inter)}
    if _INTERPRET:
        bm, bn, bk, nw, ns = 16, 32, 32, 4, 1
    elif tokens <= DECODE_MAX_TOKENS:
        bm, bn, bk, nw, ns = 16, 32, 128, 4, 4
    else:
        bm, bn, bk, nw, ns = 64, 128, 64, 8, 3
    cfg = {}
    for stage, (n, kd) in dims.items():
        k_cap = max(min(bk, kd, g), _min_block_k(layout)) if layout.kind != "bf16" else min(bk, kd, 64)
        cfg[stage] = {"BM": bm, "BN": _fit_block(min(bn, n), n, 16), "BK": _fit_block(k_cap, kd, _min_block_k(layout)),
                      "num_warps": nw, "num_stages": ns}
    return cfg


def _fit_block(block: int, dim: int, least: int) -> int:
    """The largest power of two from `block` down to `least` that divides `dim` (else `block`, refused by the
    configuration check). SmolLM2's 576 (64 x 9) takes 64-wide tiles: else the default model fell back to the
    torch expert path on CUDA, whose numerics fast mode's CPU lane does not share."""
    b = block
    while b > least and dim % b:
        b //= 2
    return b if dim % b == 0 else block


def get_config(layout: ExpertLayout, tokens: int, device: torch.device | None = None) -> dict:
    """Tuned configuration for this device / record shape / token bucket, else the default."""
    if not _INTERPRET and device is not None and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        cfg = _load_configs(str(CONFIG_PATH)).get("devices", {}).get(name, {}).get(shape_key(layout), {})
        if token_bucket(tokens) in cfg:
            return cfg[token_bucket(tokens)]
    return default_config(layout, tokens)


def _min_block_k(layout: ExpertLayout) -> int:
    """tl.dot needs K >= 16 on the GPU; int4 tiles split K into two nibble halves of BK / 2, int3
    tiles into four phases of BK / 4."""
    return {"int4": 32, "int3": 64}.get(layout.kind, 16)


def _check_config(layout: ExpertLayout, cfg: dict, tokens: int) -> None:
    """Raise ValueError for a launch configuration the kernels cannot run (block and gemv stages),
    a malformed one (a hand-edited configs.json: missing stage or field) included."""
    try:
        _check_config_fields(layout, cfg)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"malformed launch configuration (missing or bad {exc}): {cfg}") from None


def _check_config_fields(layout: ExpertLayout, cfg: dict) -> None:
    for stage, (n, kd) in (("gate_up", (layout.inter, layout.hidden)), ("down", (layout.hidden, layout.inter))):
        c = cfg[stage]
        if n % c["BN"] or kd % c["BK"]:
            raise ValueError(f"{stage}: BN={c['BN']}/BK={c['BK']} must divide N={n}/K={kd}")
        if c["BK"] < _min_block_k(layout):
            raise ValueError(
                f"{stage}: BK={c['BK']} is below {_min_block_k(layout)} for {layout.kind} (the dot needs K >= 16)"
            )
        if layout.kind != "bf16" and layout.group_size % c["BK"] and c["BK"] % layout.group_size:
            raise ValueError(f"{stage}: BK={c['BK']} and the group size {layout.group_size} must divide one another")
        if layout.kind == "int3" and (c["BK"] % 8 or (c["BK"] > layout.group_size and layout.group_size % 4)):
            raise ValueError(
                f"{stage}: int3 needs BK={c['BK']} a multiple of 8 and, for tiles spanning several groups, "
                f"a group size ({layout.group_size}) that is a multiple of 4 (one scale per low-plane byte)"
            )
    if cfg["gate_up"]["BM"] != cfg["down"]["BM"]:
        raise ValueError("gate_up and down must share BM (one block plan)")
    if "gemv" in cfg:
        from tiermoe.kernels.triton.moe_gemv import check_gemv_config

        check_gemv_config(layout, cfg["gemv"])


def fused_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    ptr_table: torch.Tensor,
    layout: ExpertLayout | Sequence[ExpertLayout],
    *,
    config: dict | Sequence[dict | None] | None = None,
    out: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    kind_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """SwiGLU MoE over pointer-table experts. Returns bf16 [T, H], or `out` (bf16 or fp32 [T, H]) written: an
    fp32 `out` receives the picks' fp32 sum unrounded (fast mode adds the CPU lane's part to it, then rounds once).

    x [T, H] bf16 contiguous; topk_ids [T, K] int (rows of ptr_table; no repeats within a
    token); topk_weights [T, K] float (used as fp32); ptr_table [E] int64, entry e = the
    device-visible address of expert e's record (GPU memory or pinned host memory), 16-byte
    aligned (records are 4096-aligned). Shared experts are ordinary entries picked with
    weight 1. No host synchronisation: safe inside CUDA graph capture. swiglu_limit: clamp the
    gate from above and the up projection on both sides at this value before the SwiGLU.

    A mixed store (records of several layouts, `pack --cold-quant`): kind_table int8/int32 [E] on
    the device holds the index into `layout` (then a sequence, one ExpertLayout per index) of
    each table row's record, and `config` may be a sequence of one configuration (or None) per
    layout. Each layout then gets its own launches over the one block plan, skipping the blocks
    (or picks) of the others' experts on the device; `sum_pairs` stays one launch in pick order.
    An expert's result so depends only on its own layout's kernel and bytes, never on the tier
    it sits in. Without kind_table `layout` is every record's and today's single launch runs.
    """
    if kind_table is not None:
        return _fused_moe_mixed(x, topk_ids, topk_weights, ptr_table, tuple(layout), kind_table, config, out,
                                swiglu_limit)
    t, k = topk_ids.shape
    h, i = layout.hidden, layout.inter
    if x.shape != (t, h) or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bf16 [{t}, {h}], got {x.dtype} {tuple(x.shape)}")
    cfg = config or get_config(layout, t, x.device)
    _check_config(layout, cfg, t)
    x = x.contiguous()
    w = topk_weights.reshape(-1).to(torch.float32)
    gemv = cfg.get("gemv")
    if gemv is not None and t <= gemv.get("max_tokens", 0):  # few tokens: one weight stream per pick
        from tiermoe.kernels.triton.moe_gemv import moe_projections_gemv

        y = moe_projections_gemv(x, topk_ids.reshape(-1).to(torch.int32), w, ptr_table, layout, gemv, k, swiglu_limit)
        return sum_pairs(y, t, k, h, out)
    bm = cfg["gate_up"]["BM"]
    p = t * k
    plan = moe_align(topk_ids, ptr_table.numel(), bm)
    act = torch.empty(p, i, dtype=torch.bfloat16, device=x.device)  # [P, I]
    y = torch.empty(p, h, dtype=torch.float32, device=x.device)  # [P, H]
    _block_projections(x, act, y, plan, ptr_table, w, layout, cfg, k, swiglu_limit, ptr_table, -1)
    return sum_pairs(y, t, k, h, out)


def _block_projections(x: torch.Tensor, act: torch.Tensor, y: torch.Tensor, plan: tuple[torch.Tensor, torch.Tensor],
                       ptr_table: torch.Tensor, w: torch.Tensor, layout: ExpertLayout, cfg: dict, k: int,
                       swiglu_limit: float | None, kinds: torch.Tensor, sel: int) -> None:
    """The gated and the down launch of the block kernel: act bf16 [P, I] and y fp32 [P, H] rows
    of the planned picks (plan = moe_align's (sorted_pairs, block_expert)). sel >= 0: only the
    blocks whose expert has kinds[e] == sel (a mixed store's launches of one layout), else all
    (kinds is then never read)."""
    sorted_pairs, block_expert = plan
    p, nb = act.shape[0], block_expert.numel()
    h, i = layout.hidden, layout.inter
    kind = KIND_ID[layout.kind]
    g = layout.group_size or 1
    for stage, a, out, n, kd, a_div, gated in (("gate_up", x, act, i, h, k, True), ("down", act, y, h, i, 1, False)):
        c = cfg[stage]
        q_off, s_off = (layout.gate_up_q, layout.gate_up_s) if gated else (layout.down_q, layout.down_s)
        _moe_gemm_kernel[(nb, n // c["BN"])](
            a, out, sorted_pairs, block_expert, ptr_table, kinds, w, p, a_div,
            float(swiglu_limit or 0.0) if gated else 0.0,
            Q_OFF=q_off, S_OFF=max(s_off, 0), N=n, KD=kd, G=g, KIND=kind, GATED=gated,
            CLAMP=gated and swiglu_limit is not None, BM=cfg["gate_up"]["BM"], BN=c["BN"], BK=c["BK"],
            DOT_F32=_INTERPRET, SEL=sel, num_warps=c["num_warps"], num_stages=c["num_stages"],
        )


def mixed_configs(layouts: Sequence[ExpertLayout], tokens: int, device: torch.device | None = None,
                  config: dict | Sequence[dict | None] | None = None) -> list[dict]:
    """The launch configuration of each layout of a mixed store for a step of `tokens` tokens.

    config: None (each layout's tuned or default one), one dict for every layout, or one dict
    (or None) per layout. The layouts' block launches share one block plan, so every block
    configuration takes the BM of the first layout that runs the block kernel at this size
    (BM sets the rows of a block, not any layout's tiling of K or N). Raises ValueError for a
    configuration a layout's kernels cannot run, or for layouts of different H or I.
    """
    if not layouts:
        raise ValueError("a mixed store needs at least one record layout")
    shape = (layouts[0].hidden, layouts[0].inter)
    if any((lay.hidden, lay.inter) != shape for lay in layouts):
        raise ValueError(f"record layouts of different shapes: {[(lay.hidden, lay.inter) for lay in layouts]}")
    given = config if isinstance(config, (list, tuple)) else [config] * len(layouts)
    if len(given) != len(layouts):
        raise ValueError(f"{len(given)} launch configurations for {len(layouts)} record layouts")
    cfgs = [c or get_config(lay, tokens, device) for lay, c in zip(layouts, given)]
    bm = next((c["gate_up"]["BM"] for c in cfgs if not _runs_gemv(c, tokens)), None)
    out = []
    for lay, c in zip(layouts, cfgs):
        if bm is not None:
            c = {**c, "gate_up": {**c["gate_up"], "BM": bm}, "down": {**c["down"], "BM": bm}}
        _check_config(lay, c, tokens)
        out.append(c)
    return out


def _runs_gemv(cfg: dict, tokens: int) -> bool:
    """Does a step of `tokens` tokens take the matrix-vector kernel under this configuration?"""
    gemv = cfg.get("gemv")
    return gemv is not None and tokens <= gemv.get("max_tokens", 0)


def _fused_moe_mixed(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, ptr_table: torch.Tensor,
                     layouts: tuple[ExpertLayout, ...], kind_table: torch.Tensor,
                     config: dict | Sequence[dict | None] | None, out: torch.Tensor | None,
                     swiglu_limit: float | None) -> torch.Tensor:
    """fused_moe over a mixed store (see there): per layout, its gated and down launches (block or
    matrix-vector kernel, by its own configuration) write the act and y rows of the picks of its
    experts only; one pick-order sum at the end. Fixed shapes, no host sync."""
    t, k = topk_ids.shape
    h, i = layouts[0].hidden, layouts[0].inter
    if x.shape != (t, h) or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bf16 [{t}, {h}], got {x.dtype} {tuple(x.shape)}")
    if kind_table.shape != ptr_table.shape or kind_table.dtype not in (torch.int8, torch.int32):
        raise ValueError(f"kind_table must be int8/int32 {tuple(ptr_table.shape)}, got {kind_table.dtype} "
                         f"{tuple(kind_table.shape)}")
    cfgs = mixed_configs(layouts, t, x.device, config)
    x = x.contiguous()
    w = topk_weights.reshape(-1).to(torch.float32)  # [P]
    p = t * k
    act = torch.empty(p, i, dtype=torch.bfloat16, device=x.device)  # [P, I], each row written by its pick's layout
    y = torch.empty(p, h, dtype=torch.float32, device=x.device)  # [P, H], likewise
    block = [c for c in cfgs if not _runs_gemv(c, t)]
    plan = moe_align(topk_ids, ptr_table.numel(), block[0]["gate_up"]["BM"]) if block else None
    ids = topk_ids.reshape(-1).to(torch.int32) if len(block) < len(cfgs) else None  # [P]
    for sel, (lay, c) in enumerate(zip(layouts, cfgs)):
        if _runs_gemv(c, t):
            from tiermoe.kernels.triton.moe_gemv import moe_projections_gemv

            moe_projections_gemv(x, ids, w, ptr_table, lay, c["gemv"], k, swiglu_limit, kinds=(kind_table, sel),
                                 act=act, y=y)
        else:
            _block_projections(x, act, y, plan, ptr_table, w, lay, c, k, swiglu_limit, kind_table, sel)
    return sum_pairs(y, t, k, h, out)
