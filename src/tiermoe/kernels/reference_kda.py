"""Plain-torch twins of the KDA decode kernels (`kernels/triton/kda_decode.py`), and the KDA math they share
with the model.

These are not oracles written beside the model's code: they are that code. `models/blocks/kda.py` (Kimi
Delta Attention) imports the delta rule, the forget gate and the output norm from here and runs the two
step twins itself on CPU (and wherever a gradient is needed), so the CPU path keeps the exact torch
operations, in the same order, that it ran before the kernels existed; the kernels follow them operation
by operation (tests/kernels/test_kda_decode.py).

Decode step of one KDA layer for B sequences of one new token each, sequence b in state slot
`slot_ids[b]` (each slot at most once per call):
  kda_conv_step_ref       the short-conv window continuation: y = silu(conv(window ++ new)) and the
                          window row shifted by one column, in place;
  kda_recurrent_step_ref  forget gate, beta, l2norms, one delta-rule step on the fp32 state row (in
                          place) and the output epilogue (RMS norm over dv, o_norm weight, sigmoid gate):
                          y [B, H*dv] in the model dtype, the o_proj input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps), the FLA convention (not F.normalize's clamp)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def kda_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, keep_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Step-by-step delta rule. q,k,g [B,S,H,dk], v [B,S,H,dv], beta [B,S,H], state [B,H,dk,dv].

    Returns (out [B,S,H,dv] fp32, final state, per-step states [S+1,B,H,dk,dv] or None)."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    q = l2norm(q) * (q.shape[-1] ** -0.5)
    k = l2norm(k)
    s = state.float()
    out = torch.zeros(*v.shape, dtype=torch.float32, device=v.device)
    hist = [s] if keep_states else None
    for i in range(q.shape[1]):
        s = s * g[:, i].exp()[..., None]
        kv_mem = (s * k[:, i, ..., None]).sum(dim=-2)  # [B,H,dv]
        delta = (v[:, i] - kv_mem) * beta[:, i, :, None]
        s = s + k[:, i].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, i] = (s * q[:, i].unsqueeze(-1)).sum(dim=-2)
        if hist is not None:
            hist.append(s)
    return out, s, (torch.stack(hist) if hist is not None else None)


def kda_forget_gate_ref(f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, lower_bound: float | None,
                        head_dim: int) -> torch.Tensor:
    """Per-channel log decay from the f_b_proj output f [T, C] (model dtype): g = lower_bound *
    sigmoid(exp(A_log) * (f + dt_bias)), or -exp(A_log) * softplus(f + dt_bias) (threshold 20) without a
    lower bound. dt_bias [C], A_log [H] (fp32 parameters). Returns g [T, H, dk] fp32 (<= 0)."""
    t = f.shape[0]
    g = (f.float() + dt_bias.float()).view(t, -1, head_dim)
    a = torch.exp(a_log.float()).view(1, -1, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * g)
    return -a * torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))


def kda_output_ref(core: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The output epilogue: core [T, H, dv] (model dtype) -> fp32 RMS norm over dv with eps, times
    norm_weight [dv] in fp32, times sigmoid(gate [T, H, dv]) in fp32, cast to core's dtype."""
    y = core.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (norm_weight.float() * y * torch.sigmoid(gate.float())).to(core.dtype)


def kda_decode_core_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        ssm_rows: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    """One delta-rule step for B single-token sequences: q, k, g [B, H, dk], v [B, H, dv], beta [B, H];
    their states are rows slot_ids [B] of ssm_rows [num_slots, H, dk, dv] fp32, gathered and scattered
    back updated. Returns the core output [B, H, dv] fp32."""
    s0 = ssm_rows.index_select(0, slot_ids)  # [B, H, dk, dv]
    # [B, 1, ...] contiguous copies, as a row gather makes them (same reduction layout)
    q1, k1, v1, g1, b1 = (z[:, None].contiguous() for z in (q, k, v, g, beta))
    o, s1, _ = kda_recurrent(q1, k1, v1, g1, b1, s0)
    ssm_rows.index_copy_(0, slot_ids, s1)
    return o[:, 0]


def kda_conv_step_ref(qkv: torch.Tensor, conv_rows: torch.Tensor, slot_ids: torch.Tensor,
                      weight: torch.Tensor) -> torch.Tensor:
    """Twin of `kda_conv_step`: qkv [B, 3C] (the new pre-conv rows), conv_rows [num_slots, 3C, K-1] (the
    cached windows, model dtype), slot_ids [B], weight [3C, 1, K] fp32 (depthwise) -> y [B, 3C] in qkv's
    dtype, silu(conv) computed in fp32; rows slot_ids of conv_rows become the window's last K-1 columns."""
    past = conv_rows.index_select(0, slot_ids)  # [B, 3C, K-1]
    win = torch.cat([past, qkv.unsqueeze(-1)], dim=-1)  # [B, 3C, K]
    y = F.silu(F.conv1d(win.to(weight.dtype), weight, groups=weight.shape[0]))[..., 0].to(qkv.dtype)  # [B, 3C]
    conv_rows.index_copy_(0, slot_ids, win[..., 1:])
    return y


def kda_recurrent_step_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
    lower_bound: float | None, beta_logits: torch.Tensor, gate: torch.Tensor, ssm_rows: torch.Tensor,
    slot_ids: torch.Tensor, norm_weight: torch.Tensor, eps: float,
) -> torch.Tensor:
    """Twin of `kda_recurrent_step`: q, k, v [B, H, d] (conv output, model dtype), f [B, H*d] (f_b_proj
    output), dt_bias [H*d] / a_log [H] fp32, beta_logits [B, H] (b_proj output; sigmoid taken in the model
    dtype), gate [B, H*d] (g_b_proj output), ssm_rows [num_slots, H, d, d] fp32 (rows slot_ids updated),
    norm_weight [d] (o_norm), eps -> y [B, H*d] in the model dtype (the o_proj input)."""
    b, h, d = q.shape
    g = kda_forget_gate_ref(f, dt_bias, a_log, lower_bound, d)  # [B, H, dk] fp32
    beta = torch.sigmoid(beta_logits)  # [B, H], model dtype
    core = kda_decode_core_ref(q, k, v, g, beta, ssm_rows, slot_ids).to(q.dtype)
    return kda_output_ref(core, gate.view(b, h, d), norm_weight, eps).reshape(b, -1)
