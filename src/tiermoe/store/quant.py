"""Group-wise int8 / int4 / int3 quantization of expert weights (plain-torch reference).

This is the normative definition of the quantized record sections (docs/store-format.md):
GPU kernels and the CPU lane must reproduce `dequantize_groupwise` bit for bit. A weight
W [N, K] (out x in, as Hugging Face stores nn.Linear weights) is split into groups of G
consecutive input columns; each group gets one bf16 scale = max|W_group| / qmax, and the
integers are round-half-to-even(W / scale) with the *bf16-rounded* scale, so quantizer and
dequantizer agree on the exact scale value. A group of zeros stores scale 1.0 (never 0).

int8 stores q as int8 [N, K]. int4 stores q + 8 as two nibbles per byte, [N, K/2] uint8,
low nibble = even column. Dequantization is float32 q * float32 scale, cast to the compute
dtype last.

int3 (q in -4..3, stored u = q + 4 in 0..7) keeps each row as two bit planes, [N, 3K/8] uint8:
the low two bits of column k at byte k // 4, bits 2 * (k % 4) (K/4 bytes), then the high bit at
byte K/4 + k // 8, bit k % 8 (K/8 bytes). Both planes stay row-contiguous, so a kernel reading a
tile of K columns reads K/4 + K/8 bytes of each row, and a CPU dot product walks one row. Its
scale is signed: the group's largest-magnitude weight maps to -4 (the one level a symmetric
3-bit code has on one side only), and smaller scales down to 0.5625 of that are tried (the peak
then clamps at -4), and the scale that puts the peak on -3, keeping the one with the least
squared error (what that buys: docs/results.md, int3). The search only chooses the scale;
dequantization stays q * scale.
"""

from __future__ import annotations

import torch

QMAX = {8: 127, 4: 7, 3: 3}
# int3 scales tried: -peak / 4 times these. The last puts the peak on -3 (a code symmetric about 0
# then fits better; it also keeps Q3_K sub-blocks whose largest code is +-3 exact).
INT3_SCALE_STEPS = (*(1.0 - 0.0625 * j for j in range(8)), 4.0 / 3.0)
_INT3_ROW_CHUNK = 512  # rows quantized at once: bounds the temporaries to a few [rows, K] tensors


def _check(bits: int, group_size: int, k: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"bits must be 3, 4 or 8, got {bits}")
    if group_size <= 0 or group_size % 2:
        raise ValueError(f"group_size must be a positive even number, got {group_size}")
    if k % group_size:
        raise ValueError(f"input dimension {k} is not a multiple of group_size {group_size}")
    if bits == 3 and k % 8:
        raise ValueError(f"int3 needs an input dimension that is a multiple of 8, got {k}")


def quantize_groupwise(w: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize W [N, K] -> (q, scales).

    q: int8 [N, K] for bits=8, uint8 [N, K/2] (packed nibbles) for bits=4.
    scales: bfloat16 [N, K/G].
    """
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    _check(bits, group_size, k)
    if bits == 3:
        return _quantize_int3(w, group_size)
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


def _quantize_int3(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (uint8 [N, 3K/8] bit planes, bf16 [N, K/G] signed scales).

    One pass per candidate scale, keeping each group's best so far (a strictly smaller error
    replaces it, so the first of equal candidates wins): no [rows, groups, candidates, G] tensor."""
    n, k = w.shape
    ng = k // group_size
    q_all = torch.empty(n, k, dtype=torch.uint8, device=w.device)  # [N, K] stored values 0..7
    s_all = torch.empty(n, ng, dtype=torch.bfloat16, device=w.device)
    for r0 in range(0, n, _INT3_ROW_CHUNK):
        wf = w[r0 : r0 + _INT3_ROW_CHUNK].detach().to(torch.float32).reshape(-1, ng, group_size)  # [R, NG, G]
        at = wf.abs().argmax(dim=-1, keepdim=True)  # [R, NG, 1]
        peak = wf.gather(-1, at)  # [R, NG, 1] signed largest-magnitude weight
        best_q = best_s = best_err = None
        for step in INT3_SCALE_STEPS:
            cand = (peak * step / -4.0).to(torch.bfloat16)  # [R, NG, 1]
            cand = torch.where(cand == 0, torch.ones_like(cand), cand).to(torch.float32)
            q = torch.div(wf, cand).round_().clamp_(-4, 3)  # [R, NG, G]
            err = torch.mul(q, cand).sub_(wf).square_().sum(dim=-1, keepdim=True)  # [R, NG, 1]
            if best_err is None:
                best_q, best_s, best_err = q, cand, err
                continue
            better = err < best_err  # [R, NG, 1]
            best_q = torch.where(better, q, best_q)
            best_s = torch.where(better, cand, best_s)
            best_err = torch.minimum(err, best_err)
        q_all[r0 : r0 + _INT3_ROW_CHUNK] = best_q.add_(4).to(torch.uint8).reshape(-1, k)
        s_all[r0 : r0 + _INT3_ROW_CHUNK] = best_s.reshape(-1, ng).to(torch.bfloat16)
    return pack_int3(q_all), s_all


def pack_int3(u: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] stored values 0..7 -> uint8 [N, 3K/8]: low-two-bit plane, then high-bit plane."""
    n, k = u.shape
    lo = (u & 3).view(n, k // 4, 4).to(torch.int32)  # [N, K/4, 4]
    lo_bytes = lo[..., 0] | (lo[..., 1] << 2) | (lo[..., 2] << 4) | (lo[..., 3] << 6)  # [N, K/4]
    hi = (u >> 2).view(n, k // 8, 8).to(torch.int32)  # [N, K/8, 8]
    hi_bytes = torch.zeros(n, k // 8, dtype=torch.int32, device=u.device)
    for b in range(8):
        hi_bytes |= hi[..., b] << b
    return torch.cat((lo_bytes, hi_bytes), dim=1).to(torch.uint8).contiguous()


def unpack_int3(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 3K/8] bit planes -> int8 [N, K] values in -4..3."""
    return _int3_stored(packed).to(torch.int8).sub_(4)


def _int3_stored(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 3K/8] -> uint8 [N, K] stored values 0..7."""
    n, k = packed.shape[0], packed.shape[1] * 8 // 3
    p = packed.to(torch.int32)
    lo_b, hi_b = p[:, : k // 4], p[:, k // 4 :]  # [N, K/4], [N, K/8]
    lo = torch.stack([(lo_b >> (2 * j)) & 3 for j in range(4)], dim=-1).reshape(n, k)  # [N, K]
    hi = torch.stack([(hi_b >> j) & 1 for j in range(8)], dim=-1).reshape(n, k)  # [N, K]
    return (lo | (hi << 2)).to(torch.uint8)


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
    elif bits == 3:
        qf = _int3_stored(q).to(torch.float32).sub_(4)
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
    return {4: k // 2, 3: 3 * k // 8}.get(bits, k)
