"""Attention over a paged KV cache: grouped-query attention and multi-head latent attention,
and the DSA sparse-attention indexer (`DSAIndexer`) that hybrid families put in front of MLA.

The cache of one layer is a dict of tensors whose first two dims are [pages, page_size];
flattened, a token's row is addressed by its flat slot (page * page_size + offset). New K/V
rows are scattered to `slot_mapping`, then each sequence gathers its whole context by
`kv_index` and runs SDPA. The per-sequence loop keeps every sequence's arithmetic independent
of what else is in the batch (batched decode gives the tokens each gives alone).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from tiermoe.models.batch import ForwardBatch
from tiermoe.models.blocks.common import Linear, RMSNorm, device_kernels
from tiermoe.models.blocks.graph_break import graph_break
from tiermoe.models.blocks.rope import apply_rotary, apply_rotary_interleaved
from tiermoe.models.spec import ModelSpec


# SDPA backends for one-token (decode) queries on CUDA: all but cuDNN. cuDNN attention builds an
# execution plan per input shape and per calling thread; a decode step attends over a context one
# token longer than the last, and the server steps on its own thread, so every call paid a plan
# build in host time, many times the attention itself. Flash and memory-efficient attention need
# no plan. Prefill chunks keep cuDNN: their masked calls (q < context) have no other fused kernel
# with grouped-query attention.
DECODE_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dense_qk: bool = False) -> torch.Tensor:
    """q [q, Hq, D], k [ctx, Hk, D], v [ctx, Hk, Dv] -> [q, Hq, Dv]; causal with q at the end.

    dense_qk: pass q and k as contiguous [1, heads, len, D] (the reference builds them with a
    concatenation when rotary covers part of the head, or in MLA); otherwise they are the
    head-transposed views the reference passes. SDPA picks kernels, and so rounding, by rank
    and memory layout, so both are mirrored.
    """
    q_len, ctx = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if dense_qk:
        qh, kh = qh.contiguous(), kh.contiguous()
    gqa = qh.shape[1] != kh.shape[1]
    if q_len == ctx:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    elif q_len == 1:
        # on CUDA not cuDNN: it builds a plan per context length and per thread (DECODE_SDPA_BACKENDS)
        with sdpa_kernel(DECODE_SDPA_BACKENDS) if q.is_cuda else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=gqa)
    else:
        rows = torch.arange(q_len, device=q.device)[:, None] + (ctx - q_len)
        mask = torch.arange(ctx, device=q.device)[None, :] <= rows  # [q, ctx]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


class GQAttention(nn.Module):
    """Llama-style attention with optional qkv bias, per-head or full q/k norm, partial rotary."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, d
        self.q_proj = Linear(h, spec.num_heads * d, spec.qkv_bias)
        self.k_proj = Linear(h, spec.num_kv_heads * d, spec.qkv_bias)
        self.v_proj = Linear(h, spec.num_kv_heads * d, spec.qkv_bias)
        self.o_proj = Linear(spec.num_heads * d, h, spec.o_bias)
        self.qk_norm = spec.qk_norm
        if spec.qk_norm == "head":
            self.q_norm = RMSNorm(d, spec.rms_norm_eps)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps)
        elif spec.qk_norm == "full":
            self.q_norm = RMSNorm(spec.num_heads * d, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.num_kv_heads * d, spec.rms_norm_eps)
        self.clip_qkv = spec.clip_qkv
        self.scale = spec.attn_scale if spec.attn_scale is not None else d**-0.5

    def cache_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"k": (self.num_kv_heads, self.head_dim), "v": (self.num_kv_heads, self.head_dim)}

    def forward(self, x, cos, sin, batch: ForwardBatch, cache: dict[str, torch.Tensor]) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [T, heads * D]
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (z.clamp(-self.clip_qkv, self.clip_qkv) for z in (q, k, v))
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        self._partial_rotary = cos.shape[-1] != self.head_dim  # the reference concatenates q and k
        if batch.block_table is not None:  # static shapes: nothing for a decode graph to break at
            out = self._paged_decode_core(q, k, v, batch, cache)  # [B, heads, D]
        else:
            out = graph_break(self._core, (q, k, v), batch, cache)  # [T, heads, D]
        return self.o_proj(out.reshape(t, -1))

    def _paged_decode_core(self, q, k, v, batch: ForwardBatch, cache: dict[str, torch.Tensor]) -> torch.Tensor:
        """One token per sequence: write its K/V rows, attend through the block tables with the
        paged decode kernel (no host sync, shapes fixed by B): q [B, Hq, D] -> [B, Hq, D]."""
        from tiermoe.kernels.triton.paged_attention import paged_decode_attention

        k_flat, v_flat = self._write_kv(k, v, batch, cache)
        return paged_decode_attention(q.to(k_flat.dtype), k_flat, v_flat, batch.block_table, batch.seq_lens,
                                      self.scale, cache["k"].shape[1]).to(q.dtype)

    def _write_kv(self, k, v, batch: ForwardBatch, cache: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's K/V rows [T, Hk, D] into their cache slots; returns the caches as [slots, Hk, D]."""
        k_flat = cache["k"].view(-1, self.num_kv_heads, self.head_dim)
        v_flat = cache["v"].view(-1, self.num_kv_heads, self.head_dim)
        k_flat[batch.slot_mapping] = k.to(k_flat.dtype)
        v_flat[batch.slot_mapping] = v.to(v_flat.dtype)
        return k_flat, v_flat

    def _core(self, q, k, v, batch: ForwardBatch, cache: dict[str, torch.Tensor]) -> torch.Tensor:
        """Write the step's K/V rows, attend per sequence: q [T, Hq, D], k/v [T, Hk, D] -> [T, Hq, D]."""
        k_flat, v_flat = self._write_kv(k, v, batch, cache)
        out = torch.empty(q.shape[0], self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        for s in batch.seqs:
            qs = q[s.q_start : s.q_start + s.q_len]
            out[s.q_start : s.q_start + s.q_len] = _attend(qs, k_flat[s.kv_index], v_flat[s.kv_index], self.scale,
                                                              self._partial_rotary)
        return out


class MLAttention(nn.Module):
    """DeepSeek multi-head latent attention; the cache holds the latent (normed c_kv + roped k_pe).

    Keys and values are expanded from the latent through kv_b_proj for each sequence's context,
    as the reference does (exact); an absorbed-weight decode path is a later optimisation.
    """

    def __init__(self, spec: ModelSpec):
        super().__init__()
        m = spec.mla
        assert m is not None
        h, nh = spec.hidden_size, spec.num_heads
        self.m, self.num_heads = m, nh
        self.qk_head_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank is None:
            self.q_proj = Linear(h, nh * self.qk_head_dim)
        else:
            self.q_a_proj = Linear(h, m.q_lora_rank, spec.qkv_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, spec.rms_norm_eps)
            self.q_b_proj = Linear(m.q_lora_rank, nh * self.qk_head_dim)
        self.kv_a_proj_with_mqa = Linear(h, m.kv_lora_rank + m.qk_rope_head_dim, spec.qkv_bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, spec.rms_norm_eps)
        self.kv_b_proj = Linear(m.kv_lora_rank, nh * (m.qk_nope_head_dim + m.v_head_dim))
        self.o_proj = Linear(nh * m.v_head_dim, h, spec.o_bias)
        self.scale = spec.attn_scale if spec.attn_scale is not None else self.qk_head_dim**-0.5
        self.rotate = apply_rotary_interleaved if m.rope_interleave else apply_rotary

    def cache_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"latent": (self.m.kv_lora_rank + self.m.qk_rope_head_dim,)}

    def forward(self, x, cos, sin, batch: ForwardBatch, cache: dict[str, torch.Tensor]) -> torch.Tensor:
        m, nh, t = self.m, self.num_heads, x.shape[0]
        if m.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, nh, self.qk_head_dim)
        q_nope, q_rot = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        kv_nope, k_rot = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv_nope = self.kv_a_layernorm(kv_nope)  # [T, kv_lora]
        q_rot = self.rotate(q_rot, cos, sin)
        k_rot = self.rotate(k_rot[:, None, :], cos, sin)[:, 0]  # [T, rope]
        q = torch.cat((q_nope, q_rot), dim=-1)
        new_rows = torch.cat((kv_nope, k_rot), dim=-1)  # [T, kv_lora + rope]
        out = graph_break(self._core, (q, new_rows), batch, cache)  # [T, heads, Dv]
        return self.o_proj(out.reshape(t, -1))

    def _core(self, q, new_rows, batch: ForwardBatch, cache: dict[str, torch.Tensor]) -> torch.Tensor:
        """Write the step's latent rows, expand and attend per sequence: q [T, heads, Dqk] -> [T, heads, Dv]."""
        m, nh = self.m, self.num_heads
        latent = cache["latent"].view(-1, m.kv_lora_rank + m.qk_rope_head_dim)
        latent[batch.slot_mapping] = new_rows.to(latent.dtype)
        out = torch.empty(q.shape[0], nh, m.v_head_dim, dtype=q.dtype, device=q.device)
        for s in batch.seqs:
            lat = latent[s.kv_index]  # [ctx, kv_lora + rope]
            kv = self.kv_b_proj(lat[:, : m.kv_lora_rank]).view(-1, nh, m.qk_nope_head_dim + m.v_head_dim)
            k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
            k_pe = lat[:, None, m.kv_lora_rank :].expand(-1, nh, -1)
            k = torch.cat((k_nope, k_pe), dim=-1)
            qs = q[s.q_start : s.q_start + s.q_len]
            out[s.q_start : s.q_start + s.q_len] = _attend(qs, k, v, self.scale, dense_qk=True)
        return out


class DSAIndexer(nn.Module):
    """DeepSeek sparse attention (DSA) indexer with k-pool compression: picks, per query, which
    cached tokens a sparse attention reads.

    Cache rows per token: the LayerNormed indexer key and the k-pool gate score ([2 * head_dim]).
    Selection for a query at absolute position p over L cached rows:
    - complete pools j (tokens [jP, jP+P), jP+P <= L) are candidates if their last token <= p;
      each pool key is a softmax(gate + ape)-weighted mean of its tokens' indexer keys;
    - score(j) = sum_h w_h * relu(q_h . key_j / sqrt(d)), the top topk/P pools are taken
      (exact ties go to the lower pool);
    - with `always_select_tail`, the tokens of p's own incomplete pool are added.
    The result is an index list [S, width] padded with -1. Sizes are plain ints so any family
    with DSA layers builds it from its own config; `q_lora_rank` is the width of the attention's
    normed q latent that the indexer's queries are projected from.
    """

    def __init__(
        self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, topk: int, kpool: int,
        always_select_tail: bool,
    ):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.topk, self.kpool = topk, kpool
        self.tail = always_select_tail
        self.wq_b = nn.Linear(q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden_size, self.n_heads, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(self.kpool, self.head_dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(self.head_dim, hidden_size))

    @property
    def width(self) -> int:
        """Indices per query: topk tokens of whole pools, plus P-1 for the incomplete tail pool."""
        return self.topk + (self.kpool - 1 if self.tail else 0)

    def projections(self) -> list[tuple[nn.Module, str]]:
        """The weights that project the layer input x, in `project`'s order, as (module, attribute): the
        attention merges them with its own x-projections into one GEMM on a CUDA device (fused_linear.py)."""
        return [(self.wk, "weight"), (self, "index_kpool_compress_gate"), (self.weights_proj, "weight")]

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (raw keys [T, d], k-pool gate scores [T, d], head logits [T, nh]), one at a time."""
        heads = self.weights_proj(x.to(self.weights_proj.weight.dtype))
        return self.wk(x), F.linear(x, self.index_kpool_compress_gate), heads

    def token_rows(self, keys: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """Per-token cache rows [T, 2d] from `project`'s keys and gate scores: LayerNormed key | gate score."""
        return torch.cat([self.k_norm(keys), gates], dim=-1)

    def queries(self, q_resid: torch.Tensor, heads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q_resid [T, q_lora] (the attention's normed q latent), `project`'s head logits [T, nh] ->
        (q [T, nh, d], head weights [T, nh] fp32)."""
        q = self.wq_b(q_resid).view(q_resid.shape[0], self.n_heads, self.head_dim)
        return q, heads.float() * (self.n_heads ** -0.5)

    def select(self, q: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, start: int) -> torch.Tensor:
        """q [S, nh, d], w [S, nh], rows [L, 2d] (all cached rows) -> token indices [S, width]."""
        s, d, p = q.shape[0], self.head_dim, self.kpool
        length = rows.shape[0]
        dev = q.device
        pos = torch.arange(start, start + s, device=dev)  # [S]
        npools = length // p
        if npools > 0:
            keys = rows[: npools * p, :d].view(1, npools, p, d)
            gates = rows[: npools * p, d:].view(1, npools, p, d)
            prob = (gates.float() + self.index_kpool_compress_ape.float()[None, None]).softmax(dim=2).to(keys.dtype)
            pool_keys = (prob * keys).sum(dim=2)  # [1, np, d]
            scores = torch.matmul(q.float()[None], pool_keys.transpose(-1, -2).float().unsqueeze(1))  # [1,S,nh,np]
            scores = F.relu(scores * (d ** -0.5))
            index_scores = torch.matmul(w[None].unsqueeze(-2), scores).squeeze(-2)  # [1, S, np]
            pool_end = torch.arange(npools, device=dev) * p + (p - 1)
            valid = pool_end[None, None, :] <= pos[None, :, None]  # [1, S, np]
            index_scores = index_scores.masked_fill(~valid, torch.finfo(index_scores.dtype).min)
            k = min(self.topk // p, npools)
            # Stable descending sort instead of topk: among exactly equal scores (ReLU makes
            # exact zeros common) the lower pool wins, so the choice does not depend on how
            # many pools the tensor has, i.e. on prefill chunking or decode step.
            chosen = torch.sort(index_scores, dim=-1, descending=True, stable=True).indices[..., :k]  # [1, S, k]
            chosen_ok = valid.gather(-1, chosen)
            tokens = chosen[..., None] * p + torch.arange(p, device=dev)  # [1, S, k, P]
            idx = tokens.masked_fill(~chosen_ok[..., None], -1).flatten(-2)[0]  # [S, k*P]
        else:
            idx = torch.empty(s, 0, dtype=torch.long, device=dev)
        if self.tail and p > 1:
            seen = pos + 1
            count = seen.remainder(p)
            offs = torch.arange(p - 1, device=dev)
            tail = (seen - count)[:, None] + offs  # [S, P-1]
            ok = (offs[None, :] < count[:, None]) & (tail < length)
            idx = torch.cat([idx, tail.masked_fill(~ok, -1)], dim=-1)
        return F.pad(idx, (0, self.width - idx.shape[-1]), value=-1)[:, : self.width]

    def select_decode(
        self, q: torch.Tensor, w: torch.Tensor, idx_rows: torch.Tensor, table_rows: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """One query a sequence, at its last position: q [B, nh, d], w [B, nh], idx_rows [S, 2d] (the layer's
        whole row cache), table_rows [B, Lmax] (the row of every position of each sequence's block table;
        those past its length are padding), seq_lens [B] -> token indices [B, width].

        The lists `select` gives each sequence alone, with shapes set by B and Lmax only (a decode CUDA
        graph captures it whole): every table pool is scored, those not complete by the query masked
        out, which a stable sort puts after every real candidate; the tail goes where `select` puts it,
        right after the sequence's own min(topk / P, L // P) pool slots.

        On a CUDA device with no gradient to carry that is two Triton launches reading the rows through
        the table (kernels/triton/dsa_decode.py), where torch issues a [B, Lmax, 2d] gather, ~60 tiny
        kernels and a radix sort per layer; elsewhere the twins (kernels/reference_dsa.py: this method's
        torch code, so CPU results are unchanged). Both give the same integers wherever the pool scores
        are not so close that float32 rounding reorders them."""
        if device_kernels(q, w, idx_rows, self.index_kpool_compress_ape):
            from tiermoe.kernels.triton.dsa_decode import dsa_pool_scores as pool_scores
            from tiermoe.kernels.triton.dsa_decode import dsa_select as select
        else:
            from tiermoe.kernels.reference_dsa import dsa_pool_scores_ref as pool_scores
            from tiermoe.kernels.reference_dsa import dsa_select_ref as select
        scores = pool_scores(q, w, idx_rows, table_rows, seq_lens, self.index_kpool_compress_ape, self.kpool)
        return select(scores, seq_lens, self.topk // self.kpool, self.kpool, self.tail, self.width)  # [B, W]
