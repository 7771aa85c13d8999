"""Expert parallel: each rank computes its share of every MoE layer's experts, the ranks add their parts.

With experts offloaded, a second GPU doubles both the HBM for slots and the PCIe bandwidth for misses (each
card has its own link). So each rank (one process per GPU, tiermoe/parallel.py) owns a disjoint share of every
MoE layer's routed experts: its store backend fetches, caches and computes only those (the rest of a step's
picks are `skip`ped, as fast mode skips the CPU lane's), and one all-reduce per layer adds the ranks' partial
sums. The dense part is replicated: every rank runs it on the same tokens and gets the same bits, so the
ranks' engines stay in step without exchanging anything else.

Shares (`share_experts`) are balanced by the routing statistics: each layer's experts in order of expected
picks are dealt to the ranks back and forth (0, 1, 1, 0, 0, 1, ...), so every rank gets as many experts, as
many expected picks and as many of the popular ones (the slot tier's) and of the rare ones (the misses): both
links carry the same bytes.

Failures: a rank whose part fails (a record that cannot be read) must still take part in every later
all-reduce of the step, or the others would wait for it forever. So it adds zeros, keeps the error, and at the
step's end (`end_step`) the ranks agree: if any failed, every rank raises for the step (the failing one's
message, named by rank), every engine fails that step's requests alike, and the group goes on serving.

Exactness: a rank's partial sum is its backend's own arithmetic over the experts it owns, whatever its tier
budgets, and the ranks' parts are added in fp32 and rounded once. With two ranks that sum is commutative, so
outputs are bit-identical across tier budgets for a fixed number of ranks. They are not bit-identical across
rank counts: one process adds every expert into one running sum, two add two partial sums, and bf16 rounds
the two groupings differently (within bf16's summation-order differences; tests/moe/test_expert_parallel.py).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from tiermoe.config import ParallelConfig
from tiermoe.errors import StoreError
from tiermoe.moe.experts import WrappedBackend
from tiermoe.moe.store_backends import StoreBackend
from tiermoe.parallel import all_gather, all_reduce_sum, step_group


def share_experts(rates: Sequence[Sequence[float]], world: int) -> list[list[int]]:
    """Owner rank of each expert of each layer: rates[i][e] expected picks per token of layer i's expert e,
    dealt back and forth in descending order of rate (ties by id), so the shares match in count, in
    expected picks and in how those are spread."""
    if world < 1:
        raise ValueError("share_experts: world must be >= 1")
    owners = []
    for layer_rates in rates:
        order = sorted(range(len(layer_rates)), key=lambda e: (-float(layer_rates[e]), e))
        owner = [0] * len(layer_rates)
        for i, e in enumerate(order):
            lap, pos = divmod(i, world)
            owner[e] = pos if lap % 2 == 0 else world - 1 - pos
        owners.append(owner)
    return owners


class ExpertParallelExperts(WrappedBackend):
    """A store backend computing this rank's share of the experts; forward returns every rank's sum.

    inner: the rank's StoreBackend (it is handed only the experts it owns); owners: {MoE layer: owner rank of
    each expert}; parallel: this rank's place. Every rank must call forward for the same layers with the
    same tokens (the engines run in step), since each call is a collective."""

    def __init__(self, inner: StoreBackend, owners: Mapping[int, Sequence[int]], parallel: ParallelConfig) -> None:
        super().__init__(inner)
        self.inner: StoreBackend = inner
        self.rank, self.world = parallel.rank, parallel.world
        self._owner_cpu = {layer: torch.tensor(list(o), dtype=torch.int64) for layer, o in owners.items()}  # [E]
        self._owner: dict[tuple[int, torch.device], torch.Tensor] = {}
        self.owned = {layer: frozenset(int(e) for e in (o == self.rank).nonzero().reshape(-1).tolist())
                      for layer, o in self._owner_cpu.items()}
        self.picks = 0  # expert picks seen
        self.foreign = 0  # ... owned by another rank
        self.failure: BaseException | None = None  # this step's first failure here (raised at end_step)
        self.device: torch.device | None = None  # where the step's all-reduces run
        self.errors = step_group()  # failure messages, only when a step failed somewhere

    def _owners_on(self, layer: int, device: torch.device) -> torch.Tensor:
        key = (layer, device)
        if key not in self._owner:
            self._owner[key] = self._owner_cpu[layer].to(device)
        return self._owner[key]

    # -- the seam --------------------------------------------------------------------------------
    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]: this rank's experts computed here, the others' parts added by the all-reduce."""
        self.device = x.device
        owner = self._owners_on(layer, topk_ids.device)[topk_ids]  # [T, k]
        foreign = topk_ids[owner != self.rank]  # [n]
        self.picks += topk_ids.numel()
        self.foreign += foreign.numel()
        try:
            if self.failure is not None:
                raise self.failure
            self.inner.prefetch_ahead(layer, x, owned=self.owned)
            part = self.inner.combine(layer, x, topk_ids, topk_weights, skip=set(torch.unique(foreign).tolist()))
        except Exception as exc:  # zeros, so the other ranks' all-reduces are met; raised at end_step
            self.failure = exc
            part = torch.zeros_like(x)
        return all_reduce_sum(part.float()).to(x.dtype)  # [T, H]

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
        said = all_gather(None if failure is None else (isinstance(failure, StoreError), str(failure)), self.errors)
        if failure is not None:
            raise failure
        rank, (store, message) = next((r, m) for r, m in enumerate(said) if m is not None)
        raise (StoreError if store else RuntimeError)(f"expert-parallel rank {rank}: {message}")

    def counters(self) -> dict | None:
        c = self.inner.counters() or {}
        c["expert_parallel"] = {"rank": self.rank, "world": self.world,
                                "experts": sum(len(s) for s in self.owned.values()),
                                "picks": self.picks, "foreign_picks": self.foreign}
        return c
