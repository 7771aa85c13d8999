"""The simplest offloaded expert path, in plain torch: the baseline the GPU path must beat.

Per layer: read the router's picks on the host, keep a fixed set of experts (the most popular)
on the GPU, copy every other picked expert from pinned host RAM to the GPU with ordinary
blocking torch copies, then compute with the plain-torch twin (reference.fused_moe_ref). No
cache, no CUDA graph, a host sync per layer. `compute="triton"` swaps in the fused kernel
(pointer table built on the host) to separate transfer strategy from compute kernel. Also the
plain-torch twin of a whole `ExpertStack` (the shared expert is table row E, weight 1).
"""

from __future__ import annotations

import torch

from tiermoe.kernels.layout import ExpertLayout
from tiermoe.kernels.reference import fused_moe_ref, rmsnorm


class NaiveExperts:
    """host_pools[l]: uint8 [E, R]; shared[l]: uint8 [R] on the device; resident[l]: experts
    kept on the device for the whole run."""

    def __init__(self, layout: ExpertLayout, host_pools: list[torch.Tensor], shared: list[torch.Tensor],
                 resident: list[list[int]], top_k: int, device: torch.device, compute: str = "torch") -> None:
        self.layout, self.pools, self.shared, self.top_k, self.device = layout, host_pools, shared, top_k, device
        self.num_experts = host_pools[0].shape[0]
        self.resident = [{e: pool[e].to(device) for e in res} for pool, res in zip(host_pools, resident)]
        self.tmp = torch.empty(self.num_experts, layout.length, dtype=torch.uint8, device=device)
        self.compute = compute
        self.copied = 0  # records copied on demand (all layers, all calls)

    def layer(self, l: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """MoE of layer l (routed picks and the shared expert) on x [T, H]; ids/w [T, K] routed."""
        uniq = torch.unique(ids).tolist()  # host sync
        recs = dict(self.resident[l])
        j = 0
        for e in uniq:
            if e not in recs:
                self.tmp[j].copy_(self.pools[l][e])  # plain blocking copy
                recs[e] = self.tmp[j]
                j += 1
        self.copied += j
        recs[self.num_experts] = self.shared[l]
        t = ids.shape[0]
        ids_full = torch.cat([ids, torch.full((t, 1), self.num_experts, dtype=ids.dtype, device=ids.device)], 1)
        w_full = torch.cat([w.float(), torch.ones(t, 1, device=w.device)], 1)  # [T, K + 1]
        if self.compute == "torch":
            return fused_moe_ref(x, ids_full, w_full, recs, self.layout)
        from tiermoe.kernels.triton.fused_moe import fused_moe

        table = torch.zeros(self.num_experts + 1, dtype=torch.int64)
        for e, rec in recs.items():
            table[e] = rec.data_ptr()
        return fused_moe(x, ids_full, w_full, table.to(self.device), self.layout)

    def forward(self, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """All layers: h <- h + MoE_l(rmsnorm(h)); ids/w [L, T, K]."""
        for l in range(len(self.pools)):
            h = h + self.layer(l, rmsnorm(h), ids[l], w[l])
        return h
