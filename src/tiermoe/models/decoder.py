"""The generic decoder-only MoE language model every attention+MoE family instantiates.

Module names mirror the Hugging Face checkpoint keys (model.layers.N.self_attn.q_proj, ...), so
loading is a name lookup. Routed experts are not modules: each MoE layer reaches them through
its ExpertBackend (the seam the tiered store plugs into).
"""

from __future__ import annotations

import torch
from torch import nn

from tiermoe.models.batch import ForwardBatch
from tiermoe.models.blocks.attention import GQAttention, MLAttention
from tiermoe.models.blocks.common import Linear, RMSNorm, SwiGLU, empty_param, reference_ops
from tiermoe.models.blocks.graph_break import layer_boundary
from tiermoe.models.blocks.moe import MoELayer
from tiermoe.models.blocks.rope import Rotary
from tiermoe.models.serving import ServingModel
from tiermoe.models.spec import ModelSpec


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = MLAttention(spec) if spec.attention == "mla" else GQAttention(spec)
        if spec.is_moe_layer(layer):
            ffn: nn.Module = MoELayer(spec.moe, spec.hidden_size, layer)
        else:
            ffn = SwiGLU(spec.hidden_size, spec.dense_intermediate_size)
        setattr(self, spec.mlp_name, ffn)
        self.mlp_name = spec.mlp_name

    def forward(self, x, cos, sin, batch: ForwardBatch, cache) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, cache)
        return h + getattr(self, self.mlp_name)(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = empty_param(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


def prompt_pieces_only(batch: ForwardBatch) -> bool:
    """A step that only prefills: every sequence adds more than one token. A step that mixes prompt pieces with
    decode rows keeps the kernels, so a decode row computes the same way whatever shares its step."""
    return bool(batch.seqs) and all(s.q_len > 1 for s in batch.seqs)


class CausalLM(ServingModel):
    """forward(batch, kv_caches) -> final hidden states [T, H]; logits(h) -> [N, V] fp32.

    Its only per-sequence state is the paged KV cache, so every decode step can be captured
    (attention cores break the graph) once the expert backend allows it."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.model = Backbone(spec)
        if not spec.tie_word_embeddings:
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size)
        self.rotary = Rotary(spec.rotary_cls, spec.hf_config)

    def cache_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        """Per layer: cache tensor name -> per-token shape."""
        return [layer.self_attn.cache_shapes() for layer in self.model.layers]

    def moe_layers(self) -> list[MoELayer]:
        return [m for m in self.modules() if isinstance(m, MoELayer)]

    def decode_graph_unsupported(self) -> str | None:
        return self.expert_backend.graph_unsupported()

    def paged_decode_attention_unsupported(self, max_model_len: int) -> str | None:
        mods = list(self.modules())
        if any(isinstance(m, MLAttention) for m in mods) or not any(isinstance(m, GQAttention) for m in mods):
            return "only grouped-query attention has a paged decode kernel (this model uses latent attention)"
        return None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """[T] tokens -> hidden [T, H]. A step of prompt pieces only computes with the blocks' plain-torch twins,
        transformers' own ops (blocks/common.reference_ops: the norms and the sigmoid router have Triton kernels on
        CUDA), so its bf16 logits equal transformers' on a GPU too; decode and mixed steps keep the kernels."""
        x = self.model.embed_tokens.weight[batch.input_ids]  # [T, H]
        cos, sin = self.rotary(batch.positions, x.dtype)
        with reference_ops(prompt_pieces_only(batch)):
            for layer, cache in zip(self.model.layers, kv_caches):
                x = layer(x, cos, sin, batch, cache)
                layer_boundary()
            return self.model.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] in fp32."""
        head = self.model.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight
        return torch.nn.functional.linear(hidden, head).float()
