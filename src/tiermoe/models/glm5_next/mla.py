"""NoPE multi-head latent attention with the DSA k-pool sparse indexer (glm5_next MLA layers).

The indexer is the shared block `models/blocks/attention.py: DSAIndexer`; this layer owns the
per-sequence row cache, the full/shared indexer schedule and the two attention paths.

Cache: per sequence the layer keeps the RMS-normalized `kv_a` latent ([L, kv_lora_rank]) and,
for layers with their own ("full") indexer, the indexer key and k-pool gate score per token
([L, 2*d_index]). Keys/values are re-expanded from the latent (prefill) or the query is
absorbed into latent space (decode), so no per-head K/V is ever stored.

Selection (per query at absolute position p, sequence length L after this forward):
- complete pools j (tokens [jP, jP+P), jP+P <= L) are candidates if their last token <= p;
  each pool key is a softmax(gate + ape)-weighted mean of its tokens' indexer keys;
- score(j) = sum_h w_h * relu(q_h . key_j / sqrt(d)), the top index_topk/P pools are taken
  (exact ties go to the lower pool; the reference's topk leaves that choice unspecified);
- with index_kpool_always_select_tail, the tokens of p's own incomplete pool are added.
A "shared" layer reuses the selection of the full layer just before it. The selection is an
index list [S, index_topk + P - 1] padded with -1, exactly as transformers builds it; one
forward's selections are rows of one [T, W] tensor (the layer hands it to the next).

A pure decode step that carries block tables (the runner's paged decode attention, on a CUDA
device up to engine.STATIC_DECODE_MAX_LEN) runs the whole layer with static shapes: rows stored
at the step's slot mapping, every table position's indexer rows pooled and scored (pools not yet
complete masked, a stable sort puts them after every real candidate: `DSAIndexer.select_decode`
gives each sequence `select`'s exact list) and the absorbed attention batched over sequences, so
a decode CUDA graph captures the step whole. Other steps run the per-sequence core (rows written,
selection, attention: shapes that change every step), the eager part between two graph pieces.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tiermoe.models.blocks.attention import DSAIndexer
from tiermoe.models.blocks.fused_linear import ProjectionGroup
from tiermoe.models.blocks.graph_break import graph_break

from .cache import SeqBatch
from .config import Glm5NextConfig
from .layers import RMSNorm

# Up to this many new tokens per sequence, attention gathers the selected latent rows and
# works in latent space (absorbed); longer segments expand K/V and use a dense masked SDPA.
GATHER_MAX_TOKENS = 8


def dsa_indexer(cfg: Glm5NextConfig) -> DSAIndexer:
    """The DSA indexer of a "full" MLA layer, sized from the family's `index_*` fields."""
    return DSAIndexer(
        cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, cfg.index_kpool,
        cfg.index_kpool_always_select_tail,
    )


class MLAttention(nn.Module):
    """NoPE MLA token mixer with a full or shared DSA indexer."""

    def __init__(self, cfg: Glm5NextConfig, layer_idx: int):
        super().__init__()
        hid, h = cfg.hidden_size, cfg.num_attention_heads
        self.layer_idx, self.num_heads = layer_idx, h
        self._pieces: list[bool] = []  # the last forward's prefill pieces per sequence (forward, _attend)
        self.r, self.dk, self.dv = cfg.kv_lora_rank, cfg.qk_head_dim, cfg.v_head_dim
        self.scaling = self.dk ** -0.5
        self.q_a_proj = nn.Linear(hid, cfg.q_lora_rank, bias=cfg.attention_bias)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * self.dk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hid, self.r + cfg.qk_rope_head_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.r, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.r, h * (self.dk + self.dv), bias=False)
        self.o_proj = nn.Linear(h * self.dv, hid, bias=cfg.attention_bias)
        self.indexer = None if cfg.shares_topk(layer_idx) else dsa_indexer(cfg)
        self.hands_on = layer_idx < cfg.num_hidden_layers and cfg.hands_topk_on(layer_idx)
        # every projection of x as one GEMM on a CUDA device (blocks/fused_linear.py); not with biases, which the
        # merged product would leave out
        owners = [(self.q_a_proj, "weight"), (self.kv_a_proj_with_mqa, "weight")]
        owners += self.indexer.projections() if self.indexer is not None else []
        self.x_group = None if cfg.attention_bias else ProjectionGroup(owners)

    def fuse_projections(self) -> None:
        """Merge the x-projections into one weight buffer (no extra memory; see blocks/fused_linear.py)."""
        if self.x_group is not None:
            self.x_group.fuse()

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
        """x [T, hidden] -> (q_a [T, q_lora], kv_a [T, r + rope], the indexer's `project` of x or None): one
        merged GEMM on a CUDA device, elsewhere each projection alone as the reference computes it."""
        if self.x_group is not None and self.x_group.active(x):
            q_a, kv_a, *index = self.x_group(x).split(self.x_group.sizes, dim=-1)
            return q_a, kv_a, (tuple(index) if self.indexer is not None else None)
        index = self.indexer.project(x) if self.indexer is not None else None
        return self.q_a_proj(x), self.kv_a_proj_with_mqa(x), index

    def forward(
        self, x: torch.Tensor, batch: SeqBatch, cache, prev_sel: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, hidden] -> ([T, hidden], selection [T, W] long for a following shared layer).

        Projections, norms and the indexer's per-token rows and queries have static shapes;
        the rest needs each sequence's whole context (rows written, DSA selection, attention)
        and is the attention core, a `graph_break`: eager between the pieces of a decode CUDA
        graph, replayed with each step's batch. `cache.attention_step(batch)` names what the
        core reads: the step (whose layout the row store understands) and the row store, whose
        `mla_rows(name, layer, step, b, rows)` stores this forward's rows of sequence b and
        returns all of its rows (see cache.py)."""
        t = x.shape[0]
        q_a, kv_a, index = self._project(x)
        q_resid = self.q_a_layernorm(q_a)  # [T, q_lora]
        q = self.q_b_proj(q_resid).view(t, self.num_heads, self.dk)
        latent = self.kv_a_layernorm(kv_a[:, : self.r])  # [T, r]
        step, rows = cache.attention_step(batch)
        # per sequence: a prefill piece (several new tokens, not a speculative verify), which attends with expanded
        # K/V however short it is (_attend); read by the eager core below (host state, never by a graph)
        self._pieces = [n > 1 and not keep for n, keep in zip(batch.lens, batch.keep)]
        tables = rows.decode_tables(self.layer_idx, step)  # a decode step through block tables: no break
        if self.indexer is not None:
            keys, gates, heads = index
            index_rows = self.indexer.token_rows(keys, gates)  # [T, 2d]
            iq, iw = self.indexer.queries(q_resid, heads)  # [T, nh, d], [T, nh]
            if tables is not None:
                lat_flat = rows.decode_rows("latent", self.layer_idx, step, latent)  # [slots, r]
                idx_flat = rows.decode_rows("index", self.layer_idx, step, index_rows)  # [slots, 2d]
                sel = self.indexer.select_decode(iq, iw, idx_flat, tables[1], tables[0])  # [B, W]
                out = self._attend_decode(q, lat_flat, sel, tables)
            else:
                sel = torch.empty(t, self.indexer.width, dtype=torch.long, device=x.device)  # the core fills it
                out = graph_break(self._core_indexed, (q, latent, index_rows, iq, iw, sel), step, rows)
        elif prev_sel is None:
            raise RuntimeError(f"layer {self.layer_idx}: shared DSA layer without a previous selection")
        else:
            sel = prev_sel
            if tables is not None:
                out = self._attend_decode(q, rows.decode_rows("latent", self.layer_idx, step, latent), sel, tables)
            else:
                out = graph_break(self._core_shared, (q, latent, sel), step, rows)
        y = self.o_proj(out.reshape(t, -1))  # out [T, H, dv]
        return y, (sel if self.hands_on else None)

    def _core_indexed(self, q, latent, index_rows, iq, iw, sel, step, rows) -> torch.Tensor:
        """A layer with its own indexer: store the rows, select per query (written into sel
        [T, W], which the next shared layer reads), attend. q [T, H, dk] -> [T, H, dv]."""
        out = torch.empty(q.shape[0], self.num_heads, self.dv, dtype=q.dtype, device=q.device)
        for b, (lo, start, n) in enumerate(rows.segments(step)):
            hi = lo + n
            lat = rows.mla_rows("latent", self.layer_idx, step, b, latent[lo:hi])  # [L, r]
            all_rows = rows.mla_rows("index", self.layer_idx, step, b, index_rows[lo:hi])  # [L, 2d]
            sel[lo:hi] = self.indexer.select(iq[lo:hi], iw[lo:hi], all_rows, start)
            out[lo:hi] = self._attend(q[lo:hi], lat, sel[lo:hi], self._piece(b))
        return out

    def _piece(self, b: int) -> bool:
        """Sequence b of the step the core runs for is a prefill piece (forward's `_pieces`; a replayed decode
        program's sequences are one token each, never pieces)."""
        return b < len(self._pieces) and self._pieces[b]

    def _core_shared(self, q, latent, sel, step, rows) -> torch.Tensor:
        """A shared layer: store the latent rows, attend over the previous layer's selection."""
        out = torch.empty(q.shape[0], self.num_heads, self.dv, dtype=q.dtype, device=q.device)
        for b, (lo, _, n) in enumerate(rows.segments(step)):
            hi = lo + n
            lat = rows.mla_rows("latent", self.layer_idx, step, b, latent[lo:hi])  # [L, r]
            out[lo:hi] = self._attend(q[lo:hi], lat, sel[lo:hi], self._piece(b))
        return out

    def _attend(self, q: torch.Tensor, lat: torch.Tensor, sel: torch.Tensor, piece: bool = False) -> torch.Tensor:
        """q [S, H, dk], lat [L, r], sel [S, W] -> [S, H, dv]: absorbed over the selected rows for a few
        queries of decode or verify, expanded K/V with a mask for longer segments and for every prefill
        `piece`, however short, as transformers does: a prompt's short last piece then rounds as the uncut
        prompt does, and its greedy tokens are the uncut prompt's."""
        if q.shape[0] <= GATHER_MAX_TOKENS and not piece:
            return self._attend_gather(q, lat, sel)
        return self._attend_dense(q, lat, sel)

    def _attend_dense(self, q: torch.Tensor, lat: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        """Expanded K/V over all L cached rows with the selection as a boolean mask."""
        length, h = lat.shape[0], self.num_heads
        kv = self.kv_b_proj(lat).view(length, h, self.dk + self.dv).transpose(0, 1)  # [H, L, dk+dv]
        k, v = kv.split([self.dk, self.dv], dim=-1)
        ok = (sel >= 0) & (sel < length)
        mask = torch.zeros(sel.shape[0], length, dtype=torch.int32, device=q.device)
        mask.scatter_add_(-1, sel.clamp(0, length - 1), ok.to(torch.int32))
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask.ne(0)[None, None], scale=self.scaling
        )  # [1, H, S, dv]
        return o[0].transpose(0, 1)

    def _attend_decode(self, q: torch.Tensor, lat_flat: torch.Tensor, sel: torch.Tensor,
                       tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """A decode step through block tables: q [B, H, dk] (one token a sequence), lat_flat [slots, r]
        (the layer's whole row cache), sel [B, W], tables (seq_lens [B], each position's row [B, Lmax])
        -> [B, H, dv]. The rows and mask `_attend_gather` gives each sequence, for all at once."""
        seq_lens, slots = tables
        ok = (sel >= 0) & (sel < seq_lens[:, None].long())  # [B, W]
        return self._absorbed(q, lat_flat[slots.gather(1, sel.clamp(min=0))], ok)  # rows [B, W, r]

    def _attend_gather(self, q: torch.Tensor, lat: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        """Absorbed MLA over the selected latent rows only of one sequence's lat [L, r]."""
        ok = (sel >= 0) & (sel < lat.shape[0])  # [S, W]
        return self._absorbed(q, lat[sel.clamp(0, lat.shape[0] - 1)], ok)  # rows [S, W, r]

    def _absorbed(self, q: torch.Tensor, rows: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        """q [S, H, dk], rows [S, W, r] (each query's selected latent rows), ok [S, W] -> [S, H, dv]:
        q is mapped into latent space through kv_b_proj's key half and the latent-weighted sum
        through its value half."""
        h = self.num_heads
        wkv = self.kv_b_proj.weight.view(h, self.dk + self.dv, self.r)
        w_uk, w_uv = wkv[:, : self.dk], wkv[:, self.dk:]  # [H, dk, r], [H, dv, r]
        q_lat = torch.einsum("shd,hdr->shr", q, w_uk)
        scores = torch.einsum("shr,swr->shw", q_lat, rows).float() * self.scaling
        scores = scores.masked_fill(~ok[:, None, :], float("-inf"))
        p = scores.softmax(dim=-1).to(q.dtype)
        o_lat = torch.einsum("shw,swr->shr", p, rows)
        return torch.einsum("shr,hvr->shv", o_lat, w_uv)
