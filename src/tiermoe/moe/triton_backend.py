"""Routed experts through the Triton fused MoE kernel, reading records where the store keeps them.

    table[e] = address of expert e's record: a GPU slot, the pinned host entry (read in place
               over PCIe, zero-copy), or a device copy of a record read from disk
    out      = fused_moe(x, topk_ids, topk_weights, table, layout)      # [T, H] bf16

Per MoE layer and step: the store decides tiers exactly as for the torch path
(`ExpertStore.device_records`: same policy, admissions and counters), the addresses go into a
pointer table of the layer's E rows, and one fused_moe call computes every routed pick. The
kernel reads each record's bytes at `table[e]`; which tier the bytes sit in changes one int64,
never the arithmetic, the launch configuration or the summation order (pick order, fp32), so
outputs are bit-identical for any tier sizes (exact mode) - within this backend. Against the
torch path (`combine_experts`) results are close, not bit-equal: the kernel accumulates in
fp32, rounds the SwiGLU activation to bf16 once and sums the top-k in pick order.

Needs bf16 activations, bf16/int4/int8 records whose shapes the kernel's launch configurations
tile (`triton_unsupported` says why not otherwise). A SwiGLU clamp (GLM-5.3: `swiglu_limit` 10)
is applied in the kernel's epilogue. Runs on CUDA; on CPU
only through Triton's interpreter (TRITON_INTERPRET=1), which is how the tests exercise it.
"""

from __future__ import annotations

import inspect
import os

import torch

EXPERT_KERNELS = ("auto", "torch", "triton")
SUPPORTED_KINDS = ("bf16", "int4", "int8")
ENV_VAR = "TIERMOE_EXPERT_KERNEL"


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def triton_unsupported(record_layout, act_dtype: torch.dtype, device: str | torch.device) -> str | None:
    """None when the Triton backend can serve this store, else a one-line reason why not."""
    dev = torch.device(device)
    if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"device {dev.type}: the Triton kernels need CUDA (or TRITON_INTERPRET=1)"
    if record_layout.kind not in SUPPORTED_KINDS:
        return f"{record_layout.kind} records (the kernel reads {', '.join(SUPPORTED_KINDS)})"
    if act_dtype != torch.bfloat16:
        return f"{str(act_dtype).replace('torch.', '')} activations (the kernel takes bfloat16)"
    try:
        import triton  # noqa: F401

        from tiermoe.kernels.layout import layout_from
        from tiermoe.kernels.triton import fused_moe as fm
    except ImportError as exc:
        return f"Triton is not importable ({exc})"
    try:
        lay = layout_from(record_layout)
        for tokens in (1, fm.DECODE_MAX_TOKENS + 1):  # the decode and the prefill bucket
            cfg = fm.get_config(lay, tokens, dev)
            fm._check_config(lay, cfg, tokens)
            stages = [cfg["gate_up"], cfg["down"], *(cfg["gemv"][s] for s in ("gate_up", "down") if "gemv" in cfg)]
            if not all(_pow2(c[b]) for c in stages for b in ("BN", "BK")) or not _pow2(cfg["gate_up"]["BM"]):
                raise ValueError(f"block sizes {cfg} are not powers of two")
    except ValueError as exc:
        return f"record shape H={record_layout.hidden} I={record_layout.intermediate}: {exc}"
    return None


def choose_expert_kernel(requested: str | None, store, device: str) -> str:
    """'torch' or 'triton' for `--expert-kernel` (or $TIERMOE_EXPERT_KERNEL; default auto).

    auto: Triton on CUDA when the store and dtype are supported, else torch. triton: the
    Triton backend or a UserError saying why it cannot run.
    """
    from tiermoe.errors import UserError

    choice = (requested or os.environ.get(ENV_VAR) or "auto").lower()
    if choice not in EXPERT_KERNELS:
        raise UserError(f"--expert-kernel {choice!r}: choose one of {', '.join(EXPERT_KERNELS)}")
    if choice == "torch" or (choice == "auto" and torch.device(device).type != "cuda"):
        return "torch"
    reason = triton_unsupported(store.layout, store.dtype, device)
    if reason is None:
        return "triton"
    if choice == "triton":
        raise UserError(f"--expert-kernel triton: cannot serve {store.path}: {reason}")
    return "torch"


class TritonExperts:
    """ExpertBackend over an ExpertStore: one fused_moe call per MoE layer and step.

    forward(layer, x, topk_ids, topk_weights) serves every pick; `combine(..., skip=ids)`
    leaves out experts another lane computes (their picks add exactly zero: their table rows
    point at an all-zero record and their routing weights are zeroed).
    """

    def __init__(self, store, config: dict | None = None, swiglu_limit: float | None = None):
        from tiermoe.kernels.layout import layout_from

        self.store = store
        self.swiglu_limit = swiglu_limit  # passed to fused_moe
        self.layout = layout_from(store.layout)
        self.config = config  # a fused_moe launch config, else per shape/device (configs.json)
        self._zero: torch.Tensor | None = None  # all-zero record for skipped experts
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]] = {}  # CUDA only
        self.calls = 0
        self.picks = 0
        self.host_in_place = 0  # records read from the host tier in place (CUDA only)
        self.host_in_place_bytes = 0

    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H] bf16, topk_ids [T, k], topk_weights [T, k] -> [T, H] in x's dtype."""
        return self.combine(layer, x, topk_ids, topk_weights)

    def combine(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                skip=()) -> torch.Tensor:
        """The routed experts' weighted sum, x [T, H] -> [T, H], without the experts in `skip`."""
        from tiermoe.kernels.triton.fused_moe import fused_moe

        t = x.shape[0]
        if t == 0:
            return torch.zeros_like(x)
        skip = {int(e) for e in skip}
        expert_ids = [e for e in torch.unique(topk_ids).tolist() if e not in skip]  # ascending
        recs = self.store.device_records(layer, expert_ids) if expert_ids else {}
        rows = {e: buf.data_ptr() for e, buf in recs.items()}
        if skip:
            zero = self._zero_record(x.device).data_ptr()
            rows.update({e: zero for e in skip})
            lane = torch.tensor(sorted(skip), device=topk_ids.device)
            topk_weights = topk_weights.masked_fill(torch.isin(topk_ids, lane), 0)  # [T, k]
        table = self._table(layer, rows, x.device)  # [E] int64; rows nobody picks are never read
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        clamp = {} if self.swiglu_limit is None else {"swiglu_limit": self.swiglu_limit}
        out = fused_moe(xb.contiguous(), topk_ids, topk_weights, table, self.layout,
                        config=self.config, **clamp)  # [T, H] bf16
        self.store.device_reads_queued(recs.values())
        self.calls += 1
        self.picks += topk_ids.numel()
        if x.device.type == "cuda":
            host = sum(1 for b in recs.values() if b.device.type == "cpu")
            self.host_in_place += host
            self.host_in_place_bytes += host * self.store.record_bytes
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def _table(self, layer: int, rows: dict[int, int], device: torch.device) -> torch.Tensor:
        """The layer's pointer table on `device` with `rows` (expert -> address) written.

        CUDA: a persistent device table per layer, filled from a pinned host copy without a
        stream sync; the host copy is rewritten only after the previous upload from it is done
        (its event; normally long past, since every call first syncs on the routing).
        """
        n = self.store.manifest.experts_per_layer[layer]
        ids = torch.tensor(list(rows), dtype=torch.int64)
        vals = torch.tensor(list(rows.values()), dtype=torch.int64)
        if device.type != "cuda":
            table = torch.zeros(n, dtype=torch.int64, device=device)
            table[ids.to(device)] = vals.to(device)
            return table
        if layer not in self._tables:
            self._tables[layer] = (torch.zeros(n, dtype=torch.int64, pin_memory=True),
                                   torch.zeros(n, dtype=torch.int64, device=device), torch.cuda.Event())
        host, table, uploaded = self._tables[layer]
        uploaded.synchronize()
        host[ids] = vals
        table.copy_(host, non_blocking=True)
        uploaded.record()
        return table

    def _zero_record(self, device: torch.device) -> torch.Tensor:
        if self._zero is None or self._zero.device != device:
            self._zero = torch.zeros(self.layout.length, dtype=torch.uint8, device=device)
        return self._zero

    def counters(self) -> dict:
        return {"calls": self.calls, "picks": self.picks, "host_in_place": self.host_in_place,
                "host_in_place_bytes": self.host_in_place_bytes, "kind": self.layout.kind}
