"""The GPU expert path of a stack of MoE layers, assembled from the kernels of this package.

  host pools   every routed expert's record in pinned host memory (uint8 [E, R] per layer),
               registered with CUDA so kernels can read it in place
  slot caches  one ExpertCache per layer: S GPU slots, CLOCK admission, pointer tables
  shared       shared experts live on the GPU; they are extra pointer-table rows that every
               token picks with weight 1

decode_step() runs every layer's cache step, gather and fused MoE without a host sync, so a
whole decode step can be captured in one CUDA graph (capture_decode). prefill() stages each
layer's non-resident experts one layer ahead (staging.PrefillStager). Used by
`tiermoe bench moe-gpu`; the model's MoE layer can drive the same objects.
"""

from __future__ import annotations

import torch

from tiermoe.kernels.layout import ExpertLayout
from tiermoe.kernels.reference import rmsnorm
from tiermoe.kernels.staging import PrefillStager
from tiermoe.kernels.triton.cache_manager import ExpertCache
from tiermoe.kernels.triton.fused_moe import fused_moe, get_config

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


def random_records(layout: ExpertLayout, n: int, device: torch.device, gen: torch.Generator, chunk: int = 32) -> torch.Tensor:
    """uint8 [n, R] valid random records built on `device` (see reference.make_record)."""
    h, i, g = layout.hidden, layout.inter, layout.group_size
    rec = torch.zeros(n, layout.length, dtype=torch.uint8, device=device)
    for c0 in range(0, n, chunk):  # bounded temporaries
        part = rec[c0 : c0 + chunk]
        m = part.shape[0]
        for q_off, s_off, (rows, k) in ((layout.gate_up_q, layout.gate_up_s, (2 * i, h)), (layout.down_q, layout.down_s, (h, i))):
            if layout.kind == "bf16":
                w = torch.randn(m, rows * k, generator=gen, device=device) * k**-0.5
                part[:, q_off : q_off + rows * k * 2].view(torch.bfloat16).copy_(w)
                continue
            qbytes = rows * k // 2 if layout.kind == "int4" else rows * k
            part[:, q_off : q_off + qbytes] = torch.randint(0, 256, (m, qbytes), generator=gen, device=device, dtype=torch.uint8)
            base = 1.0 / ((4.6 if layout.kind == "int4" else 73.0) * k**0.5)
            s = base * (0.5 + torch.rand(m, rows * (k // g), generator=gen, device=device))
            part[:, s_off : s_off + s.shape[1] * 2].view(torch.bfloat16).copy_(s)
    return rec


class TieredExperts:
    """Routed experts of L MoE layers over host pools + per-layer GPU slot caches.

    host_pools[l]: uint8 [E, R] (pinned); shared[l]: uint8 [R] GPU record of layer l's shared
    expert (table row E); slots: GPU slots per layer; warm[l]: experts to preload (most
    popular first); warm_rates[l]: expected picks per step [E] seeding the admission filter;
    max_tokens: largest decode batch; gather: launch parameters of the gather kernel;
    stage_misses: copy misses that are not admitted into scratch rows for their step and
    compute them from HBM (on an H200 the gather kernel streams host memory at 49 GB/s, the MoE
    kernel's in-place reads ran at about 42: decode at batch 1 went from 73 % to 82 % of its
    floor, docs/results.md section 7). Costs max(16, max_tokens * top_k) records of GPU memory;
    False reads those misses in place instead.
    """

    def __init__(self, layout: ExpertLayout, host_pools: list[torch.Tensor], shared: list[torch.Tensor], slots: int,
                 top_k: int, max_tokens: int, device: torch.device, warm: list[list[int]] | None = None,
                 warm_rates: list[torch.Tensor] | None = None, gather: dict | None = None,
                 stage_misses: bool = True) -> None:  # fmt: skip
        self.layout, self.pools, self.shared = layout, host_pools, shared
        self.top_k, self.device, self.num_slots = top_k, device, int(slots)
        self.num_experts = host_pools[0].shape[0]
        r = layout.length
        self.slot_bufs, self.caches = [], []
        # misses not admitted are staged here for their step (shared by all layers: stream order)
        picks = max(16, max_tokens * top_k)
        self.scratch = torch.empty(picks if stage_misses else 1, r, dtype=torch.uint8, device=device)
        for l, pool in enumerate(host_pools):
            buf = torch.empty(max(self.num_slots, 1), r, dtype=torch.uint8, device=device)
            host_addr = pool.data_ptr() + torch.arange(self.num_experts, dtype=torch.int64) * r
            extra = torch.tensor([shared[l].data_ptr()], dtype=torch.int64)
            cache = ExpertCache(host_addr.to(device), buf.data_ptr(), self.num_slots, r, extra_ptrs=extra.to(device),
                                max_picks=picks, scratch_base=self.scratch.data_ptr(),
                                scratch_slots=picks if stage_misses else 0)  # fmt: skip
            if warm is not None and self.num_slots:
                for e, s in cache.warm_start(warm[l]):
                    buf[s].copy_(pool[e])
            if warm_rates is not None:
                cache.warm_frequencies(warm_rates[l].to(device))
            if gather:
                cache.gather_programs, cache.gather_chunk, cache.gather_warps = gather["programs"], gather["chunk"], gather["warps"]
            self.slot_bufs.append(buf)
            self.caches.append(cache)
        self.decode_config: dict | None = None
        self.prefill_config: dict | None = None

    # ------------------------------------------------------------------ decode
    def moe_decode(self, l: int, x: torch.Tensor, ids_full: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Cache step + gather + fused MoE of layer l; ids_full [T, K+1] (last column = shared)."""
        cache = self.caches[l]
        cache.step(ids_full[:, : self.top_k])
        cfg = self.decode_config or get_config(self.layout, x.shape[0], x.device)
        return fused_moe(x, ids_full, w, cache.step_table, self.layout, config=cfg)

    def decode_step(self, h: torch.Tensor, ids_full: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """All layers: h <- h + MoE_l(rmsnorm(h)). ids_full/w [L, T, K+1]. No host sync."""
        for l in range(len(self.caches)):
            h = h + self.moe_decode(l, rmsnorm(h), ids_full[l], w[l])
        return h

    def capture_decode(self, ids_full: torch.Tensor, w: torch.Tensor, h0: torch.Tensor, warmup: int = 2):
        """CUDA graph of one decode step. Returns (graph, static_h, static_ids, static_w, static_out).

        The static inputs are filled with the given (valid) routing first; the eager warm-up
        steps compile the kernels and advance the cache like ordinary steps.
        """
        static_h, static_ids, static_w = h0.clone(), ids_full.clone(), w.clone()
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

    # ------------------------------------------------------------------ prefill
    def make_stager(self) -> PrefillStager:
        return PrefillStager(self.pools, self.layout.length, self.num_experts - min(self.num_slots, self.num_experts), self.device)

    def prefill(self, h: torch.Tensor, ids_full: torch.Tensor, w: torch.Tensor, stager: PrefillStager) -> torch.Tensor:
        """A prefill chunk h [N, H] through all layers with staged experts (no cache change).

        Only experts that the chunk picks are staged; finding them costs one host read.
        """
        n_l, e_n = len(self.caches), self.num_experts
        used = torch.zeros(n_l, e_n + 1, dtype=torch.bool, device=ids_full.device)
        used.scatter_(1, ids_full.reshape(n_l, -1).long(), True)
        plans = stager.plan(self.caches, [[s.data_ptr()] for s in self.shared], used[:, :e_n].tolist())
        state = {"h": h}
        cfg = self.prefill_config or get_config(self.layout, h.shape[0], h.device)

        def layer(l: int, table: torch.Tensor) -> None:
            hh = state["h"]
            state["h"] = hh + fused_moe(rmsnorm(hh), ids_full[l], w[l], table, self.layout, config=cfg)

        stager.run(plans, layer)
        return state["h"]

    # ------------------------------------------------------------------ accounting
    def stats(self) -> torch.Tensor:
        """int64 [L, 4]: cumulative (lookups, hits, misses, admitted) of unique routed experts."""
        return torch.stack([c.stats for c in self.caches])

    def reset_stats(self) -> None:
        for c in self.caches:
            c.reset_stats()
