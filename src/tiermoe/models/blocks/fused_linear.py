"""Several bias-free projections of one input, computed as one GEMM on a CUDA device.

At decode every projection is a matrix-vector product: its time is its weight bytes at HBM speed plus a
fixed cost of a few microseconds (the launch, a split-K reduction, a partly idle tail), which a CUDA graph
does not remove. glm5_next's KDA layers project their input six ways (q, k, v, the first halves of the
forget and output gates, beta), its MLA layers up to five ways and every MLP two ways (gate, up): merged,
each is one product that reads the same bytes and pays the fixed cost once.

`ProjectionGroup.fuse` moves the weights into one buffer and re-points each module's parameter at its rows
of it (a view), so merging costs no memory and the modules keep their checkpoint names for the loader and
the state dict. The merged product runs only where `active` says so: on a CUDA device, with nothing to
train. On the CPU each projection runs alone, as the transformers reference computes it, which keeps CPU
parity bit-identical; a GEMM over more output rows may round differently from the separate ones, which is
a kernel choice of the device, like any other cuBLAS shape.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F


class ProjectionGroup:
    """The weights `owners` name (module, attribute: each [out_i, in], one dtype and input width) as one
    [sum(out_i), in] matrix. Not a module: the owners stay registered where they are."""

    def __init__(self, owners: Sequence[tuple[nn.Module, str]]):
        self._owners = list(owners)
        self.weight: torch.Tensor | None = None  # [sum(out_i), in] once fused
        self._ptrs: list[int] = []  # where each owner's parameter must start for the merged weight to be its own

    @property
    def sizes(self) -> list[int]:
        """Output rows of each projection, in order (the split of the merged product's last dim)."""
        return [getattr(m, name).shape[0] for m, name in self._owners]

    def fuse(self) -> bool:
        """Move the weights into one buffer (each parameter becomes a view of its rows). False, and nothing
        changed, when they cannot share one: different dtypes, devices or input widths."""
        if self._fused_in_place():
            return True  # already fused (fusing twice would only copy the buffer)
        ws = [getattr(m, name) for m, name in self._owners]
        if len({(w.dtype, w.device, w.dim(), w.shape[-1]) for w in ws}) != 1 or ws[0].dim() != 2 or ws[0].is_meta:
            return False
        merged = torch.cat([w.detach() for w in ws], dim=0)  # [sum(out_i), in]
        row = 0
        self._ptrs = []
        for (m, name), w in zip(self._owners, ws):
            view = merged[row:row + w.shape[0]]
            setattr(m, name, nn.Parameter(view, requires_grad=w.requires_grad))
            self._ptrs.append(view.data_ptr())
            row += w.shape[0]
        self.weight = merged
        return True

    def active(self, x: torch.Tensor) -> bool:
        """Whether the merged product serves input x: fused, on a CUDA device, x in the weights' dtype,
        nothing needing a gradient, and every parameter still the view `fuse` made (a module moved or
        re-assigned since then has weights of its own, which the merged buffer no longer holds)."""
        w = self.weight
        if w is None or not x.is_cuda or x.dtype != w.dtype:
            return False
        if torch.is_grad_enabled() and (x.requires_grad or any(getattr(m, n).requires_grad for m, n in self._owners)):
            return False
        return self._fused_in_place()

    def _fused_in_place(self) -> bool:
        return self.weight is not None and all(
            getattr(m, n).data_ptr() == p for (m, n), p in zip(self._owners, self._ptrs))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, sum(out_i)]: every projection of x in one GEMM (only when `active(x)`)."""
        return F.linear(x, self.weight)

    def batched(self, x: torch.Tensor) -> torch.Tensor:
        """x [G, T, in] (one input per projection, G of them, equal output sizes) -> [G, T, out]: G
        projections of G different inputs in one batched GEMM (only when `active`)."""
        g = len(self._owners)
        w = self.weight.view(g, -1, self.weight.shape[-1])  # [G, out, in]
        return torch.bmm(x, w.transpose(1, 2))
