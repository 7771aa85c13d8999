"""A stack of MoE blocks over the product's device-cache expert path, fed from synthetic pools.

`bench moe-gpu` measures the expert path the engine serves with, not a second assembly of the
same kernels: routed experts go through moe/device_cache.py's DeviceCacheExperts (its
ExpertCache per layer, gather, staging rows for misses, prefill staging) and the fused MoE
kernel it launches. What the engine would read from a packed store comes from `HostPools`
here: every routed expert's random record in pinned host memory, which is what the device
cache needs of a store (its host tier holding every routed expert).

The shared expert of each layer (GLM-5.3-Flash has one) is a record on the GPU, run through
the same fused MoE kernel with a one-row table and weight 1, so the block is
h <- h + routed(rmsnorm(h)) + shared(rmsnorm(h)); routing is an input (sampled ahead of
time), so the numbers isolate the expert path.
"""

from __future__ import annotations

import torch

from tiermoe.kernels.layout import ExpertLayout
from tiermoe.kernels.reference import rmsnorm
from tiermoe.kernels.triton.fused_moe import fused_moe
from tiermoe.moe.device_cache import DeviceCacheExperts

_HOST_REGISTER_FLAGS = 3  # cudaHostRegisterPortable | cudaHostRegisterMapped


def pin_host(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] host buffer, page-locked and mapped for the GPU (plain memory without CUDA).

    cudaHostRegister on an ordinary allocation, not torch's pinned allocator, which rounds
    sizes up to a power of two (a 3.7 GB layer would take 4 GiB). Under unified addressing the
    host address is also the device address, so data_ptr() goes straight into pointer tables.
    """
    t = torch.empty(nbytes, dtype=torch.uint8)
    if not torch.cuda.is_available():
        return t
    err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, _HOST_REGISTER_FLAGS))
    if err != 0:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return t


class HostPools:
    """What DeviceCacheExperts reads of an ExpertStore whose host tier holds every routed expert.

    pools[l]: uint8 [E, R] pinned host records of MoE layer l (layers are numbered 0..L-1);
    record keys are layer * E + expert, as a store numbers its records layer-major.
    """

    def __init__(self, layout: ExpertLayout, pools: list[torch.Tensor], device: torch.device) -> None:
        self.layout, self.pools, self.device = layout, pools, torch.device(device)
        self.layouts = [layout]  # records of one kind (a store may hold two: mixed precision)
        self.record_bytes = layout.length
        self.num_experts = pools[0].shape[0]
        self.moe_layers = list(range(len(pools)))

    def host_entries(self, layer: int) -> list[torch.Tensor]:
        pool = self.pools[layer]
        return [pool[e] for e in range(self.num_experts)]  # each uint8 [R], a view of the pool

    def key(self, layer: int, expert: int) -> int:
        return layer * self.num_experts + expert

    def layout_ids(self, layer: int) -> list[int]:
        return [0] * self.num_experts

    def begin_step(self, tokens: int = 1, decode: bool = True) -> None:
        """A store counts its steps here; the pools keep no step accounting."""

    def close(self) -> None:
        """A store releases its tiers here; the pools are the caller's."""


def slot_budget(slots_per_layer: int, layers: int, top_k: int, max_tokens: int, stage_misses: bool) -> int:
    """DeviceCacheExperts' `slots` argument (slots of every layer + the staging rows for misses)
    that leaves `slots_per_layer` slots in each layer. Exact when the slots are at least as many
    as the staging rows: the device cache gives staging at most half its budget (tiny stacks)."""
    from tiermoe.store.slot_split import STAGE_PICKS

    stage = top_k * max(1, min(max_tokens, STAGE_PICKS)) if stage_misses else 0
    return slots_per_layer * layers + stage


class ExpertStack:
    """L MoE blocks h <- h + MoE_l(rmsnorm(h)) on the product's device cache (module doc).

    pools[l]: uint8 [E, R] pinned host records; shared[l]: uint8 [R] GPU record of layer l's
    shared expert; slots: GPU slots per layer; rates[l]: expected picks per token [E] (warm
    start of the slots and of the admission filter); max_tokens: largest decode batch;
    gather: launch parameters of the gather kernel (the best of the bandwidth probe);
    stage_misses: gather the misses the filter does not admit into HBM rows first (False:
    the MoE kernel reads them in place); config: the fused MoE launch configuration of every
    call, routed and shared (None: the package's tuned table by token count, as the engine).
    """

    def __init__(self, layout: ExpertLayout, pools: list[torch.Tensor], shared: list[torch.Tensor], slots: int,
                 top_k: int, max_tokens: int, device: torch.device, rates: torch.Tensor,
                 gather: dict | None = None, stage_misses: bool = True, config: dict | None = None) -> None:
        self.layout, self.pools, self.shared, self.top_k = layout, pools, shared, top_k
        self.device = torch.device(device)
        self.num_experts = pools[0].shape[0]
        self.host = HostPools(layout, pools, device)
        n_l, e_n = len(pools), self.num_experts
        key_rates = {self.host.key(l, e): float(r) for l in range(n_l) for e, r in enumerate(rates[l].tolist())}
        non_resident = e_n - min(int(slots), e_n)
        self.experts = DeviceCacheExperts(
            self.host, slot_budget(int(slots), n_l, top_k, max_tokens, stage_misses), key_rates, top_k, max_tokens,
            config=config, max_picks=max(16, max_tokens * top_k), stage_misses=stage_misses,
            prefill_rows=2 * non_resident)  # two buffers: copies run one layer ahead of the compute
        if gather:
            for cache in self.experts.caches.values():
                cache.gather_programs, cache.gather_chunk = gather["programs"], gather["chunk"]
                cache.gather_warps = gather["warps"]
        # the shared expert: one table row per layer, picked by every token with weight 1
        self.shared_tables = [torch.tensor([s.data_ptr()], dtype=torch.int64, device=device) for s in shared]
        self.config = config

    @property
    def caches(self) -> list:
        """The ExpertCache of each layer, in layer order."""
        return list(self.experts.caches.values())

    def _shared(self, l: int, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        ids = torch.zeros(t, 1, dtype=torch.int32, device=x.device)  # [T, 1]: row 0 of the table
        ones = torch.ones(t, 1, dtype=torch.float32, device=x.device)  # [T, 1]
        return fused_moe(x, ids, ones, self.shared_tables[l], self.layout, config=self.config)

    def block(self, l: int, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, decode: bool) -> torch.Tensor:
        """h [T, H] bf16 through MoE block l; ids int32 / w fp32 [T, K] routed picks."""
        x = rmsnorm(h)
        return h + self.experts.forward(l, x, ids, w, decode=decode) + self._shared(l, x)

    def decode_step(self, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """All layers, one decode step: ids/w [L, T, K]. No host sync (capturable)."""
        for l in range(len(self.pools)):
            h = self.block(l, h, ids[l], w[l], decode=True)
        return h

    def capture_decode(self, ids: torch.Tensor, w: torch.Tensor, h0: torch.Tensor, warmup: int = 2):
        """CUDA graph of one decode step. Returns (graph, static_h, static_ids, static_w, static_out).

        The static inputs are filled with the given (valid) routing first; the eager warm-up
        steps compile the kernels and advance the cache like ordinary steps.
        """
        static_h, static_ids, static_w = h0.clone(), ids.clone(), w.clone()
        self.experts.begin_step(h0.shape[0], decode=True)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self.decode_step(static_h, static_ids, static_w)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = self.decode_step(static_h, static_ids, static_w)
        return graph, static_h, static_ids, static_w, static_out

    def prefill(self, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """A prefill chunk h [N, H] through all layers (ids/w [L, N, K]); the cache is unchanged.

        The device cache stages the chunk's non-resident experts into HBM rows first
        (moe/prefill_staging.py).
        """
        self.experts.begin_step(h.shape[0], decode=False)
        for l in range(len(self.pools)):
            h = self.block(l, h, ids[l], w[l], decode=False)
        return h

    def stats(self) -> torch.Tensor:
        """int64 [L, 4]: cumulative (lookups, hits, misses, admitted) of unique routed experts."""
        return torch.stack([c.stats[:4] for c in self.caches])
