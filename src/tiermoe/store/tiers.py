"""Record arenas: the slot tier (on the compute device) and the host tier (RAM).

An arena is a set of fixed-size entries, each holding exactly one record's bytes, so moving
an expert between tiers is one contiguous copy and any entry can be decoded in place. Entries
are 4096-aligned (records are multiples of 4096), so disk reads can land in them directly.

Host arenas on CUDA machines are allocated as ordinary memory in chunks (usable at once) and
page-locked in place by a background thread (cudaHostRegister): pinning costs ~0.6 s/GiB and
must never sit on the request path. Until a chunk is pinned, copies from it are simply
synchronous; addresses never change, so nothing has to be re-pointed afterwards.

CUDA ordering: every copy that involves device memory is issued on the current stream, so
device-side hazards are ordered by the stream. The only cross-agent hazard is the CPU writing
into host memory that a queued copy still reads; `HostEvents` records an event after each
queued copy touching a host buffer and `wait()` blocks on it before the CPU writes there.
"""

from __future__ import annotations

import threading
import weakref

import torch

from tiermoe.store.disk import aligned_buffer

CHUNK_BYTES = 1 << 30


def _release_chunks(chunks: list[torch.Tensor], registered: list[int]) -> None:
    """Unpin the registered chunks, then drop them. An arena dropped without close() must do this
    too: freed while still registered, its addresses can come back in a later allocation, whose
    cudaHostRegister then fails ('already mapped') and leaves that error for the next CUDA check."""
    if registered:
        cudart = torch.cuda.cudart()
        for ptr in registered:
            cudart.cudaHostUnregister(ptr)
        registered.clear()
    chunks.clear()


class HostEvents:
    """Last queued GPU use of each host buffer (keyed by data pointer); no-ops without CUDA."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._events: dict[int, torch.cuda.Event] = {}

    def record(self, buf: torch.Tensor) -> None:
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record()
            self._events[buf.data_ptr()] = ev

    def wait(self, buf: torch.Tensor) -> None:
        ev = self._events.pop(buf.data_ptr(), None)
        if ev is not None:
            ev.synchronize()


class Arena:
    """`n` record entries of `record_len` bytes on `device`, with a free list."""

    def __init__(self, n: int, record_len: int, device: torch.device, *, host: bool = False, pin: bool = False):
        self.n = n
        self.record_len = record_len
        self.device = device
        self._chunks: list[torch.Tensor] = []  # each uint8 [entries_in_chunk, record_len]
        self._per_chunk = max(1, CHUNK_BYTES // record_len)
        if host or device.type == "cpu":
            left = n
            while left > 0:
                m = min(left, self._per_chunk)
                self._chunks.append(aligned_buffer(m * record_len).view(m, record_len))
                left -= m
        elif n > 0:
            self._per_chunk = n
            self._chunks.append(torch.empty((n, record_len), dtype=torch.uint8, device=device))
        self._free = list(range(n - 1, -1, -1))
        self._registered: list[int] = []
        self._release = weakref.finalize(self, _release_chunks, self._chunks, self._registered)
        self._release.atexit = False  # at exit the process's pinned pages go with it; CUDA may be gone
        self._pin_thread: threading.Thread | None = None
        if pin and n > 0 and torch.cuda.is_available():
            self._pin_thread = threading.Thread(target=self._pin_all, name="tiermoe-pin", daemon=True)
            self._pin_thread.start()

    def _pin_all(self) -> None:
        cudart = torch.cuda.cudart()
        for c in self._chunks:
            if getattr(self, "_closing", False):
                return
            err = cudart.cudaHostRegister(c.data_ptr(), c.numel(), 0)
            if int(getattr(err, "value", err)) == 0:
                self._registered.append(c.data_ptr())

    @property
    def pinned_chunks(self) -> int:
        return len(self._registered)

    def wait_pinned(self) -> bool:
        """Block until the background pinning is over; True when every chunk is page-locked
        (always False without CUDA: nothing is registered then)."""
        if self._pin_thread is not None:
            self._pin_thread.join()
        return bool(self._chunks) and len(self._registered) == len(self._chunks)

    def entry(self, e: int) -> torch.Tensor:
        """uint8 [record_len] view of entry e."""
        return self._chunks[e // self._per_chunk][e % self._per_chunk]

    def alloc(self) -> int:
        if not self._free:
            raise RuntimeError("arena full")
        return self._free.pop()

    def free(self, e: int) -> None:
        self._free.append(e)

    @property
    def free_entries(self) -> int:
        return len(self._free)

    def close(self) -> None:
        self._closing = True
        if self._pin_thread is not None:
            self._pin_thread.join()
        self._release()


class StagingPool:
    """Aligned (pinned on CUDA) buffers that disk reads land in before their destination.

    Grows on demand (a call may need more buffers than usual); buffers are reused, never freed
    until close, so steady-state decode allocates nothing.
    """

    def __init__(self, record_len: int, initial: int, events: HostEvents, pin: bool):
        self.record_len = record_len
        self.events = events
        self.pin = pin
        self._free = [aligned_buffer(record_len, pin=pin) for _ in range(initial)]
        self.allocated = initial

    def get(self) -> torch.Tensor:
        if self._free:
            buf = self._free.pop()
        else:
            buf = aligned_buffer(self.record_len, pin=self.pin)
            self.allocated += 1
        self.events.wait(buf)  # a queued copy may still read it
        return buf

    def put(self, buf: torch.Tensor) -> None:
        self._free.append(buf)

    def close(self) -> None:
        self._free.clear()
