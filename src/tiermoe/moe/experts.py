"""The MoE seam: routed-expert computation behind one interface.

`ExpertBackend` is everything the model, the runner and the engine may ask of routed experts:
`forward(layer, x, topk_ids, topk_weights)` per MoE layer, step boundaries, CUDA-graph
eligibility and bookkeeping, decision snapshots around the warm-up, counters and close. It is
an abstract class, so a backend states every answer (ResidentExperts with trivial ones) and
callers never probe for methods.

The resident backend holds every expert in memory (the oracle); the store backends
(moe/backends.py) fetch them from the packed expert store. The torch paths call
`combine_experts`, which visits experts in ascending id order and accumulates exactly as
transformers does, so the result depends only on the expert weights, never on which tier
served them (bit-identical in exact mode).
"""

from __future__ import annotations

import abc
from typing import Callable, Collection, Hashable, Sequence

import torch
import torch.nn.functional as F

ExpertWeights = tuple[torch.Tensor, torch.Tensor]  # (gate_up [2I, H], down [H, I])
NOT_CAPTURABLE = "routed experts are not behind the device cache (their layer syncs with the host)"


class ExpertBackend(abc.ABC):
    """Routed experts of every MoE layer of one model."""

    @abc.abstractmethod
    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                partial: bool = False) -> torch.Tensor:
        """x [T, H], topk_ids [T, k], topk_weights [T, k] -> [T, H] in x's dtype.

        partial: return fp32 [T, H], the picks' sum before its rounding to x's dtype, for a caller that adds
        another part to it (an expert-parallel rank's share, added to the other ranks' by an fp32 all-reduce)
        and rounds the total once, as one process rounds its one sum; rounding each part first would add a
        second rounding. Rounded as the backend rounds, it is the partial=False result bit for bit. A backend
        whose arithmetic rounds as it goes (the torch path's running sum in x's dtype) has no unrounded sum: it
        returns its result widened to fp32, exactly."""

    @abc.abstractmethod
    def attach(self, moe_layers: Sequence) -> None:
        """The loaded model's MoE layers in execution order (each has `.layer`, `.moe` with
        `swiglu_limit`, and `predict_ids(x)`): called once by the loader."""

    @abc.abstractmethod
    def begin_step(self, tokens: int, decode: bool) -> None:
        """Before each forward of `tokens` tokens; decode: every sequence computes one token."""

    @abc.abstractmethod
    def end_step(self) -> None:
        """After a step's device work is queued, before its tokens are used: raise for work of
        the step that failed off the stream (fast mode's CPU lane)."""

    @abc.abstractmethod
    def graph_unsupported(self) -> str | None:
        """None when this backend's decode steps may be captured in CUDA graphs (no host sync
        inside the MoE layer), else why not (runner/decode_graph.py)."""

    @abc.abstractmethod
    def graph_safe(self) -> bool:
        """May the current step's MoE layers be captured or replayed?"""

    @abc.abstractmethod
    def graph_key(self) -> Hashable:
        """What else a captured decode program depends on (programs are kept per key)."""

    @abc.abstractmethod
    def graph_recorded(self, key: Hashable) -> None:
        """The current step was recorded into program `key` (queued into graphs, not run)."""

    @abc.abstractmethod
    def graph_replayed(self, key: Hashable) -> None:
        """The current step was served by replaying program `key`."""

    @abc.abstractmethod
    def save_decisions(self) -> object | None:
        """A snapshot of the state that decides future steps (slot cache decisions), taken
        before steps that are not part of serving (the warm-up); None when there is none."""

    @abc.abstractmethod
    def restore_decisions(self, saved: object | None) -> None:
        """Put back a `save_decisions` snapshot."""

    @abc.abstractmethod
    def host_cores_busy(self) -> bool:
        """True while decode steps compute on the host's cores (fast mode's CPU lane): the engine's
        thread then waits for each step asleep instead of spinning a core (ModelRunner.wait_for_device)."""

    @abc.abstractmethod
    def reads_disk(self) -> bool:
        """True when serving reads some experts from disk (a disk tier): its reader threads then share the host's
        cores with fast mode's CPU lane (moe/lane_kernel.lane_pool)."""

    @abc.abstractmethod
    def counters(self) -> dict | None:
        """What /stats shows under `experts` (None: nothing to show)."""

    @abc.abstractmethod
    def heat(self) -> dict | None:
        """Per-layer expert counts and tiers for the dashboard's heat map (moe/heat.py), read
        between steps (it may wait for the device); None: nothing counted per expert."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop threads and release memory; the backend serves no more steps."""


class WrappedBackend(ExpertBackend):
    """A backend that adds something around `inner` (fast mode's CPU lane, an expert-parallel rank's share):
    every answer is inner's unless the wrapper overrides it."""

    def __init__(self, inner: ExpertBackend) -> None:
        self.inner = inner

    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                partial: bool = False) -> torch.Tensor:
        return self.inner.forward(layer, x, topk_ids, topk_weights, partial=partial)

    def attach(self, moe_layers: Sequence) -> None:
        self.inner.attach(moe_layers)

    def begin_step(self, tokens: int, decode: bool) -> None:
        self.inner.begin_step(tokens, decode)

    def end_step(self) -> None:
        self.inner.end_step()

    def graph_unsupported(self) -> str | None:
        return self.inner.graph_unsupported()

    def graph_safe(self) -> bool:
        return self.inner.graph_safe()

    def graph_key(self) -> Hashable:
        return self.inner.graph_key()

    def graph_recorded(self, key: Hashable) -> None:
        self.inner.graph_recorded(key)

    def graph_replayed(self, key: Hashable) -> None:
        self.inner.graph_replayed(key)

    def save_decisions(self) -> object | None:
        return self.inner.save_decisions()

    def restore_decisions(self, saved: object | None) -> None:
        self.inner.restore_decisions(saved)

    def host_cores_busy(self) -> bool:
        return self.inner.host_cores_busy()

    def reads_disk(self) -> bool:
        return self.inner.reads_disk()

    def counters(self) -> dict | None:
        return self.inner.counters()

    def heat(self) -> dict | None:
        return self.inner.heat()

    def close(self) -> None:
        self.inner.close()


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    """One SwiGLU expert: x [n, H], gate_up [2I, H], down [H, I] -> [n, H]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return F.linear(F.silu(gate) * up, down)


def combine_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights_of: Callable[[list[int]], dict[int, ExpertWeights]],
    swiglu_limit: float | None = None,
    skip: Collection[int] = (),
) -> torch.Tensor:
    """Weighted sum of the routed experts' outputs, reference order: x [T, H] -> [T, H].

    skip: experts another lane computes (fast mode's CPU lane); they are neither fetched nor
    computed, and every other expert's arithmetic and visiting order stay the same.
    """
    out = torch.zeros_like(x)
    expert_ids = torch.unique(topk_ids).tolist()  # sorted ascending
    if skip:
        expert_ids = [e for e in expert_ids if e not in skip]
        if not expert_ids:
            return out
    weights = weights_of(expert_ids)
    for e in expert_ids:
        top_k_pos, token_idx = torch.where((topk_ids == e).t())  # same order as the reference
        gate_up, down = weights[e]
        y = expert_mlp(x[token_idx], gate_up, down, swiglu_limit)
        y = y * topk_weights[token_idx, top_k_pos, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


class HostSyncedBackend(ExpertBackend):
    """Backends whose layers sync with the host in every step: nothing to capture in a CUDA graph
    and no cache decisions to save around the warm-up (the device cache overrides these)."""

    def end_step(self) -> None:
        pass

    def graph_unsupported(self) -> str | None:
        return NOT_CAPTURABLE

    def graph_safe(self) -> bool:
        return False

    def graph_key(self) -> Hashable:
        return None

    def graph_recorded(self, key: Hashable) -> None:
        pass

    def graph_replayed(self, key: Hashable) -> None:
        pass

    def save_decisions(self) -> object | None:
        return None

    def restore_decisions(self, saved: object | None) -> None:
        pass

    def host_cores_busy(self) -> bool:
        return False


class ResidentExperts(HostSyncedBackend):
    """Every expert of every MoE layer held in memory as stacked tensors (the oracle)."""

    def __init__(self, swiglu_limit: float | None = None):
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> ([E,2I,H], [E,H,I])
        self.swiglu_limit = swiglu_limit

    def add_layer(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self.layers[layer] = (gate_up, down)

    def reads_disk(self) -> bool:
        return False  # every expert is in memory

    def weights(self, layer: int, expert_ids: list[int]) -> dict[int, ExpertWeights]:
        gate_up, down = self.layers[layer]
        return {e: (gate_up[e], down[e]) for e in expert_ids}

    def forward(self, layer, x, topk_ids, topk_weights, partial=False):
        """combine_experts' sum in x's dtype ([T, H]); with `partial` the same values widened to fp32: the
        reference order rounds every expert's add, so there is no unrounded sum to keep."""
        out = combine_experts(x, topk_ids, topk_weights, lambda ids: self.weights(layer, ids), self.swiglu_limit)
        return out.float() if partial else out

    # The oracle has no state between steps and syncs with the host in every layer.
    def attach(self, moe_layers: Sequence) -> None:
        pass

    def begin_step(self, tokens: int, decode: bool) -> None:
        pass

    def counters(self) -> dict | None:
        return None

    def heat(self) -> dict | None:
        return None

    def close(self) -> None:
        pass
