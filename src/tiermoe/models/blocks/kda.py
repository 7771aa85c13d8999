"""Kimi Delta Attention (KDA): a linear-attention token mixer for hybrid models.

Per sequence a KDA layer carries two pieces of state between forward calls:
- the short-convolution window: the last `K-1` pre-convolution q|k|v rows, [3C, K-1];
- the delta-rule recurrent state, [H, dk, dv] in fp32.
Both live in a state store of static per-slot rows (`KDAStateStore`; glm5_next's is
`KDAStates`), so any set of sequences can run in one batch.

Prefill (several new tokens) uses the chunked (WY) form with 64-token chunks; single-token
decode uses the recurrent form, batched over all decoding sequences: their rows of the store's
[num_slots, ...] tensors are addressed by the batch's device tensor of slot ids, so a pure decode
step has no per-sequence Python, no host sync and fixed addresses (a CUDA graph records it once
and replays it for any slots). A pure decode step (every sequence one token, none `keep`) runs
everything between the projections and o_proj as two Triton launches on CUDA
(kernels/triton/kda_decode.py: conv window step; delta-rule step on the state rows in place plus
the output norm and gate), elsewhere or wherever a gradient is needed as their plain-torch twins
(kernels/reference_kda.py, which also holds the delta rule, forget gate and output norm this
module uses); the decode tokens of a mixed batch gather and scatter their rows. On a CUDA device the
layer's input projections are merged GEMMs (`_project`, blocks/fused_linear.py). Speculative verification
(`batch.keep[b]`) runs the recurrent form and records the state after every token, so the
store can roll back to any accepted prefix. Math and dtype handling follow transformers'
reference (`chunk_kimi_delta_attention` / `recurrent_kimi_delta_attention`).

The block takes plain sizes, not a family's config class, so any hybrid family builds it from
its own config; module names are the checkpoint's (`q_proj`, `conv1d.weight`, `forget_gate.*`).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from tiermoe.kernels.reference_kda import (
    kda_conv_step_ref,
    kda_decode_core_ref,
    kda_forget_gate_ref,
    kda_output_ref,
    kda_recurrent,
    kda_recurrent_step_ref,
    l2norm,
)
from tiermoe.models.blocks.common import device_kernels
from tiermoe.models.blocks.fused_linear import ProjectionGroup


class KDABatch(Protocol):
    """Flat token layout of one forward: sequence b owns rows [cu[b], cu[b] + lens[b]) and
    state slot `slots[b]` (`slot_ids` [B] long: the same on the device); `keep[b]` asks for
    every intermediate state (rollback)."""

    lens: list[int]
    cu: list[int]
    slots: list[int]
    slot_ids: torch.Tensor
    keep: list[bool]


class KDAStateStore(Protocol):
    """Per-slot KDA state: conv window [3C, K-1] and delta state [H, dk, dv] fp32 per layer,
    as rows of static tensors ([num_slots, ...] per layer) that decode indexes by slot id.

    The setters (per-sequence path) take the batch and the sequence index so a store can also
    record the intermediate states of a `keep` sequence (`steps` [n+1, H, dk, dv], `window`
    [3C, K-1+n])."""

    conv_rows: dict[int, torch.Tensor]  # layer -> [num_slots, 3C, K-1]
    ssm_rows: dict[int, torch.Tensor]  # layer -> [num_slots, H, dk, dv] fp32

    def conv(self, layer: int, slot: int) -> torch.Tensor: ...

    def ssm(self, layer: int, slot: int) -> torch.Tensor: ...

    def set_conv(self, layer: int, batch: KDABatch, b: int, window: torch.Tensor) -> None: ...

    def set_ssm(self, layer: int, batch: KDABatch, b: int, state: torch.Tensor,
                steps: torch.Tensor | None = None) -> None: ...


KDA_CHUNK = 64  # tokens per block of the chunked (WY) prefill form, as in the reference


def kda_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, chunk: int = KDA_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY-representation) delta rule over a whole segment; same shapes as
    `kda_recurrent`, returns (out [B,S,H,dv] fp32, final state [B,H,dk,dv] fp32)."""
    q, k, v, beta, g = (t.transpose(1, 2).contiguous().float() for t in (q, k, v, beta, g))
    q = l2norm(q)
    k = l2norm(k)
    b, h, n, dk = k.shape
    dv = v.shape[-1]
    pad = (chunk - n % chunk) % chunk
    q = F.pad(q, (0, 0, 0, pad)) * (dk ** -0.5)
    k = F.pad(k, (0, 0, 0, pad))
    v = F.pad(v, (0, 0, 0, pad))
    g = F.pad(g, (0, 0, 0, pad))
    beta = F.pad(beta, (0, pad))
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, v, g, k_beta, v_beta = (t.reshape(b, h, -1, chunk, t.shape[-1]) for t in (q, k, v, g, k_beta, v_beta))

    g = g.cumsum(dim=-2)  # within-chunk cumulative log decay, per key channel
    incl = torch.triu(torch.ones(chunk, chunk, dtype=torch.bool, device=q.device), diagonal=0)
    strict = torch.triu(torch.ones(chunk, chunk, dtype=torch.bool, device=q.device), diagonal=1)
    decay = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(strict[..., None], float("-inf")).exp().float()
    attn = -(k_beta.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(dim=-1).masked_fill(incl, 0)
    for i in range(1, chunk):  # forward substitution: (I + A)^-1 row by row
        row = attn[..., i, :i].clone()
        sub = attn[..., :i, :i].clone()
        attn[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
    attn = attn + torch.eye(chunk, dtype=attn.dtype, device=attn.device)
    v = attn @ v_beta
    k_cumdecay = attn @ (k_beta * g.exp())

    s = state.float()
    out = torch.zeros_like(v)
    for i in range(v.shape[2]):
        q_i, k_i, v_i, g_i = q[:, :, i], k[:, :, i], v[:, :, i], g[:, :, i]
        inter = (q_i * g_i.exp()) @ s
        intra = (q_i.unsqueeze(-2) * k_i.unsqueeze(-3) * decay[:, :, i]).sum(dim=-1).masked_fill(strict, 0)
        v_new = v_i - k_cumdecay[:, :, i] @ s
        out[:, :, i] = inter + intra @ v_new
        s = s * g_i[:, :, -1].exp().unsqueeze(-1) + (k_i * (g_i[:, :, -1:] - g_i).exp()).transpose(-1, -2) @ v_new
    out = out.reshape(b, h, -1, dv)[:, :, :n].transpose(1, 2).contiguous()
    return out, s


class _Conv(nn.Module):
    """Holds the depthwise short-conv weight under the checkpoint's `conv1d.weight` name."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=torch.float32))


class ForgetGate(nn.Module):
    """The forget gate's weights. Per-channel log-decay g = lower_bound * sigmoid(exp(A_log) * (f_b(f_a(x)) +
    dt_bias)), or -exp(A_log) * softplus(...) without a lower bound: `kda_forget_gate_ref` of f_b(f_a(x)), whose
    projections `KDAttention._project` computes with the layer's others."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, lower_bound: float | None):
        super().__init__()
        d, c = head_dim, num_heads * head_dim
        self.head_dim = d
        self.f_a_proj = nn.Linear(hidden_size, d, bias=False)
        self.f_b_proj = nn.Linear(d, c, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(c, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(num_heads, dtype=torch.float32))
        self.lower_bound = lower_bound


class KDAttention(nn.Module):
    """One KDA token mixer; `forward` reads and updates the slots named by the batch.

    hidden_size -> num_heads x head_dim (C = num_heads * head_dim channels each for q, k, v);
    conv_kernel is the short-conv width K, norm_eps the output RMSNorm's epsilon, lower_bound
    the forget gate's (None: softplus form). `layer_idx` keys this layer's state in the store."""

    def __init__(
        self, layer_idx: int, hidden_size: int, num_heads: int, head_dim: int, conv_kernel: int,
        norm_eps: float, lower_bound: float | None,
    ):
        super().__init__()
        hid, c = hidden_size, num_heads * head_dim
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim, self.qkv_dim = num_heads, head_dim, c
        self.kernel = conv_kernel
        self.eps = norm_eps
        self.q_proj = nn.Linear(hid, c, bias=False)
        self.k_proj = nn.Linear(hid, c, bias=False)
        self.v_proj = nn.Linear(hid, c, bias=False)
        self.conv1d = _Conv(3 * c, self.kernel)
        self.forget_gate = ForgetGate(hid, num_heads, head_dim, lower_bound)
        self.b_proj = nn.Linear(hid, num_heads, bias=False)
        self.g_a_proj = nn.Linear(hid, self.head_dim, bias=False)
        self.g_b_proj = nn.Linear(self.head_dim, c, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(self.head_dim))
        self.o_proj = nn.Linear(c, hid, bias=False)
        fg = self.forget_gate
        # x's six projections as one GEMM on a CUDA device, and the two gates' second halves as one batched
        # GEMM (blocks/fused_linear.py); q, k, v first and adjacent, so their rows are one [T, 3C] slice
        self.in_group = ProjectionGroup([(self.q_proj, "weight"), (self.k_proj, "weight"), (self.v_proj, "weight"),
                                         (fg.f_a_proj, "weight"), (self.g_a_proj, "weight"), (self.b_proj, "weight")])
        self.gate_group = ProjectionGroup([(fg.f_b_proj, "weight"), (self.g_b_proj, "weight")])

    def fuse_projections(self) -> None:
        """Merge the projection weights into the groups' buffers (no extra memory; see fused_linear.py)."""
        self.in_group.fuse()
        self.gate_group.fuse()

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (qkv [T, 3C] pre-conv, forget-gate input f [T, C], beta logits [T, H], output gate
        [T, C]). Merged on a CUDA device (three GEMMs become two launches, nine become three); elsewhere each
        projection alone, as the reference computes them."""
        fg, c, d = self.forget_gate, self.qkv_dim, self.head_dim
        if not self.in_group.active(x):
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [T, 3C]
            return qkv, fg.f_b_proj(fg.f_a_proj(x)), self.b_proj(x), self.g_b_proj(self.g_a_proj(x))
        qkv, halves, beta_logits = self.in_group(x).split([3 * c, 2 * d, self.num_heads], dim=-1)
        halves = halves.unflatten(-1, (2, d)).transpose(0, 1)  # [2, T, d]: f_a's and g_a's outputs
        if self.gate_group.active(halves):
            f, gate = self.gate_group.batched(halves)  # [T, C] each
        else:
            f, gate = fg.f_b_proj(halves[0]), self.g_b_proj(halves[1])
        return qkv, f, beta_logits, gate

    @staticmethod
    def _decoding(batch: KDABatch, device: torch.device) -> tuple[list[int], torch.Tensor | None, torch.Tensor]:
        """The single-token sequences that take the batched recurrent step (not `keep` ones):
        (their indices b, their token rows [B'] or None when they are the whole batch in order,
        their slot ids [B'] on the device). A pure decode step builds no tensor here: rows are
        all rows and the ids are the batch's own (a decode graph's static tensor)."""
        decode = [b for b, n in enumerate(batch.lens) if n == 1 and not batch.keep[b]]
        if len(decode) == len(batch.lens):
            return decode, None, batch.slot_ids
        rows = torch.tensor([batch.cu[b] for b in decode], dtype=torch.long, device=device)
        return decode, rows, batch.slot_ids.index_select(0, torch.tensor(decode, dtype=torch.long, device=device))

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether a pure decode step takes the Triton kernels (kernels/triton/kda_decode.py): on CUDA when
        nothing needs a gradient (the kernels carry none); elsewhere the twins, the same torch code as
        before the kernels (kernels/reference_kda.py)."""
        return device_kernels(x, *self.parameters())

    def _conv(self, qkv: torch.Tensor, batch: KDABatch, states: KDAStateStore) -> torch.Tensor:
        """Causal depthwise conv + SiLU over each sequence, continuing its cached window (batches other
        than a pure decode step, which `_decode_step` takes whole)."""
        w = self.conv1d.weight  # [3C, 1, K] fp32
        out = torch.empty_like(qkv)  # [T, 3C]
        layer = self.layer_idx
        decode, rows, ids = self._decoding(batch, qkv.device)
        if decode:  # the single-token sequences: one window step for all of them
            y = kda_conv_step_ref(qkv if rows is None else qkv[rows], states.conv_rows[layer], ids, w)
            if rows is None:
                return y
            out[rows] = y
        for b, n in enumerate(batch.lens):
            if n == 1 and not batch.keep[b]:
                continue
            lo = batch.cu[b]
            win = torch.cat([states.conv(layer, batch.slots[b]), qkv[lo:lo + n].t()], dim=-1)  # [3C, K-1+n]
            y = F.silu(F.conv1d(win.unsqueeze(0).to(w.dtype), w, groups=w.shape[0]))  # [1, 3C, n]
            out[lo:lo + n] = y[0].t().to(qkv.dtype)
            states.set_conv(layer, batch, b, win)
        return out

    def _decode_step(self, x: torch.Tensor, ids: torch.Tensor, states: KDAStateStore) -> torch.Tensor:
        """A pure decode step (every sequence one token, none `keep`, rows in batch order): x [B, hidden]
        -> [B, hidden]. On CUDA without gradients two Triton launches do everything between the
        projections and o_proj, reading and writing the state rows in place; elsewhere their twins, the
        torch operations this step ran before the kernels existed, in the same order (bit-identical)."""
        bsz = x.shape[0]
        h, d, layer = self.num_heads, self.head_dim, self.layer_idx
        if self._fused(x):
            from tiermoe.kernels.triton.kda_decode import kda_conv_step as conv_step
            from tiermoe.kernels.triton.kda_decode import kda_recurrent_step as recurrent_step
        else:
            conv_step, recurrent_step = kda_conv_step_ref, kda_recurrent_step_ref
        qkv, f, beta_logits, gate = self._project(x)
        qkv = conv_step(qkv, states.conv_rows[layer], ids, self.conv1d.weight)
        q, k, v = (z.reshape(bsz, h, d) for z in qkv.split(self.qkv_dim, dim=-1))
        fg = self.forget_gate
        y = recurrent_step(
            q, k, v, f, fg.dt_bias, fg.A_log, fg.lower_bound, beta_logits, gate, states.ssm_rows[layer], ids,
            self.o_norm.weight, self.eps,
        )  # [B, H*dv]
        return self.o_proj(y)

    def forward(self, x: torch.Tensor, batch: KDABatch, states: KDAStateStore) -> torch.Tensor:
        """x [T, hidden] (flat tokens of the batch) -> [T, hidden]; updates the slots' states."""
        t = x.shape[0]
        h, d, layer = self.num_heads, self.head_dim, self.layer_idx
        decode, rows, ids = self._decoding(batch, x.device)
        if decode and rows is None:
            return self._decode_step(x, ids, states)
        qkv, f, beta_logits, gate = self._project(x)
        qkv = self._conv(qkv, batch, states)
        q, k, v = (z.reshape(t, h, d) for z in qkv.split(self.qkv_dim, dim=-1))
        fg = self.forget_gate
        g = kda_forget_gate_ref(f, fg.dt_bias, fg.A_log, fg.lower_bound, d)  # [T, H, dk] fp32
        beta = torch.sigmoid(beta_logits)  # [T, H]
        core = torch.empty(t, h, d, dtype=torch.float32, device=x.device)

        if decode:  # the single-token sequences of a mixed batch: one recurrent step for all of them
            core[rows] = kda_decode_core_ref(q[rows], k[rows], v[rows], g[rows], beta[rows], states.ssm_rows[layer],
                                             ids)
        for b, n in enumerate(batch.lens):
            if n == 1 and not batch.keep[b]:
                continue
            lo, hi = batch.cu[b], batch.cu[b] + n
            s0 = states.ssm(layer, batch.slots[b])[None]
            args = (q[None, lo:hi], k[None, lo:hi], v[None, lo:hi], g[None, lo:hi], beta[None, lo:hi], s0)
            if batch.keep[b]:
                o, s1, steps = kda_recurrent(*args, keep_states=True)
                states.set_ssm(layer, batch, b, s1[0], steps[:, 0])
            else:
                o, s1 = kda_chunked(*args)
                states.set_ssm(layer, batch, b, s1[0])
            core[lo:hi] = o[0]

        y = kda_output_ref(core.to(x.dtype), gate.view(t, h, d), self.o_norm.weight, self.eps)
        return self.o_proj(y.reshape(t, -1))
