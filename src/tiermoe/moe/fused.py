"""One fused MoE call over a pointer table, shared by the Triton store path and the device cache.

    table[e] = address of expert e's record (a GPU slot, a staging row, the pinned host entry
               read in place, or the all-zero record of an expert another lane computes)
    out      = fused_moe(x, topk_ids, topk_weights, table, layout)      # [T, H]

`FusedMoE` owns what both callers used to repeat: the bf16 activations the kernel takes, the
SwiGLU clamp it applies in its epilogue, the result in the caller's dtype, and the all-zero
record that skipped experts point at (their routing weights are zeroed too, so they add exactly
zero). Which tier a record sits in changes one table entry, never the launch configuration or
the summation order.
"""

from __future__ import annotations

import torch


class FusedMoE:
    """record_layout: the store's RecordLayout; config: a fused_moe launch configuration (None:
    per shape and device, kernels/triton/configs.json); swiglu_limit: set by the backend's
    `attach` from the model (GLM-5.3 clamps)."""

    def __init__(self, record_layout, config: dict | None = None, swiglu_limit: float | None = None) -> None:
        from tiermoe.kernels.layout import layout_from

        self.layout = layout_from(record_layout)
        self.config = config
        self.swiglu_limit = swiglu_limit
        self._zero: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 table: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_ids/topk_weights [T, k], table [E] int64 -> [T, H] in x's dtype."""
        from tiermoe.kernels.triton.fused_moe import fused_moe

        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        clamp = {} if self.swiglu_limit is None else {"swiglu_limit": self.swiglu_limit}
        out = fused_moe(xb.contiguous(), topk_ids, topk_weights, table, self.layout, config=self.config, **clamp)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def zero_record(self, device: torch.device) -> torch.Tensor:
        """The all-zero record (uint8 [record bytes]) on `device`, made once."""
        if self._zero is None or self._zero.device != device:
            self._zero = torch.zeros(self.layout.length, dtype=torch.uint8, device=device)
        return self._zero
