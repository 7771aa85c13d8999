"""Prefill staging: stream each layer's non-resident experts into VRAM one layer ahead.

A prefill chunk of thousands of tokens touches nearly every expert of every layer, so reading
misses in place over PCIe (as decode does) would re-read each weight tile once per block of
tokens. Instead, before a layer runs, its non-resident records are copied by the copy engine
into one of two staging buffers on a side stream, while the previous layer computes; the
layer's pointer table then points at slots (resident) or staging rows (the rest). The
transfer is one contiguous copy per run of consecutive non-resident experts, because records
are laid out identically in host and GPU memory.

Plans are made on the host once per chunk from a snapshot of the residency (one small
device -> host read, outside any graph); prefill does not change the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerPlan:
    table: torch.Tensor  # int64 [E_total] on the device: slot, staging or extra addresses
    runs: list[tuple[int, int, int]]  # (first expert, count, first staging row)
    staged: int  # experts copied for this layer


def plan_layer(expert_slot: list[int], slot_addr: list[int], staging_base: int, record_bytes: int,
               extra_ptrs: list[int], used: list[bool] | None = None) -> tuple[list[int], list[tuple[int, int, int]]]:  # fmt: skip
    """Pointer table and copy runs for one layer (host lists; pure function, tested on CPU).

    expert_slot[e] >= 0: resident in that slot. Experts not resident and used (default: all)
    get consecutive staging rows; unused non-resident experts keep no valid address (0).
    """
    table, runs, row = [], [], 0
    for e, s in enumerate(expert_slot):
        if s >= 0:
            table.append(slot_addr[s])
        elif used is None or used[e]:
            if runs and runs[-1][0] + runs[-1][1] == e:
                f, n, r = runs[-1]
                runs[-1] = (f, n + 1, r)
            else:
                runs.append((e, 1, row))
            table.append(staging_base + row * record_bytes)
            row += 1
        else:
            table.append(0)
    return table + list(extra_ptrs), runs


class PrefillStager:
    """Double-buffered staging of non-resident experts for a stack of MoE layers.

    host_pools[l]: uint8 [E, R] pinned host records of layer l; `capacity` = staging rows per
    buffer (at least the most non-resident experts any layer can have).
    """

    def __init__(self, host_pools: list[torch.Tensor], record_bytes: int, capacity: int, device: torch.device):
        self.pools, self.record_bytes, self.capacity = host_pools, record_bytes, int(capacity)
        self.device = device
        self.buffers = [torch.empty(max(self.capacity, 1), record_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def plan(self, caches, extra_ptrs: list[list[int]], used: list[list[bool]] | None = None) -> list[LayerPlan]:
        """One LayerPlan per layer from the caches' current residency (one host read)."""
        plans = []
        for l, cache in enumerate(caches):
            es = cache.expert_slot.tolist()
            sa = cache.slot_addr.tolist()
            table, runs = plan_layer(es, sa, self.buffers[l % 2].data_ptr(), self.record_bytes, extra_ptrs[l],
                                     None if used is None else used[l])  # fmt: skip
            staged = sum(n for _, n, _ in runs)
            if staged > self.capacity:
                raise ValueError(f"layer {l}: {staged} experts to stage exceed the staging capacity {self.capacity}")
            plans.append(LayerPlan(torch.tensor(table, dtype=torch.int64).to(self.device), runs, staged))
        return plans

    def run(self, plans: list[LayerPlan], layer_fn) -> None:
        """For each layer l: stage its experts (side stream, one layer ahead), then layer_fn(l, table).

        layer_fn enqueues the layer's compute on the current stream. Staging buffer l % 2 is
        refilled only after layer l - 2's compute has finished with it.
        """
        if self.stream is None:  # CPU: plain sequential copies
            for l, p in enumerate(plans):
                self._copy(l, p)
                layer_fn(l, p.table)
            return
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        copied = [torch.cuda.Event() for _ in plans]
        freed = [torch.cuda.Event() for _ in plans]

        def stage(l: int) -> None:
            with torch.cuda.stream(self.stream):
                if l >= 2:
                    self.stream.wait_event(freed[l - 2])
                self._copy(l, plans[l])
                copied[l].record(self.stream)

        stage(0)
        for l, p in enumerate(plans):
            if l + 1 < len(plans):
                stage(l + 1)
            main.wait_event(copied[l])
            layer_fn(l, p.table)
            freed[l].record(main)
        main.wait_stream(self.stream)

    def _copy(self, l: int, plan: LayerPlan) -> None:
        buf, pool = self.buffers[l % 2], self.pools[l]
        for first, n, row in plan.runs:
            buf[row : row + n].copy_(pool[first : first + n], non_blocking=True)
