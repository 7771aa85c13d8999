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
    wf = w.detach().to(torch.float32, copy=True).reshape(n, k // group_size, group_size)  # [N, K/G, G]
    amax = torch.maximum(wf.amax(dim=-1), wf.amin(dim=-1).neg_())  # [N, K/G], no |W| temporary
    scale = amax / qmax
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    scale_bf16 = scale.to(torch.bfloat16)  # [N, K/G]
    # A nonzero group whose scale underflows bf16 to 0 would divide by zero; such weights are
    # (numerically) zero anyway, so they get scale 1.0 and quantize to 0.
    scale_bf16 = torch.where(scale_bf16 == 0, torch.ones_like(scale_bf16), scale_bf16)
    q = wf.div_(scale_bf16.to(torch.float32).unsqueeze(-1)).round_()  # [N, K/G, G], reuses wf
    q = q.clamp_(-qmax - 1, qmax).reshape(n, k)  # [N, K]
    if bits == 8:
        return q.to(torch.int8).contiguous(), scale_bf16.contiguous()
    u = q.add_(8).to(torch.uint8).view(n, k // 2, 2)  # [N, K/2, 2] values 0..15
    packed = u[..., 0] | (u[..., 1] << 4)  # [N, K/2]
    return packed.contiguous(), scale_bf16.contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] nibbles -> int8 [N, K] values in -8..7."""
    return _nibbles(packed).to(torch.int8).sub_(8)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 [N, K] stored values 0..15 (low nibble = even column)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def dequantize_groupwise(
    q: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """(q, scales) -> W' [N, K] in `dtype`: float32(q) * float32(scale[n, k // G])."""
    if bits == 4:
        qf = _nibbles(q).to(torch.float32).sub_(8)  # exact: small integers
    else:
        qf = q.to(torch.float32)
    n, k = qf.shape
    _check(bits, group_size, k)
    if scales.shape != (n, k // group_size):
        raise ValueError(f"scales shape {tuple(scales.shape)} does not match q [{n}, {k}] / G={group_size}")
    w = qf.view(n, k // group_size, group_size).mul_(scales.to(torch.float32).unsqueeze(-1))
    return w.view(n, k).to(dtype)


def packed_cols(k: int, bits: int) -> int:
    """Columns of the stored q for an input dimension k."""
    return k // 2 if bits == 4 else k
