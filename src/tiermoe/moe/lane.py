"""Fast mode: the CPU lane as a wrapper around any store backend.

In a fast-mode decode step (every sequence one token, at most `LaneConfig.max_tokens` tokens)
the CPU lane (moe/cpu_lane.py) computes some of each MoE layer's experts from their host
records while the device computes the rest; the two partial sums are added in fp32 and rounded
once. Prefill steps and exact mode never touch the lane, so their arithmetic is the wrapped
backend's own.

How the lane and the backend share a layer is the backend's `lane_handoff(lane)`:

    HostLaneHandoff (store-torch, store-triton)    DeviceLane (device-cache, moe/device_lane.py)
    CpuLane.assign picks the coldest misses        the cache-step kernel picks them on the device
    one device->host copy of x, the lane starts    x and the picks posted to a mapped mailbox
    the backend computes the rest (skip=)          the fused MoE reads zeros for the lane's rows
    LaneJob.wait: one host wait per layer          the device waits for the answer: no host
                                                   sync, so decode graphs capture lane steps too
"""

from __future__ import annotations

import abc
import logging
from typing import Hashable, Sequence

import torch

from tiermoe.config import MODES, LaneConfig
from tiermoe.moe.experts import WrappedBackend
from tiermoe.moe.store_backends import StoreBackend

log = logging.getLogger("tiermoe.moe")


class LaneHandoff(abc.ABC):
    """One way of sharing lane steps between a backend and the CPU lane."""

    @abc.abstractmethod
    def set_experts(self, experts: int) -> None:
        """Up to `experts` lane experts per layer in later lane steps (0: exact mode)."""

    @abc.abstractmethod
    def set_share(self, share: float | None) -> None:
        """The cost model's share of each layer's misses for the lane (None: set_experts' count)."""

    @abc.abstractmethod
    def begin(self) -> None:
        """A lane step starts."""

    @abc.abstractmethod
    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                partial: bool = False) -> torch.Tensor:
        """One MoE layer of a lane step: x [T, H] -> [T, H] in x's dtype, or with `partial` fp32 [T, H], both
        parts' sum before its rounding (ExpertBackend.forward)."""

    @abc.abstractmethod
    def check(self) -> None:
        """After a lane step's device work: raise if the lane's part failed."""

    @abc.abstractmethod
    def balance(self) -> tuple[float, float] | None:
        """(the lane's seconds answering, the device's seconds on its own part of the same layers),
        cumulative, for the share's feedback (lane_cost.ServiceShare); None: not measured here."""

    @abc.abstractmethod
    def adjust_counters(self, c: dict) -> None:
        """Correct the backend's /stats counters for what the lane did instead."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop serving (before the lane and the store are closed)."""


class HostLaneHandoff(LaneHandoff):
    """The store path's hand-off: per layer with lane work, one device->host copy of `x` and of
    the routing (that path already syncs there for the picks), and one host wait for the lane
    before its pinned partial sum is copied up (non-blocking) and added."""

    def __init__(self, backend: StoreBackend, lane) -> None:
        self.backend, self.lane = backend, lane

    def set_experts(self, experts: int) -> None:
        pass  # CpuLane.assign takes at most lane.max_experts itself

    def set_share(self, share: float | None) -> None:
        self.lane.share = share

    def begin(self) -> None:
        pass  # the lane reads host records in place: nothing to prepare per step

    def balance(self) -> None:
        return None  # each layer waits on the host for its lane job: the service rate is the feedback

    def forward(self, layer, x, topk_ids, topk_weights, partial=False):
        be, lane = self.backend, self.lane
        be.prefetch_ahead(layer, x)
        expert_ids = torch.unique(topk_ids).tolist()  # sorted ascending
        job = lane.submit(be.store, layer, x, topk_ids, topk_weights, lane.assign(be.store, layer, expert_ids),
                          decode=be.decoding)
        if job is None:
            return be.combine(layer, x, topk_ids, topk_weights, partial=partial)
        try:
            out = be.combine(layer, x, topk_ids, topk_weights, skip=set(job.ids), partial=True)  # fp32 [T, H]
        except BaseException:
            job.cancel()
            raise
        lane_part = job.wait()  # [T, H] fp32 on the CPU: the one host wait of a lane layer
        if out.device.type != "cpu":
            lane_part = lane_part.pin_memory().to(out.device, non_blocking=True)
        total = out + lane_part  # fp32 [T, H]
        # both parts' sum rounded once, as exact mode rounds its one sum (with `partial`, by the caller)
        return total if partial else total.to(x.dtype)

    def check(self) -> None:
        pass  # every layer already waited for its lane job

    def adjust_counters(self, c: dict) -> None:
        pass

    def close(self) -> None:
        pass


class LaneExperts(WrappedBackend):
    """`inner` (a StoreBackend) with fast mode's CPU lane; `set_mode` switches between exact (no
    lane) and fast. The lane's threads (and its compiled kernel, built on first use) are made on
    the first switch to fast and kept afterwards."""

    def __init__(self, inner: StoreBackend, lane: LaneConfig, mode: str = "fast") -> None:
        super().__init__(inner)
        self.inner: StoreBackend = inner
        self.lane_config = lane
        self.lane = None  # CpuLane
        self.handoff: LaneHandoff | None = None
        self.bandwidths = None  # lane_cost.LaneBandwidths measured at the first switch to fast (CUDA, share auto)
        self.service = None  # lane_cost.ServiceShare: the measured share kept up with the lane's service rate
        self.mode = "exact"
        self._lane_step = False  # the current step is a decode step the lane serves
        self._fast_decode_tokens = 0  # decode tokens computed in fast mode (for lane experts/token)
        self.set_mode(mode)

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "fast" and self.lane is None:
            from tiermoe.moe.cpu_lane import CpuLane

            store = self.inner.store
            mixed = len(store.layouts) > 1  # each layer's lane experts computed at their own layout
            ids = {layer: store.layout_ids(layer) for layer in store.manifest.moe_layers} if mixed else None
            self.lane = CpuLane(store.layouts, swiglu_limit=self.inner.swiglu_limit, act_dtype=store.dtype,
                                layout_ids=ids, beside_disk_reads=self.inner.reads_disk(), **self.lane_config.kwargs())
            self.handoff = self.inner.lane_handoff(self.lane)
            if torch.device(self.lane_config.device).type == "cuda":  # the cost model's split
                self.handoff.set_share(self._share(torch.device(store.device)))
        if self.handoff is not None:
            self.handoff.set_experts(self.lane.max_experts if mode == "fast" else 0)
        self.mode = mode
        self._lane_step = False

    def _share(self, device: torch.device) -> float:
        """The lane's share of each layer's misses beside a GPU: --cpu-lane-share when given (no
        start-up measurement: a fixed split for reproducible runs, or for tiny models whose
        measured share rounds to no expert), else the cost model's, measured on `device` now."""
        share = self.lane_config.share
        if share is not None:
            log.info("CPU lane: --cpu-lane-share: the lane takes %.0f %% of each layer's misses (at most %d)",
                     100 * share, self.lane.max_experts)
            return share
        from tiermoe.moe.lane_cost import ServiceShare, measure

        self.bandwidths = measure(self.lane, device)
        self.service = ServiceShare(pcie_gbs=self.bandwidths.pcie_shared_gbs, share=self.bandwidths.share)
        rates = {k: v for k, v in self.bandwidths.as_dict().items() if isinstance(v, float) and k != "share"}
        log.info("CPU lane: %s; kernel tuning %s; the lane takes %.0f %% of each layer's misses (at most %d)",
                 ", ".join(f"{k} {v:.1f} GB/s" for k, v in rates.items()), self.bandwidths.tuning or "none",
                 100 * self.bandwidths.share, self.lane.max_experts)
        return self.bandwidths.share

    @property
    def store(self):
        return self.inner.store

    def forward(self, layer, x, topk_ids, topk_weights, partial=False):
        if not self._lane_step:
            return self.inner.forward(layer, x, topk_ids, topk_weights, partial=partial)
        return self.handoff.forward(layer, x, topk_ids, topk_weights, partial=partial)

    def attach(self, moe_layers: Sequence) -> None:
        self.inner.attach(moe_layers)
        if self.lane is not None:
            self.lane.swiglu_limit = self.inner.swiglu_limit

    def begin_step(self, tokens: int, decode: bool) -> None:
        self.inner.begin_step(tokens, decode)
        fast = self.mode == "fast"
        self._lane_step = fast and decode and tokens <= self.lane.max_tokens
        if fast and decode:
            self._fast_decode_tokens += tokens
        if self._lane_step:
            self.handoff.begin()

    def end_step(self) -> None:
        self.inner.end_step()
        if self._lane_step:
            self.handoff.check()
            if self.service is not None:  # the share follows the lane's rate in service
                share = self.service.update(self.lane.c.busy_s, self.lane.c.weight_bytes, self.handoff.balance)
                if share is not None:
                    self.handoff.set_share(share)

    def host_cores_busy(self) -> bool:
        return self.mode == "fast"

    def graph_key(self) -> Hashable:
        return self.inner.graph_key(), self._lane_step  # lane steps are other programs

    def counters(self) -> dict | None:
        c = self.inner.counters()
        c["mode"] = self.mode
        if self.lane is not None:
            self.handoff.adjust_counters(c)
            c["cpu_lane"] = self.lane.counters(self._fast_decode_tokens)
            if self.bandwidths is not None:
                c["cpu_lane"]["bandwidths"] = self.bandwidths.as_dict()
            if self.service is not None:
                c["cpu_lane"]["service"] = self.service.as_dict()
        return c

    def close(self) -> None:
        if self.handoff is not None:
            self.handoff.close()
        if self.lane is not None:
            self.lane.close()
        self.inner.close()
