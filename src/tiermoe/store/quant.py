"""Group-wise symmetric int8 / int4 quantization of expert weights (plain-torch reference).

This is the normative definition of the quantized record sections (docs/store-format.md):
GPU kernels and the CPU lane must reproduce `dequantize_groupwise` bit for bit. A weight
W [N, K] (out x in, as Hugging Face stores nn.Linear weights) is split into groups of G
consecutive input columns; each group gets one bf16 scale = max|W_group| / qmax, and the
integers are round-half-to-even(W / scale) with the *bf16-rounded* scale, so quantizer and
dequantizer agree on the exact scale value. A group of zeros stores scale 1.0 (never 0).

int8 stores q as int8 [N, K]. int4 stores q + 8 as two nibbles per byte, [N, K/2] uint8,
low nibble = even column. Dequantization is float32 q * float32 scale, cast to the compute
dtype last.
"""

from __future__ import annotations

import torch

QMAX = {8: 127, 4: 7}


def _check(bits: int, group_size: int, k: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if group_size <= 0 or group_size % 2:
        raise ValueError(f"group_size must be a positive even number, got {group_size}")
    if k % group_size:
        raise ValueError(f"input dimension {k} is not a multiple of group_size {group_size}")


def quantize_groupwise(w: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize W [N, K] -> (q, scales).

    q: int8 [N, K] for bits=8, uint8 [N, K/2] (packed nibbles) for bits=4.
    scales: bfloat16 [N, K/G].
    """
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    _check(bits, group_size, k)
    qmax = QMAX[bits]
    wf = w.detach().to(torch.float32).reshape(n, k // group_size, group_size)  # [N, K/G, G]
    amax = wf.abs().amax(dim=-1)  # [N, K/G]
    scale = amax / qmax
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    scale_bf16 = scale.to(torch.bfloat16)  # [N, K/G]
    # A nonzero group whose scale underflows bf16 to 0 would divide by zero; such weights are
    # (numerically) zero anyway, so they get scale 1.0 and quantize to 0.
    scale_bf16 = torch.where(scale_bf16 == 0, torch.ones_like(scale_bf16), scale_bf16)
    q = torch.round(wf / scale_bf16.to(torch.float32).unsqueeze(-1))  # [N, K/G, G]
    q = q.clamp_(-qmax - 1, qmax).reshape(n, k)  # [N, K]
    if bits == 8:
        return q.to(torch.int8).contiguous(), scale_bf16.contiguous()
    u = (q + 8).to(torch.uint8)  # [N, K] values 0..15
    packed = u[:, 0::2] | (u[:, 1::2] << 4)  # [N, K/2]
    return packed.contiguous(), scale_bf16.contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] nibbles -> int8 [N, K] values in -8..7."""
    p = packed.to(torch.int16)
    low = (p & 0xF) - 8
    high = (p >> 4) - 8
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1).to(torch.int8)


def dequantize_groupwise(
    q: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """(q, scales) -> W' [N, K] in `dtype`: float32(q) * float32(scale[n, k // G])."""
    qi = unpack_int4(q) if bits == 4 else q
    n, k = qi.shape
    _check(bits, group_size, k)
    if scales.shape != (n, k // group_size):
        raise ValueError(f"scales shape {tuple(scales.shape)} does not match q [{n}, {k}] / G={group_size}")
    w = qi.to(torch.float32).reshape(n, k // group_size, group_size) * scales.to(torch.float32).unsqueeze(-1)
    return w.reshape(n, k).to(dtype)


def packed_cols(k: int, bits: int) -> int:
    """Columns of the stored q for an input dimension k."""
    return k // 2 if bits == 4 else k
