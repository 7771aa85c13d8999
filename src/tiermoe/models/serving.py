"""ServingModel: everything the engine's runner calls on a model, declared in one place.

The decoder families' `CausalLM` (decoder.py) and the families with their own structure
(glm5_next's engine adapter) both derive from it. The runner asks a model what it supports
(`decode_graph_unsupported`, `paged_decode_attention_unsupported`) instead of checking its
class or probing its attributes, so a new family states its abilities where it is written and
the runner needs no list of families.

A forward is `forward(batch, kv_caches) -> hidden [T, H]`: host bookkeeping of the step (which
sequence holds how many tokens, fresh per-slot state) and its device work. A decode CUDA graph
(runner/decode_graph.py) records only the device work and replays it many times, so the two
halves are also declared apart: `prepare_decode_step(batch)` runs on the host before every
replay, `decode_step(batch, kv_caches)` is what the graph records. For a model with no
per-sequence state besides the paged KV cache the first does nothing and the second is
`forward`.
"""

from __future__ import annotations

import torch
from torch import nn

from tiermoe.models.batch import ForwardBatch
from tiermoe.models.spec import ModelSpec
from tiermoe.moe.experts import ExpertBackend


class ServingModel(nn.Module):
    """The model interface of the engine (see module docstring); subclasses set the attributes."""

    spec: ModelSpec
    device: torch.device
    dtype: torch.dtype
    expert_backend: ExpertBackend  # the routed experts' seam (moe/experts.py)

    def forward(self, batch: ForwardBatch, kv_caches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """One step over the batch's flat tokens -> final hidden states [T, H]."""
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] fp32."""
        raise NotImplementedError

    def cache_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        """Per layer: paged cache tensor name -> per-token shape."""
        raise NotImplementedError

    def moe_layers(self) -> list[nn.Module]:
        """The MoE blocks in execution order (what the expert backend and routing replay attach to)."""
        raise NotImplementedError

    def reserve_slots(self, num_slots: int) -> None:
        """Per-sequence state beside the paged KV cache for engine slots [0, num_slots), allocated
        once so its addresses never change (decode graphs read it). Only recurrent families keep
        any; the runner calls this once, before the first forward."""

    def slot_state_bytes(self) -> int:
        """Bytes of the per-sequence state one engine slot reserves beside the paged KV cache
        (`reserve_slots`); the KV budget pays for it before pages. 0 for families without any."""
        return 0

    def decode_graph_unsupported(self) -> str | None:
        """None when a pure decode step of this model can be recorded as a piecewise CUDA graph
        (device work free of host syncs, per-step shapes only inside `graph_break` cores), else
        a one-line reason. Device checks are the runner's."""
        raise NotImplementedError

    def paged_decode_attention_unsupported(self, max_model_len: int) -> str | None:
        """None when pure decode steps may read the context through block tables of
        ceil(max_model_len / page_size) entries (static shapes: the whole step in one CUDA graph),
        else a one-line reason."""
        raise NotImplementedError

    def prepare_decode_step(self, batch: ForwardBatch) -> None:
        """Host bookkeeping of a pure decode step whose device work a recorded graph replays
        (`forward` does it itself). Nothing for models whose only state is the paged cache."""

    def decode_step(self, batch: ForwardBatch, kv_caches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """The device work of a pure decode step after `prepare_decode_step`: what a decode graph
        records. hidden [B, H]."""
        return self.forward(batch, kv_caches)

    # -- speculative decoding (runner/speculative.py): models with an MTP draft head ----------
    def draft_head_unsupported(self) -> str | None:
        """None when the model can draft with an MTP head (loaded here, once: the KV budget must
        know before the runner exists whether its rows will be needed), else a one-line reason.
        Only then are the methods below called."""
        return f"the {self.spec.arch} family has no MTP draft head"

    def mtp_cache_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-token shapes of the MTP layer's paged rows."""
        raise NotImplementedError

    def mtp_forward(self, batch: ForwardBatch, mtp_kv: dict[str, torch.Tensor],
                    prev_hidden: torch.Tensor) -> torch.Tensor:
        """One MTP pass over entries (t_{i+1}, h_i [T, H]) -> MTP hidden [T, H]."""
        raise NotImplementedError

    def mtp_logits(self, mtp_hidden: torch.Tensor) -> torch.Tensor:
        """MTP hidden [N, H] -> draft logits [N, V] fp32."""
        raise NotImplementedError

    def verify_forward(self, batch: ForwardBatch, kv_caches: list[dict[str, torch.Tensor]],
                       keep_states: list[bool]) -> torch.Tensor:
        """`forward` that also keeps, for the sequences flagged, what `rollback` needs to drop
        some of this step's tokens (per-token recurrent state). hidden [T, H]."""
        raise NotImplementedError

    def rollback(self, slot: int, length: int) -> None:
        """Keep the first `length` tokens of the slot's state after a `verify_forward`."""
        raise NotImplementedError
