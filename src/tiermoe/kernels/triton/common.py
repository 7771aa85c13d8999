"""Triton helpers both MoE kernels use: typed pointers into an expert record, exact int3/int4/int8
weight values.

They live here, not in fused_moe.py, so that imports run one way: fused_moe.py (the block
kernel, and the entry point that picks a kernel) imports moe_gemv.py (the few-token kernel), and
both import this module; neither kernel module imports the other's internals.
"""

from __future__ import annotations

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
