"""`--record-routing FILE`: every forward token's picks per MoE layer, written off the hot path.

Inside the forward (moe/replay.LayerRouting.route) each trunk MoE layer writes the ids it used
into its rows of a device ring [L, C, k], at (ring cursor + arange(T)) % C, and advances the
cursor: index ops on persistent tensors, so decode CUDA graphs capture them and nothing waits
for the host. The host side never reads the device in the step:

- `begin_forward(T, flags)` (ModelRunner, before each forward is queued) notes which ring rows
  the forward fills and whether they are recorded: flags has one entry per real token (decode
  or prefill, in stream order); rows after them (padding of a captured batch, were there any)
  and whole forwards with flags None (warm-up) are skipped.
- When the rows not yet copied would wrap over themselves, or `poll()` (each engine step) finds
  some older than DRAIN_EVERY_S, they are copied to pinned host memory with a non-blocking copy
  queued on the forward's stream (so it runs after the forwards that wrote them and before any
  later one overwrites them) and handed to a writer thread with a CUDA event.
- The writer thread waits for the event, keeps the recorded rows and rewrites FILE atomically
  (store/routing_trace.write_trace) at most every WRITE_EVERY_S (longer when writes get slow),
  and at close: at exit (atexit, which runs after the server's SIGTERM drain) or when called.

At most `max_tokens` tokens are kept (`--record-routing-max-tokens`); later ones are dropped
with one log line. Recording reads the picks only: outputs do not change.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from pathlib import Path

import numpy as np
import torch

from tiermoe.config import DEFAULTS
from tiermoe.errors import UserError
from tiermoe.store.routing_trace import write_trace

log = logging.getLogger("tiermoe.moe")

DRAIN_EVERY_S = 2.0
WRITE_EVERY_S = 10.0
MIN_RING = 8192  # ring rows (tokens) at least


class RoutingRecorder:
    def __init__(self, path: str, header: dict, *, device: torch.device, id_dtype: torch.dtype, num_layers: int,
                 max_tokens: int = DEFAULTS.record_routing_max_tokens, max_step_tokens: int = 2048,
                 write_every_s: float = WRITE_EVERY_S):
        self.path, self.header, self.max_tokens = Path(path), header, int(max_tokens)
        self.capacity = max(MIN_RING, 1 << (2 * max(1, int(max_step_tokens)) - 1).bit_length())
        k = int(header["top_k"])
        self.rings = torch.zeros(num_layers, self.capacity, k, dtype=id_dtype, device=device)  # [L, C, k]
        self.cursors = torch.zeros(num_layers, dtype=torch.long, device=device)  # [L] tokens written so far
        self._cuda = torch.device(device).type == "cuda"
        self._lock = threading.Lock()
        self._forwarded = 0  # tokens of every forward queued so far (the ring cursors' value once they ran)
        self._pending: list[tuple[int, int, list[bool]]] = []  # (first token, tokens, flags) not yet copied
        self._accepted = 0  # tokens taken for the file (max_tokens at most)
        self._last_drain = time.monotonic()
        self._closed = False
        self._warned: set[str] = set()
        # writer thread state
        self._picks: list[np.ndarray] = []  # [n, L, k] uint16 chunks, in order
        self._decode: list[np.ndarray] = []  # [n] bool
        self._kept = 0
        self.written_tokens = 0
        self.writes = 0
        self._write_every = float(write_every_s)
        self._write_failed: str | None = None
        self._write()  # an empty, valid file at once (RoutingPlan checked the path)
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._writer, name="tiermoe-routing-record", daemon=True)
        self._thread.start()
        atexit.register(self.close)
        log.info("recording routing to %s (at most %d tokens; ring of %d tokens per layer)", self.path,
                 self.max_tokens, self.capacity)

    # -- engine thread ---------------------------------------------------------------------
    def begin_forward(self, num_tokens: int, flags: list[bool] | None) -> None:
        with self._lock:
            if self._closed:
                return
            t = int(num_tokens)
            if t > self.capacity:
                self._warn_once("big", "routing record: a forward of %d tokens exceeds the ring (%d); not recorded",
                                t, self.capacity)
                flags = None
            if self._pending and self._forwarded + t - self._pending[0][0] > self.capacity:
                self._drain()  # the rows not copied yet would be overwritten by this forward
            if flags and self._accepted < self.max_tokens:
                flags = list(flags[: min(t, self.max_tokens - self._accepted)])
                self._accepted += len(flags)
                self._pending.append((self._forwarded, t, flags))
                if self._accepted >= self.max_tokens:
                    self._warn_once("full", "routing record: %d tokens recorded, the limit; later tokens are "
                                    "not recorded (--record-routing-max-tokens)", self.max_tokens)
            self._forwarded += t

    def poll(self) -> None:
        """At a step boundary: copy out rows older than DRAIN_EVERY_S (so the file keeps up)."""
        with self._lock:
            if self._pending and not self._closed and time.monotonic() - self._last_drain >= DRAIN_EVERY_S:
                self._drain()

    def _drain(self) -> None:
        """Queue the copy of the pending rows to the host and hand them to the writer (lock held)."""
        self._last_drain = time.monotonic()
        if not self._pending:
            return
        start = self._pending[0][0]
        n = self._forwarded - start  # <= capacity (begin_forward drains before it would not be)
        s = start % self.capacity
        first = min(n, self.capacity - s)
        spans = [(s, first)] + ([(0, n - first)] if first < n else [])  # a span wrapping the ring's end: two
        parts = []
        for a, m in spans:  # contiguous pinned targets: a strided one would make the copy wait
            host = torch.empty((self.rings.shape[0], m, self.rings.shape[2]), dtype=self.rings.dtype,
                               pin_memory=self._cuda)  # [L, m, k]
            host.copy_(self.rings[:, a : a + m], non_blocking=True)
            parts.append(host)
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
        entries = [(first_tok - start, len(flags), flags) for first_tok, _, flags in self._pending]
        self._pending = []
        self._queue.put((parts, event, entries))

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    # -- writer thread ---------------------------------------------------------------------
    def _writer(self) -> None:
        last = time.monotonic()
        while True:
            try:
                item = self._queue.get(timeout=self._write_every)
            except queue.Empty:
                item = ()
            if item is None:  # close(): everything is queued
                self._write()
                return
            if item:
                self._take(*item)
            if self._kept > self.written_tokens and time.monotonic() - last >= self._write_every:
                t0 = time.monotonic()
                self._write()
                last = time.monotonic()
                self._write_every = max(WRITE_EVERY_S, 20 * (last - t0))  # rewriting a big file: less often

    def _take(self, parts: list[torch.Tensor], event, entries: list[tuple[int, int, list[bool]]]) -> None:
        if event is not None:
            event.synchronize()
        arr = np.concatenate([p.numpy() for p in parts], axis=1)  # [L, n, k]
        for off, n, flags in entries:
            self._picks.append(arr[:, off : off + n].transpose(1, 0, 2).astype(np.uint16))  # [n, L, k]
            self._decode.append(np.asarray(flags, dtype=bool))
            self._kept += n

    def _write(self) -> None:
        layers, k = len(self.header["moe_layers"]), int(self.header["top_k"])
        picks = np.concatenate(self._picks) if self._picks else np.zeros((0, layers, k), dtype=np.uint16)
        decode = np.concatenate(self._decode) if self._decode else np.zeros(0, dtype=bool)
        if len(self._picks) > 1:  # keep one chunk: the next write concatenates only what is new
            self._picks, self._decode = [picks], [decode]
        try:
            write_trace(self.path, self.header, picks, decode)
        except UserError as exc:
            if self._write_failed is None:
                log.error("routing record: %s", exc)
            self._write_failed = str(exc)
            return
        self.written_tokens, self.writes = int(picks.shape[0]), self.writes + 1

    # -- any thread ------------------------------------------------------------------------
    def close(self) -> None:
        """Copy out what is left, write the file and stop the writer (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._drain()
            finally:
                self._queue.put(None)
        self._thread.join(timeout=120)
        atexit.unregister(self.close)
        log.info("routing record: %d tokens written to %s", self.written_tokens, self.path)

    def counters(self) -> dict:
        return {"file": str(self.path), "tokens": self._accepted, "written_tokens": self.written_tokens,
                "max_tokens": self.max_tokens, "writes": self.writes, "write_error": self._write_failed}
