"""Expert parallel: each rank computes its share of every MoE layer's experts, the ranks add their parts.

With experts offloaded, a second GPU doubles both the HBM for slots and the PCIe bandwidth for misses (each
card has its own link). So each rank (one process per GPU, tiermoe/parallel.py) owns a disjoint share of every
MoE layer's routed experts, and one all-reduce per layer adds the ranks' partial sums. The dense part is
replicated: every rank runs it on the same tokens and gets the same bits, so the ranks' engines stay in step
without exchanging anything else.

How a rank's backend (any backend: the store path, the device cache with its decode graphs) is kept to its
share without knowing of it: before each layer the picks of other ranks' experts are replaced, on the device
and with no host sync, by fillers at weight 0, which add exactly nothing: the first of the rank's k most
popular own experts (in slots from the start) that the token's row does not already pick, so a row never
names an expert twice (the kernels' contract). The layer-ahead predictions the backend reads for prefetch and
disk hints are mapped the same way (`attach` hands it the MoE layers behind `_OwnedPicks`). So the backend
looks up, copies, reads from disk and caches only its own experts, and its arithmetic over them is its own.

Shares (store/shares.py) are balanced by the routing statistics: each layer's experts in order of expected
picks are dealt to the ranks back and forth (0, 1, 1, 0, 0, 1, ...), so every rank gets as many experts, as
many expected picks and as many of the popular ones (the slot tier's) and of the rare ones (the misses): both
links carry the same bytes.

Failures: a rank whose part fails (a record that cannot be read) must still take part in every later
all-reduce of the step, or the others would wait for it forever. So it adds zeros, keeps the error, and at the
step's end (`end_step`) the ranks agree: if any failed, every rank raises for the step (the failing one's
message, named by rank), every engine fails that step's requests alike, and the group goes on serving.

Exactness: a rank's part is its backend's own arithmetic over the experts it owns, whatever its tier budgets,
taken before its rounding to the activations' dtype (`forward(..., partial=True)`: the fused kernel's fp32 sum
of the rank's picks). The ranks' fp32 parts are added by the all-reduce and the total is rounded once to x's
dtype, as one process rounds its one sum; rounding each rank's part to bf16 first would add a second rounding
to many elements of every layer. The torch path has no unrounded part to give (its running sum in x's dtype
rounds every expert's add), so its part arrives already rounded and widened exactly. With two ranks the fp32 sum
is commutative, so outputs are bit-identical across tier budgets for a fixed number of ranks. They are not
bit-identical across rank counts: one process adds every pick into one running sum, two add two partial sums,
and the two groupings round differently (within summation-order differences;
tests/parallel/test_expert_parallel.py).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from tiermoe.config import ParallelConfig
from tiermoe.errors import StoreError, StoreIntegrityError
from tiermoe.moe.experts import ExpertBackend, WrappedBackend
from tiermoe.parallel import all_gather, all_reduce_sum, step_group


def fillers(owners: Mapping[int, Sequence[int]], rates: Mapping[int, Sequence[float]], rank: int,
            top_k: int) -> dict[int, list[int]]:
    """{MoE layer: the rank's `top_k` most popular own experts}, which stand in for other ranks' picks at weight
    0 (a row's picks leave at least as many of them free as it has other ranks' picks)."""
    out = {}
    for layer, owner in owners.items():
        own = sorted((e for e, r in enumerate(owner) if r == rank), key=lambda e: (-float(rates[layer][e]), e))
        if len(own) < top_k:
            raise ValueError(f"layer {layer}: rank {rank} owns {len(own)} experts, fewer than the {top_k} picks "
                             "of a token: too many ranks for this model")
        out[layer] = own[:top_k]
    return out


def localize(topk_ids: torch.Tensor, owner: torch.Tensor, cand: torch.Tensor, rank: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(picks [T, k] with other ranks' experts replaced by fillers the row does not pick, bool [T, k] where
    replaced): owner [E] rank of each expert, cand [C >= k] the rank's fillers. The j-th replaced pick of a row
    takes the j-th filler that the row's own picks leave free. Device ops only (no host sync)."""
    foreign = owner[topk_ids] != rank  # [T, k]
    taken = ((topk_ids[:, :, None] == cand) & ~foreign[:, :, None]).any(1)  # [T, C] picked by the row itself
    free_rank = (~taken).long().cumsum(1) - 1  # [T, C] index of each free filler among the free ones
    nth = foreign.long().cumsum(1) - 1  # [T, k] index of each replaced pick among the replaced ones
    match = ~taken[:, None, :] & (free_rank[:, None, :] == nth[:, :, None])  # [T, k, C]
    fill = cand[match.to(torch.int8).argmax(-1)]  # [T, k]
    return torch.where(foreign, fill, topk_ids), foreign


class ExpertParallelExperts(WrappedBackend):
    """A backend computing this rank's share of the experts; forward returns every rank's sum.

    inner: the rank's backend (its store holding the rank's share); owners: {MoE layer: owner rank of each
    expert}; filler: {MoE layer: the rank's experts that stand in for other ranks' picks} (`fillers`);
    parallel: this rank's place. Every rank must call forward for the same layers with the same tokens (the
    engines run in step), since each call is a collective."""

    def __init__(self, inner: ExpertBackend, owners: Mapping[int, Sequence[int]], filler: Mapping[int, Sequence[int]],
                 parallel: ParallelConfig) -> None:
        super().__init__(inner)
        self.rank, self.world = parallel.rank, parallel.world
        self._owner_cpu = {layer: torch.tensor(list(o), dtype=torch.int64) for layer, o in owners.items()}  # [E]
        self._filler_cpu = {layer: torch.tensor(list(f), dtype=torch.int64) for layer, f in filler.items()}  # [C]
        self._on: dict[tuple[str, int, torch.device], torch.Tensor] = {}
        self.experts = sum(int((o == self.rank).sum()) for o in self._owner_cpu.values())
        self._counts: torch.Tensor | None = None  # int64 [2] on the device: picks seen, picks of other ranks
        self.failure: BaseException | None = None  # this step's first failure here (raised at end_step)
        self.device: torch.device | None = None  # where the step's all-reduces run
        self.errors = step_group()  # failure messages, only when a step failed somewhere

    def _on_device(self, what: str, layer: int, device: torch.device) -> torch.Tensor:
        key = (what, layer, device)
        if key not in self._on:
            self._on[key] = (self._owner_cpu if what == "owner" else self._filler_cpu)[layer].to(device)
        return self._on[key]

    def localize(self, layer: int, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dev = topk_ids.device
        owner, cand = self._on_device("owner", layer, dev), self._on_device("filler", layer, dev)
        return localize(topk_ids, owner, cand, self.rank)

    # -- the seam --------------------------------------------------------------------------------
    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                partial: bool = False) -> torch.Tensor:
        """x [T, H] -> [T, H]: this rank's experts computed here, the others' parts added by the all-reduce, the
        fp32 total rounded once to x's dtype (module doc); with `partial` that fp32 total unrounded. No host
        sync of its own (the inner backend's decode graphs stay possible)."""
        self.device = x.device
        local_ids, foreign = self.localize(layer, topk_ids)  # [T, k]
        if self._counts is None:
            self._counts = torch.zeros(2, dtype=torch.int64, device=topk_ids.device)
        self._counts[0] += topk_ids.numel()
        self._counts[1] += foreign.sum()
        try:
            if self.failure is not None:
                raise self.failure
            # fp32 [T, H], unrounded: the one rounding is the total's, below
            part = self.inner.forward(layer, x, local_ids, topk_weights.masked_fill(foreign, 0), partial=True)
        except Exception as exc:  # zeros, so the other ranks' all-reduces are met; raised at end_step
            self.failure = exc
            part = torch.zeros_like(x, dtype=torch.float32)  # [T, H]
        total = all_reduce_sum(part.float())  # fp32 [T, H]: every rank's part (in place on this call's own part)
        return total if partial else total.to(x.dtype)

    def attach(self, moe_layers: Sequence) -> None:
        self.inner.attach([_OwnedPicks(m, self) for m in moe_layers])

    def graph_unsupported(self) -> str | None:
        if self.world > 1:  # NCCL inside captured graphs: not yet measured on a machine with several GPUs
            return "expert-parallel ranks run decode steps eagerly (their all-reduce is not yet recorded in graphs)"
        return self.inner.graph_unsupported()

    def end_step(self) -> None:
        """Every rank raises if any rank's part of this step failed (module doc)."""
        try:
            self.inner.end_step()
        except Exception as exc:
            self.failure = self.failure or exc
        failure, self.failure = self.failure, None
        if self.device is None:
            if failure is not None:
                raise failure
            return
        failed = all_reduce_sum(torch.tensor([float(failure is not None)], device=self.device))  # [1]
        if not float(failed.item()):
            return
        said = all_gather(None if failure is None else (_kind(failure), str(failure)), self.errors)
        if failure is not None:
            raise failure
        rank, (kind, message) = next((r, m) for r, m in enumerate(said) if m is not None)
        raise _KINDS[kind](f"expert-parallel rank {rank}: {message}")

    def begin_step(self, tokens: int, decode: bool) -> None:
        self.failure = None  # a step that raised before its end_step leaves nothing to the next
        self.inner.begin_step(tokens, decode)

    def counters(self) -> dict | None:
        c = self.inner.counters() or {}
        picks, foreign = self._counts.tolist() if self._counts is not None else (0, 0)
        c["expert_parallel"] = {"rank": self.rank, "world": self.world, "experts": self.experts, "picks": picks,
                                "foreign_picks": foreign}
        return c


# a failure's kind as it crosses to the other ranks (the server reports a corrupt record apart from an I/O error)
_KINDS = {"integrity": StoreIntegrityError, "store": StoreError, "other": RuntimeError}


def _kind(exc: BaseException) -> str:
    return "integrity" if isinstance(exc, StoreIntegrityError) else "store" if isinstance(exc, StoreError) else "other"


class _OwnedPicks:
    """A model's MoE layer as `ExpertBackend.attach` sees it (`layer`, `moe`, `predict_ids`), with its predicted
    picks mapped to the rank's share: prefetch and disk hints never ask for other ranks' experts."""

    def __init__(self, module, share: ExpertParallelExperts) -> None:
        self.module, self.share = module, share
        self.layer, self.moe = module.layer, module.moe

    def predict_ids(self, x: torch.Tensor) -> torch.Tensor:
        return self.share.localize(self.layer, self.module.predict_ids(x))[0]
