"""The glm5_next text model: embeddings -> mHC decoder stack -> stream mean -> norm -> lm_head,
plus the optional MTP (next-n prediction) layer used for speculative decoding.

All sequence state lives in a cache object (`Glm5NextCache`, or the engine adapter's view of
the paged KV cache); `forward` takes flat tokens of several sequences (`SeqBatch`) so prefill
chunks and decode steps mix in one call. Routed experts go through `self.expert_backend`
(see moe.py), which the engine replaces with its tiered store.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tiermoe.models.blocks.common import reference_ops
from tiermoe.models.blocks.graph_break import layer_boundary
from tiermoe.models.blocks.hyperconnection import HyperConnection
from tiermoe.moe.experts import ExpertBackend, ResidentExperts

from .cache import Glm5NextCache, SeqBatch
from .config import Glm5NextConfig
from .kda import KDAttention, kda_attention
from .layers import MLP, RMSNorm
from .mla import MLAttention
from .moe import MoE


class DecoderLayer(nn.Module):
    """Token mixer (KDA or MLA) and FFN (dense or MoE), each wrapped in an mHC connection."""

    def __init__(self, cfg: Glm5NextConfig, i: int):
        super().__init__()
        self.is_kda, self.is_moe = cfg.is_kda(i), cfg.is_moe(i)
        self.self_attn = kda_attention(cfg, i) if self.is_kda else MLAttention(cfg, i)
        self.mlp = MoE(cfg, i) if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size, cfg.swiglu_limit)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        hc = (cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def forward(
        self, streams: torch.Tensor, batch: SeqBatch, cache, prev_sel: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """streams [T, N, D] -> (streams [T, N, D], DSA selection handed to the next layer)."""
        ln = self.input_layernorm
        post, comb, h = self.attn_hc.pre_norm(streams, ln.weight, ln.eps)  # h: input_layernorm(collapsed) [T, D]
        sel = None
        if self.is_kda:
            h = self.self_attn(h, batch, cache.kda)
        else:
            h, sel = self.self_attn(h, batch, cache, prev_sel)
        streams = HyperConnection.post(h, streams, post, comb)
        ln = self.post_attention_layernorm
        post, comb, h = self.ffn_hc.pre_norm(streams, ln.weight, ln.eps)
        h = self.mlp(h)
        return HyperConnection.post(h, streams, post, comb), sel


class SharedHead(nn.Module):
    def __init__(self, cfg: Glm5NextConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(nn.Module):
    """Next-n prediction block (checkpoint layer `num_hidden_layers`).

    DeepSeek-V3-style: h' = eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)]), then one plain
    pre-norm residual decoder layer (MLA with its own indexer + MoE, no mHC), then
    shared_head.norm and the trunk's lm_head give logits for t_{i+2}. `h_i` is the trunk's
    final normalized hidden state (what lm_head reads)."""

    def __init__(self, cfg: Glm5NextConfig):
        super().__init__()
        i = cfg.mtp_layer_idx
        d = cfg.hidden_size
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.shared_head = SharedHead(cfg)
        self.self_attn = MLAttention(cfg, i)
        self.mlp = MoE(cfg, i)
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, emb: torch.Tensor, prev_hidden: torch.Tensor, batch: SeqBatch, cache) -> torch.Tensor:
        """emb [T, D] (embeddings of t_{i+1}), prev_hidden [T, D] (h_i) -> MTP hidden [T, D]."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(prev_hidden)], dim=-1))
        a, _ = self.self_attn(self.input_layernorm(x), batch, cache, None)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))


def prefill_shaped(batch: SeqBatch) -> bool:
    """A step that only prefills: every sequence adds more than one token and none is a speculative verify
    (whose sequences keep their states to roll back). A step that mixes prompt pieces with decode rows keeps
    the kernels, so a decode row computes the same way whatever shares its step."""
    return all(n > 1 and not keep for n, keep in zip(batch.lens, batch.keep))


class Glm5NextModel(nn.Module):
    """glm5_next causal LM over explicit per-slot caches."""

    def __init__(self, cfg: Glm5NextConfig, with_mtp: bool = False):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = MTPLayer(cfg) if with_mtp else None
        self.expert_backend = None
        self.set_expert_backend(ResidentExperts(cfg.swiglu_limit))

    def moe_layers(self) -> list[MoE]:
        """MoE blocks in execution order (trunk, then the MTP layer when loaded)."""
        return [m for m in self.modules() if isinstance(m, MoE)]

    def set_expert_backend(self, backend: ExpertBackend) -> None:
        """Route every MoE layer's experts through `backend` (resident experts by default, a
        store backend when serving), telling it the layers once (`attach`)."""
        self.expert_backend = backend
        for m in self.moe_layers():
            m.backend = backend
        backend.attach(self.moe_layers())

    def fuse_projections(self) -> None:
        """Merge each layer's projections of one input into one weight buffer (models/blocks/fused_linear.py),
        trunk and MTP layer. The loader calls it on a CUDA device, the only place the merged GEMMs run; the
        parameters keep their names and shapes (views of the buffers)."""
        for m in self.modules():
            if isinstance(m, (KDAttention, MLP, MLAttention)):
                m.fuse_projections()

    def new_cache(self, num_slots: int, max_len: int) -> Glm5NextCache:
        p = self.embed_tokens.weight
        return Glm5NextCache(self.cfg, num_slots, max_len, p.device, p.dtype, mtp=self.mtp is not None)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, batch: SeqBatch, cache: Glm5NextCache) -> torch.Tensor:
        """input_ids [T] (flat, per `batch`) -> final normalized hidden states [T, D].

        Writes the new tokens' state into the batch's slots and advances their lengths."""
        self.begin(input_ids, batch, cache)
        hidden = self.layers_forward(input_ids, batch, cache)
        self.commit(batch, cache)
        return hidden

    def begin(self, input_ids: torch.Tensor, batch: SeqBatch, cache: Glm5NextCache) -> None:
        """Host bookkeeping before a forward's device work: checks, fresh slots zeroed, slot ids."""
        if input_ids.shape[0] != batch.num_tokens:
            raise ValueError(f"input_ids has {input_ids.shape[0]} tokens, batch expects {batch.num_tokens}")
        cache.check(batch)
        cache.kda.begin(batch)
        if batch.slot_ids is None:
            batch.slot_ids = torch.tensor(batch.slots, dtype=torch.long, device=input_ids.device)

    @staticmethod
    def commit(batch: SeqBatch, cache: Glm5NextCache) -> None:
        """Host bookkeeping after it: the slots now hold their new tokens."""
        cache.kda.commit(batch)
        cache.commit(batch)

    @torch.no_grad()
    def layers_forward(self, input_ids: torch.Tensor, batch: SeqBatch, cache: Glm5NextCache) -> torch.Tensor:
        """The device work of `forward` (what a decode graph records): [T] -> hidden [T, D]. A step of prompt
        pieces only (`prefill_shaped`) computes with the blocks' plain-torch twins, transformers' own ops
        (blocks/common.reference_ops): its bf16 logits then equal transformers' on a GPU too. Decode, verify
        and mixed steps keep the Triton kernels."""
        x = F.embedding(input_ids, self.embed_tokens.weight)  # [T, D]
        streams = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()  # [T, N, D]
        sel = None
        with reference_ops(prefill_shaped(batch)):
            for layer in self.layers:
                streams, sel = layer(streams, batch, cache, sel)
                layer_boundary()
            return self.norm(streams.mean(dim=1))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, D] -> logits [T, V] in the model dtype."""
        return self.lm_head(hidden)

    @torch.no_grad()
    def mtp_forward(
        self, next_ids: torch.Tensor, prev_hidden: torch.Tensor, batch: SeqBatch, cache: Glm5NextCache,
    ) -> torch.Tensor:
        """One MTP pass over entries (h_i, t_{i+1}); batch positions count MTP entries per slot.
        Returns the MTP hidden states [T, D] (feed to `mtp_logits`, or back in for a 2nd draft)."""
        if self.mtp is None:
            raise RuntimeError("model was loaded without its MTP layer")
        cache.check(batch, mtp=True)
        emb = F.embedding(next_ids, self.embed_tokens.weight)
        h = self.mtp(emb, prev_hidden, batch, cache)
        cache.commit(batch, mtp=True)
        return h

    def mtp_logits(self, mtp_hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.mtp.shared_head.norm(mtp_hidden))
