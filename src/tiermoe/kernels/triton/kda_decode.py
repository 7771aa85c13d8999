"""The decode step of a KDA (Kimi Delta Attention) layer in two launches.

`models/blocks/kda.py` runs, for a pure decode batch (every sequence one new token, none recording its
intermediate states), about 60 small torch operations per layer between the projections and o_proj: the
short-conv window update (gather, concatenate, conv, SiLU, scatter), the forget-gate and beta math, two
l2norms, the delta-rule step on the fp32 state rows (gathered by slot id and scattered back: 4 MiB each
way per layer at glm5_next's 64 heads of 128 x 128), then the output RMS norm and sigmoid gate. glm5_next
has 34 KDA layers, so at batch 1 that is some 2,000 launches per token, each costing microseconds even
replayed from a CUDA graph. Here:

  kda_conv_step       grid (B, channel blocks): each token's cached window row conv_rows[slot_ids[b]]
                      [3C, K-1] and its new qkv row -> depthwise conv in fp32 + SiLU -> y [B, 3C] in
                      qkv's dtype; the row shifted by one column in place (new content = window[..., 1:]).
  kda_recurrent_step  grid (B, H), one program per head holding the whole [dk, dv] fp32 state tile in
                      registers: l2norm(q) * dk^-0.5, l2norm(k), the forget gate, beta, one delta-rule step
                      on the state row read and written in place at slot_ids[b] (no gather or scatter
                      copies), the core output rounded to the model dtype, then the RMS norm over dv, the
                      o_norm weight and the sigmoid gate -> y [B, H*dv], the o_proj input.

In-place updates are safe because a slot appears at most once per batch (the model's batches hold each
sequence once): every program owns distinct rows, and within a program each value is loaded before its
location is written, by the same thread (one layout for the loads and stores of a window column).

Numerics follow the twins (`kernels/reference_kda.py`: the model's own torch code, which runs on CPU)
operation by operation, in the same order: fp32 throughout; every product and sum rounded on its own
(`enable_fp_fusion=False`, as eager torch computes them); IEEE division and square root (`tl.div_rn`,
`tl.sqrt_rn`); on the GPU CUDA's accurate expf / logf and rsqrtf from libdevice (what torch's CUDA kernels
call), sigmoid as 1 / (1 + exp(-x)) and SiLU as x / (1 + exp(-x)), torch's CUDA forms. beta is rounded to
the model dtype after its sigmoid, as the model takes the sigmoid of a model-dtype tensor. Sums (conv taps,
l2norm and RMS norm, the state contractions over dk) run in the kernel's order, not torch's, so kernel and
twin differ by float32 rounding (tests/kernels/test_kda_decode.py gives the tolerances). Triton's
interpreter (CPU tests) has no libdevice: there exp and log are numpy's and rsqrt is 1 / sqrt (torch's CPU
form).

No host synchronisation, no data-dependent shapes: both launches are captured in a decode step's CUDA graph.

Measured on an H200 at glm5_next's size (bf16, replayed from a CUDA graph over 34 layers' own state rows, so
the state comes from HBM), per layer: batch 1 12.2 us against 132.8 us for the twins' torch operations,
batch 4 18.1 against 214.0, batch 8 31.6 against 336.9. The recurrent kernel is ~10 us of that at batch 1
(64 programs; a plain copy of the same rows takes ~4.3 us), 28.5 us at batch 8 (~2.4 TB/s of state traffic).
4 warps beat 8 (9.9 against 11.4 us at batch 1) and 2 (registers spill).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from tiermoe.kernels.triton.precise import PRECISE, precise_exp, precise_log, precise_sigmoid

CONV_BLOCK = 256  # channels per conv program: glm5_next's 3C = 24576 gives 96 programs per token (H200: 1.8 us
# at batch 1 against 5.1 us for blocks of 1024)
MAX_HEAD_DIM = 128  # the [dk, dv] fp32 state tile of one program: 64 KiB, 128 registers a lane at 4 warps


@triton.jit
def _rsqrt(x, PRECISE: tl.constexpr):
    """1 / sqrt(x): CUDA's rsqrtf compiled (torch's CUDA rsqrt), IEEE 1 / sqrt interpreted (torch's CPU form)."""
    if PRECISE:
        y = libdevice.rsqrt(x)
    else:
        y = tl.div_rn(tl.full(x.shape, 1.0, tl.float32), tl.sqrt_rn(x))
    return y


@triton.jit
def _to(x, DT: tl.constexpr, PRECISE: tl.constexpr):
    """fp32 x -> DT rounded to nearest even, as torch's casts. Compiled, that is the cast itself; the
    interpreter's fp32 -> bf16 cast truncates, so there bf16 is rounded on the bits first (finite x)."""
    if PRECISE or DT != tl.bfloat16:
        y = x.to(DT)
    else:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        y = bits.to(tl.float32, bitcast=True).to(DT)
    return y


@triton.jit
def _conv_step_kernel(qkv_ptr, rows_ptr, ids_ptr, w_ptr, y_ptr, qkv_stride, y_stride, CH,
                      K: tl.constexpr, BLOCK: tl.constexpr, PRECISE: tl.constexpr):
    """Program (b, block): channels [block * BLOCK, +BLOCK) of token b. Window column j < K-1 is the cached
    row's column j, column K-1 the new value; y = silu(sum_j w[c, j] * win[c, j]) summed in j order (K >= 2)."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < CH
    slot = tl.load(ids_ptr + b).to(tl.int64)
    row = rows_ptr + slot * CH * (K - 1) + c * (K - 1)  # [BLOCK] pointers to column 0 of each channel
    w = w_ptr + c * K
    new = tl.load(qkv_ptr + b * qkv_stride + c, mask=ok, other=0.0)
    acc = tl.load(w, mask=ok, other=0.0) * tl.load(row, mask=ok, other=0.0).to(tl.float32)
    for j in tl.static_range(1, K - 1):
        acc = acc + tl.load(w + j, mask=ok, other=0.0) * tl.load(row + j, mask=ok, other=0.0).to(tl.float32)
    acc = acc + tl.load(w + (K - 1), mask=ok, other=0.0) * new.to(tl.float32)
    y = tl.div_rn(acc, 1.0 + precise_exp(-acc, PRECISE))  # silu, torch's CUDA form
    tl.store(y_ptr + b * y_stride + c, _to(y, y_ptr.dtype.element_ty, PRECISE), mask=ok)
    # shift the window: column j <- column j + 1, the last <- new (each column read before it is written,
    # by the same lane: one [BLOCK] layout for every load and store here)
    for j in tl.static_range(0, K - 2):
        tl.store(row + j, tl.load(row + (j + 1), mask=ok, other=0.0), mask=ok)
    tl.store(row + (K - 2), _to(new.to(tl.float32), rows_ptr.dtype.element_ty, PRECISE), mask=ok)


@triton.jit
def _recurrent_step_kernel(q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, f_ptr, f_stride, dt_ptr, alog_ptr,
                           beta_ptr, beta_stride, gate_ptr, gate_stride, ssm_ptr, ids_ptr, w_ptr, y_ptr, y_stride,
                           lower_bound, scale, eps,
                           H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, LOWER: tl.constexpr,
                           PRECISE: tl.constexpr):
    """Program (b, h): head h of token b; rows i index dk, columns j index dv (kda_recurrent_step_ref)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    i = tl.arange(0, BD)
    j = tl.arange(0, BD)
    oki = i < D
    okj = j < D
    hd = h * D
    # the state tile first, so that its long load can overlap the vector loads and norms below
    slot = tl.load(ids_ptr + b).to(tl.int64)
    sp = ssm_ptr + (slot * H + h) * (D * D) + i[:, None] * D + j[None, :]
    ok2 = oki[:, None] & okj[None, :]
    s = tl.load(sp, mask=ok2, other=0.0)  # [dk, dv] fp32
    q = tl.load(q_ptr + b * q_stride + hd + i, mask=oki, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * k_stride + hd + i, mask=oki, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b * v_stride + hd + j, mask=okj, other=0.0).to(tl.float32)
    q = tl.div_rn(q, tl.sqrt_rn(tl.sum(q * q, axis=0) + 1e-6)) * scale  # l2norm(q) * dk^-0.5
    k = tl.div_rn(k, tl.sqrt_rn(tl.sum(k * k, axis=0) + 1e-6))

    # forget gate: log decay g [dk] of this head
    g = tl.load(f_ptr + b * f_stride + hd + i, mask=oki, other=0.0).to(tl.float32) \
        + tl.load(dt_ptr + hd + i, mask=oki, other=0.0).to(tl.float32)
    a = precise_exp(tl.load(alog_ptr + h).to(tl.float32), PRECISE)
    if LOWER:
        g = lower_bound * precise_sigmoid(a * g, PRECISE)
    else:
        g = -a * tl.where(g > 20.0, g, precise_log(1.0 + precise_exp(g, PRECISE), PRECISE))
    decay = precise_exp(g, PRECISE)
    # beta: the sigmoid of a model-dtype tensor is a model-dtype tensor
    beta = precise_sigmoid(tl.load(beta_ptr + b * beta_stride + h).to(tl.float32), PRECISE)
    beta = _to(beta, beta_ptr.dtype.element_ty, PRECISE).to(tl.float32)

    # one delta-rule step on the state row, in place
    s = s * decay[:, None]
    kv_mem = tl.sum(s * k[:, None], axis=0)  # [dv]
    delta = (v - kv_mem) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(sp, s, mask=ok2)  # stored as soon as it is final, before the output reductions
    o = tl.sum(s * q[:, None], axis=0)  # [dv]

    # output epilogue: core rounded to the model dtype, fp32 RMS norm over dv, o_norm weight, sigmoid gate
    o = _to(o, y_ptr.dtype.element_ty, PRECISE).to(tl.float32)
    ms = tl.div_rn(tl.sum(o * o, axis=0), D * 1.0)
    y = o * _rsqrt(ms + eps, PRECISE)
    w = tl.load(w_ptr + j, mask=okj, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + b * gate_stride + hd + j, mask=okj, other=0.0).to(tl.float32)
    y = w * y * precise_sigmoid(gate, PRECISE)
    tl.store(y_ptr + b * y_stride + hd + j, _to(y, y_ptr.dtype.element_ty, PRECISE), mask=okj)


def _check_ids(slot_ids: torch.Tensor, b: int, rows: torch.Tensor) -> None:
    if slot_ids.dim() != 1 or slot_ids.shape[0] != b or slot_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_ids must be int64 or int32 [{b}], got {slot_ids.dtype} {tuple(slot_ids.shape)}")
    if slot_ids.device != rows.device:
        raise ValueError(f"slot_ids on {slot_ids.device}, state rows on {rows.device}")


def _rows_of(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> int:
    """Row stride of t [B, ...] whose rows are each contiguous (a view of a wider row is fine)."""
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must be {list(shape)}, got {list(t.shape)}")
    inner = 1
    for n, st in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if n > 1 and st != inner:
            raise ValueError(f"{name}: each row must be contiguous, got strides {t.stride()}")
        inner *= n
    return t.stride(0)


def kda_conv_step(qkv: torch.Tensor, conv_rows: torch.Tensor, slot_ids: torch.Tensor,
                  weight: torch.Tensor) -> torch.Tensor:
    """qkv [B, 3C] (new pre-conv rows), conv_rows [num_slots, 3C, K-1] contiguous (cached windows; rows
    slot_ids shifted in place), slot_ids [B] (each slot at most once), weight [3C, 1, K] or [3C, K] fp32 ->
    y [B, 3C] in qkv's dtype; one launch; twin: kda_conv_step_ref."""
    b, ch = qkv.shape
    km1 = conv_rows.shape[-1]
    if conv_rows.dim() != 3 or conv_rows.shape[1] != ch or km1 < 1 or not conv_rows.is_contiguous():
        raise ValueError(f"conv_rows must be contiguous [num_slots, {ch}, K-1 >= 1], got {tuple(conv_rows.shape)}")
    if weight.numel() != ch * (km1 + 1) or weight.dtype != torch.float32:
        raise ValueError(f"weight must be float32 [{ch}, 1, {km1 + 1}], got {weight.dtype} {tuple(weight.shape)}")
    _check_ids(slot_ids, b, conv_rows)
    qkv_stride = _rows_of(qkv, "qkv", (b, ch))
    y = torch.empty(b, ch, dtype=qkv.dtype, device=qkv.device)
    if b:
        grid = (b, triton.cdiv(ch, CONV_BLOCK))
        _conv_step_kernel[grid](qkv, conv_rows, slot_ids, weight.contiguous(), y, qkv_stride, ch, ch,
                                K=km1 + 1, BLOCK=CONV_BLOCK, PRECISE=PRECISE, num_warps=4,
                                enable_fp_fusion=False)
    return y


def kda_recurrent_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
    lower_bound: float | None, beta_logits: torch.Tensor, gate: torch.Tensor, ssm_rows: torch.Tensor,
    slot_ids: torch.Tensor, norm_weight: torch.Tensor, eps: float,
) -> torch.Tensor:
    """q, k, v [B, H, d] (conv output, model dtype; views of the [B, 3C] rows are fine), f [B, H*d]
    (f_b_proj output), dt_bias [H*d] and a_log [H] (fp32), lower_bound (None: softplus form), beta_logits
    [B, H] (b_proj output), gate [B, H*d] (g_b_proj output), ssm_rows [num_slots, H, d, d] fp32 contiguous
    (rows slot_ids updated in place; each slot at most once), norm_weight [d], eps -> y [B, H*d] in q's dtype
    (the o_proj input); one launch; twin: kda_recurrent_step_ref."""
    b, h, d = q.shape
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {d}: the kernel takes 1 to {MAX_HEAD_DIM}")
    if tuple(ssm_rows.shape[1:]) != (h, d, d) or ssm_rows.dtype != torch.float32 or not ssm_rows.is_contiguous():
        raise ValueError(f"ssm_rows must be contiguous float32 [num_slots, {h}, {d}, {d}], "
                         f"got {ssm_rows.dtype} {tuple(ssm_rows.shape)}")
    if dt_bias.numel() != h * d or a_log.numel() != h or norm_weight.numel() != d:
        raise ValueError(f"dt_bias, a_log, norm_weight must hold {h * d}, {h}, {d} values, "
                         f"got {dt_bias.numel()}, {a_log.numel()}, {norm_weight.numel()}")
    _check_ids(slot_ids, b, ssm_rows)
    strides = [_rows_of(t, name, (b, h, d)) for t, name in ((q, "q"), (k, "k"), (v, "v"))]
    f_stride = _rows_of(f, "f", (b, h * d))
    beta_stride = _rows_of(beta_logits, "beta_logits", (b, h))
    gate_stride = _rows_of(gate, "gate", (b, h * d))
    y = torch.empty(b, h * d, dtype=q.dtype, device=q.device)
    if b:
        bd = triton.next_power_of_2(d)
        _recurrent_step_kernel[(b, h)](
            q, k, v, *strides, f, f_stride, dt_bias.contiguous(), a_log.contiguous(), beta_logits, beta_stride,
            gate, gate_stride, ssm_rows, slot_ids, norm_weight.contiguous(), y, h * d,
            float(lower_bound) if lower_bound is not None else 0.0, float(d ** -0.5), float(eps),
            H=h, D=d, BD=bd, LOWER=lower_bound is not None, PRECISE=PRECISE,
            num_warps=4, enable_fp_fusion=False)
    return y
