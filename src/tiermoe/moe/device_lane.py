"""Fast mode on the device cache: the CPU lane answers through a mapped-memory mailbox.

The host-synchronous hand-off of the store backends (moe/lane.HostLaneHandoff) reads each
layer's picks back to the host, submits the lane's experts and waits for their partial sum
before adding it: two host round trips per MoE layer, so such steps cannot be captured in a CUDA
graph. Here the device decides and hands off, and the host only answers:

  GPU (one stream, graph-capturable)              host (MailboxServer thread)
  cache step: lane = the coldest misses
  post(layer, x, lane ids | routing)  ------->    compute_fn: CpuLane.compute over the lane's
  gather, fused MoE (lane rows read zeros)        host records (the device cache's host tier
  wait_add(layer, out)                <-------    holds every expert) -> fp32 [T, H]
                                                  -> result rows, done

Arithmetic: out = dtype(fp32(device part) + fp32(lane part)), as in the host-synchronous
path; which experts the lane takes is the device cache's choice (its decayed pick counts), so
fast mode here is not the same selection as the store path's `CpuLane.assign`.

Who answers: where the lane's compiled kernel reads every layout of the store (CpuLane.posted_native),
a native thread (kernels/cpu/native.NativeMailboxServer) polls and computes without Python's interpreter
lock; otherwise a Python MailboxServer thread calls CpuLane.compute_posted. A Python thread polling
between a step's layers holds that lock, so every return of the engine's or the HTTP server's threads
from a call that released it waits for the lock, and each answer waits whenever they hold it.

Failures: a compute_fn error zeroes that answer and marks the slot; a device wait that runs out
of polls leaves `out` without the lane's part and marks the slot. Neither can stop a replayed
graph, so `check()` runs after each lane step's device work, before its tokens are read
(ModelRunner.check_step): the step then fails with the reason instead of serving tokens that
miss the lane's experts (LaneExperts.end_step). Only CUDA-graph-safe work happens per layer;
`workers` of the lane is not used here (one serving thread computes each layer's experts with the
lane's threads).
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

import torch

from tiermoe.kernels.reference import MAILBOX_ERR
from tiermoe.kernels.triton.mailbox import Mailbox, MailboxServer
from tiermoe.moe.lane import LaneHandoff

log = logging.getLogger("tiermoe.moe")


class MailboxServing(Protocol):
    """What DeviceLane asks of the thread that answers its mailbox: kernels/triton/mailbox.MailboxServer (Python)
    or kernels/cpu/native.NativeMailboxServer (native; DeviceLane also sets its clamp and reads its counters,
    `native` says which it holds)."""

    served: int
    failed: int
    serve_s: float
    failure: object  # the last failure's reason until set to None

    @property
    def alive(self) -> bool: ...

    def set_active(self, on: bool) -> None: ...

    def stop(self, timeout: float | None = 5.0) -> None: ...


class DeviceLane(LaneHandoff):
    """One mailbox slot per MoE layer and the host thread that serves them with `lane`: the
    device cache's LaneHandoff (DeviceCacheExperts.lane_handoff).

    device_cache: DeviceCacheExperts (its caches carry lane_cap lane rows); lane: CpuLane;
    max_tokens: largest decode batch handed to the lane; native: answer with the native server
    (None: wherever the lane's compiled kernel reads the store's records; False: the Python one).
    """

    def __init__(self, device_cache, lane, max_tokens: int, native: bool | None = None) -> None:
        self.dc, self.lane = device_cache, lane
        self.layers = list(device_cache.caches)
        self.slot_of = {layer: i for i, layer in enumerate(self.layers)}
        self.lane_cap = max(c.lane_cap for c in device_cache.caches.values()) if self.layers else 0
        self.top_k = device_cache.top_k
        self.hidden = device_cache.layout.hidden
        words = self.lane_cap + 2 * int(max_tokens) * self.top_k  # lane ids | topk ids | weights (fp32 bits)
        self.mailbox = Mailbox(max(1, len(self.layers)), self.hidden, int(max_tokens),
                               device_cache.scratch.device, meta_words=words)
        # each layer's host record addresses and records by expert id (a disk tier keeps both current)
        self.records = {layer: device_cache.lane_records(layer) for layer in self.layers}
        self.polling = False  # from a lane step's start to its check: the server polls only then
        # the native server (None: the Python one answers), kept typed for its clamp and counters
        self._native = self._native_server() if lane.posted_native and native is not False and self.layers else None
        self.native = self._native is not None
        self.server: MailboxServing = self._native or MailboxServer(
            self.mailbox, self._compute, threads=lane.threads, active=threading.Event(), cpu=lane.caller_cpu).start()
        self._limit: tuple | None = None  # the SwiGLU clamp the native server has (None: not set yet)
        self._folded = (0, 0, 0, 0)  # the native server's (experts, layers, busy ns, weight bytes) counted already
        self._fold_lock = threading.Lock()
        self.timeouts = 0  # device waits that ran out of polls (seen by check)
        device_cache.device_lane = self  # its counters report the mailbox's

    def _native_server(self):
        """The native server for this mailbox, or None where its thread cannot start (logged; the Python
        server answers instead)."""
        from tiermoe.kernels.cpu.native import NativeMailboxServer, NativeUnavailable

        lane = self.lane
        slots = [(self.records[layer][0], lane.layout_of(layer)) for layer in self.layers]
        server = NativeMailboxServer(lane.pool, self.mailbox, slots, lane.klayouts, lane.weight_bytes_of,
                                     lane_cap=self.lane_cap, top_k=self.top_k, round_bf16=lane.round_bf16,
                                     cpu=lane.caller_cpu)
        try:
            return server.start()
        except NativeUnavailable as exc:
            log.warning("CPU lane: %s; its mailbox is answered by a Python thread instead", exc)
            return None

    def set_experts(self, experts: int) -> None:
        """The cache step picks up to `experts` lane experts per layer (0: exact mode)."""
        self.dc.set_lane(experts)

    def set_share(self, share: float | None) -> None:
        """The cache step gives the lane this share of each step's misses (up to set_experts');
        the lane keeps it only for /stats (the kernel picks its experts here)."""
        self.dc.set_lane_share(share)
        self.lane.share = share

    def begin(self) -> None:
        """A step that may hand work to the lane starts: the server polls until `check`. The
        device cache's host tier holds every expert for good: no repack to prune."""
        if self.native and self._limit != (self.lane.swiglu_limit,):  # set by the model's attach, after us
            self._native.set_limit(self.lane.swiglu_limit)
            self._limit = (self.lane.swiglu_limit,)
        self.polling = True
        self.server.set_active(True)

    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                partial: bool = False) -> torch.Tensor:
        """x [T, H] -> [T, H] in x's dtype: one fast-mode decode layer (DeviceCacheExperts.lane_forward);
        with `partial` the device's and the lane's parts' fp32 sum before its rounding (ExpertBackend.forward)."""
        return self.dc.lane_forward(layer, x, topk_ids, topk_weights, self.mailbox, self.slot_of[layer],
                                    partial=partial)

    def _compute(self, slot: int, x: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        """Server thread: x bf16 [T, H], meta int32 [words] -> the lane experts' fp32 [T, H]."""
        layer = self.layers[slot]
        rec_of, records = self.records[layer]
        return self.lane.compute_posted(layer, x, meta, self.lane_cap, self.top_k, rec_of, records)

    def check(self) -> None:
        """After a step's device work: raise if its lane work failed, timed out, or the serving
        thread is gone (the step's tokens must then not be served; see the module doc). Waits
        for the device, as reading the step's sampled tokens would. The marks are cleared, so
        the next step is served normally."""
        if self.mailbox.device.type == "cuda":
            torch.cuda.current_stream(self.mailbox.device).synchronize()
        self.polling = False
        self.server.set_active(False)  # every post of the step is answered: the server may sleep
        self._fold_native_counters()
        if not self.server.alive:
            raise RuntimeError("CPU lane stopped: its mailbox server thread is not running")
        failure, err = self.server.failure, self.mailbox.errors()
        if failure is None and not err.any():
            return
        self.server.failure = None
        self.timeouts += int((err > 0).sum())
        self.mailbox.ctrl[:, MAILBOX_ERR] = 0
        if failure is not None:
            raise RuntimeError(f"CPU lane failed: {failure}")
        raise RuntimeError("CPU lane answer timed out on the device")

    def _fold_native_counters(self) -> None:
        """The native server's work since the last fold, into the lane's counters (the Python server's
        compute_posted counts as it goes)."""
        if not self.native:
            return
        with self._fold_lock:  # the engine's thread (check) and /stats (counters) both fold
            st = self._native.stats()
            now = (int(st.experts), int(st.layers), int(st.busy_ns), int(st.weight_bytes))
            # each counter separately: a read while the thread answers may see one counter's increment before
            # another's, and the next fold's delta carries the rest (cumulative counters never go down)
            d = [max(0, a - b) for a, b in zip(now, self._folded)]
            self._folded = tuple(max(a, b) for a, b in zip(now, self._folded))
        if any(d):
            self.lane.count_posted(d[0], d[1], d[2] / 1e9, d[3])

    def balance(self) -> tuple[float, float]:
        """(seconds the lane spent answering, seconds the device worked on its own part of the same
        layers: from each post to its wait), summed since the start; both 0 where the device has no
        clock (CPU)."""
        return self.server.serve_s, self.mailbox.device_seconds()[0]

    def counters(self) -> dict[str, int | float]:
        """The hand-off's own counts (no device sync): posts
        the device published, answers the server made, posts not answered yet, the server's
        seconds answering (lane set-up, kernel, result copy: set against the lane's busy_s, the
        kernel alone) and the polls the device made waiting for answers (0: the lane was never on
        the critical path). Between steps (each lane step ends with `check`,
        which waits for the device), every post answered exactly once reads posts == served and
        unanswered == 0; a lost answer shows as unanswered (or a timeout), a doubled one as
        served > posts."""
        posted, done = self.mailbox.posted(), self.mailbox.done()
        own_s, wait_s = self.mailbox.device_seconds()
        return {"posts": int(posted.sum()), "served": self.server.served,
                "unanswered": int((posted - done).clip(min=0).sum()), "timeouts": self.timeouts,
                "failed": self.server.failed, "serve_s": round(self.server.serve_s, 6),
                "device_wait_polls": self.mailbox.wait_polls(), "device_own_s": round(own_s, 6),
                "device_wait_s": round(wait_s, 6), "server": "native" if self.native else "python"}

    def adjust_counters(self, c: dict) -> None:
        """Lane experts are read by the CPU where they sit, not over PCIe: take them out of the
        bytes the device cache counted as moved per decode token (the native server's work counted
        first: a caller may read counters without steps that end with `check`)."""
        self._fold_native_counters()
        per, tok = c.setdefault("per_decode_token", {}), max(1, int(c.get("decode_tokens") or 0))
        moved = per.get("bytes_moved", 0.0) - self.lane.c.experts * self.dc.store.record_bytes / tok
        per["bytes_moved"] = max(0.0, moved)

    def close(self) -> None:
        """Let queued device waits be answered, then stop the serving thread (before the lane
        and the store it reads from are closed)."""
        try:
            if self.mailbox.device.type == "cuda":
                torch.cuda.synchronize(self.mailbox.device)
        finally:  # stopped whatever the device says: its thread must not outlive the lane's pool
            self.polling = False
            self.server.set_active(False)
            self.server.stop(timeout=None)
