"""Host <-> device mailbox: hand activations to host threads and add their result back, with no
host synchronisation on the device side (so the hand-off can sit inside a captured CUDA graph).

In fast mode a CPU lane computes a layer's coldest missing experts on the host while the GPU
computes the rest, and the lane's fp32 partial sum is added to the GPU's output. Waiting for it
with a stream sync breaks graph capture and costs a host round trip per layer. Instead:

  device (compute stream)                          host (MailboxServer thread)
  post(slot, x):  x -> request area (mapped)
                  seq[slot] += 1 (device tensor)
                  ntok = T; release-store posted       polls posted; sees posted > served
                                                       y = compute_fn(slot, x[:T])  fp32 [T, H]
                                                       y -> result area; then store done = posted
  wait_add(slot, out): one warp spins (acquire loads) until done >= seq[slot], at most
                  max_spins polls (on the cap: ctrl[slot, ERR] = seq, ok[slot] = 0);
                  then a second kernel adds out += result[:T] when ok[slot] (fp32 add,
                  one rounding to out's dtype), so a timeout leaves out unchanged

The mailbox lives in pinned host memory (torch's pinned allocator: cudaHostAlloc, mapped under
unified addressing, so a host address is also a device address); the kernels get raw addresses
as integer arguments, as the gather kernel does with pinned expert records. Triton types an
integer argument by its value (int32 below 2**31), and a pointer is made only from 64 bits, so
each address is widened to int64 before the cast: a low address (CPU tensors of a Python built
without PIE, e.g. Debian's system Python, when the kernels are compiled ahead of time) would
otherwise not compile ("error encountered during parsing"). The sequence
counter is a device tensor bumped by the post kernel, so every graph replay posts a new number
without the host. Memory layout per slot (`ctrl` int64 [S, 16], 128 bytes a slot):
  ctrl[s, POSTED] written by the device (release), ctrl[s, NTOK] token count of the request,
  ctrl[s, DONE] written by the host, on its own cache line, ctrl[s, ERR] error mark
  (> 0: the device timed out waiting for that sequence number; < 0: compute_fn raised for -ERR).
  x_host bf16 [S, Tmax, H] request rows, result fp32 [S, Tmax, H] the host's answer.

Ordering: on CUDA the post kernel publishes with `st.release.sys` after a CTA barrier, and the
waiter polls with `ld.acquire.sys` (inline PTX; Triton has no system-scope acquire load). The
host side relies on x86's total store order (result bytes are stored before done; posted is
loaded before the request rows). Without CUDA the kernels run in Triton's interpreter, where
the same code uses an atomic exchange and volatile loads.

Protocol rules: one request in flight per slot (wait_add before the next post to that slot),
and wait_add's `out` has as many rows as the posted x. After a timeout the slot's reply may
still arrive later (it answers that sequence number, so the next post waits for its own);
clearing the ERR marks is enough to go on. `reset()` zeroes every counter: only with no
request in flight and no MailboxServer running (the server keeps its own count of answers).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

import numpy as np
import torch
import triton
import triton.language as tl

from tiermoe.kernels.reference import (MAILBOX_CTRL, MAILBOX_DEV_NS, MAILBOX_DONE, MAILBOX_ERR, MAILBOX_NTOK,
                                       MAILBOX_POLLS, MAILBOX_POSTED, MAILBOX_WAIT_NS)

log = logging.getLogger("tiermoe.kernels")

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEFAULT_MAX_SPINS = 1 << 22  # on a GPU a poll crosses PCIe (about 1 us): seconds, not forever


@triton.jit
def _release_store(ptr, val, ASM: tl.constexpr):
    if ASM:
        tl.inline_asm_elementwise(
            "st.release.sys.global.b64 [$1], $2;\n\tmov.u32 $0, 0;",
            "=r,l,l",
            [ptr, val],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        tl.atomic_xchg(ptr, val, sem="release", scope="sys")


@triton.jit
def _acquire_load(ptr, ASM: tl.constexpr):
    if ASM:
        v = tl.inline_asm_elementwise(
            "ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [ptr], dtype=tl.int64, is_pure=False, pack=1
        )
    else:
        v = tl.load(ptr, volatile=True)
    return v


@triton.jit
def _device_ns(ptr, ASM: tl.constexpr):
    """The device's nanosecond clock (%globaltimer) on CUDA; 0 in the interpreter. ptr: any pointer (an
    operand the asm does not read: inline asm takes its shape from its arguments)."""
    if ASM:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [ptr], dtype=tl.int64, is_pure=False,
                                      pack=1)
    else:
        t = tl.load(ptr) * 0
    return t


@triton.jit
def _bf16_rne(v):
    """fp32 -> bf16 rounding to nearest even, in integer ops: the same bits as torch's cast on a
    GPU and in the interpreter (whose own float cast truncates)."""
    u = v.to(tl.uint32, bitcast=True)
    r = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    r = tl.where(v != v, 0x7FFF, r)  # NaN: the canonical one (payloads differ across torch paths)
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _to_out(v, OUT_BF16: tl.constexpr):
    if OUT_BF16:
        return _bf16_rne(v)
    else:
        return v


@triton.jit(do_not_specialize=["ntok", "slot", "n_meta"])  # T = 1 would otherwise become a constant int
def _post_kernel(
    x_ptr,
    n_elem,
    ntok,
    seq_ptr,
    tpost_ptr,
    slot,
    req_addr,
    ctrl_addr,
    meta_ptr,
    n_meta,
    meta_addr,
    POSTED: tl.constexpr,
    NTOK: tl.constexpr,
    X_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
    ASM: tl.constexpr,
):
    """One program: x (n_elem values) and meta (n_meta int32 words) -> the slot's request and
    meta areas, seq[slot] += 1, tpost[slot] = the device clock, then posted = seq."""
    req = req_addr.to(tl.int64).to(tl.pointer_type(tl.bfloat16))
    ctrl = ctrl_addr.to(tl.int64).to(tl.pointer_type(tl.int64))
    for off in range(0, n_elem, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        m = offs < n_elem
        v = tl.load(x_ptr + offs, mask=m)
        if not X_BF16:
            v = _bf16_rne(v.to(tl.float32))
        tl.store(req + offs, v, mask=m)
    meta_out = meta_addr.to(tl.int64).to(tl.pointer_type(tl.int32))
    for off in range(0, n_meta, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        m = offs < n_meta
        tl.store(meta_out + offs, tl.load(meta_ptr + offs, mask=m), mask=m)
    s = tl.load(seq_ptr + slot) + 1
    tl.store(seq_ptr + slot, s)
    tl.store(tpost_ptr + slot, _device_ns(seq_ptr, ASM))
    tl.store(ctrl + NTOK, ntok.to(tl.int64))
    tl.debug_barrier()  # every thread's request stores happen before the release below
    _release_store(ctrl + POSTED, s, ASM)


@triton.jit(do_not_specialize=["slot"])
def _wait_kernel(seq_ptr, slot, ok_ptr, ctrl_addr, max_spins, tpost_ptr, acc_ptr, DONE: tl.constexpr,
                 ERR: tl.constexpr, POLLS: tl.constexpr, ASM: tl.constexpr, TIMED: tl.constexpr = False,
                 DEV_NS: tl.constexpr = 0, WAIT_NS: tl.constexpr = 0):
    """One program of one warp spins until done >= seq[slot] (bounded); ok[slot] = 1 or 0; the slot's
    POLLS word += the polls it made after the first read (0: the answer was there: no wait).
    TIMED: acc [S, 2] int64 (device) += (wait start - tpost[slot], wait end - wait start) in device
    nanoseconds, mirrored to the slot's DEV_NS / WAIT_NS words (stores only: no read crosses PCIe).

    One poller on purpose: every warp that reads the same host word costs a serialized trip
    over PCIe per poll, and those trips queue behind one another."""
    ctrl = ctrl_addr.to(tl.int64).to(tl.pointer_type(tl.int64))
    target = tl.load(seq_ptr + slot)
    t0 = _device_ns(seq_ptr, ASM)
    d = _acquire_load(ctrl + DONE, ASM)
    i = 0
    while (d < target) & (i < max_spins):
        d = _acquire_load(ctrl + DONE, ASM)
        i += 1
    tl.store(ok_ptr + slot, (d >= target).to(tl.int32))
    tl.store(ctrl + ERR, target, mask=d < target)
    tl.store(ctrl + POLLS, tl.load(ctrl + POLLS, volatile=True) + i)
    if TIMED:
        t1 = _device_ns(seq_ptr, ASM)
        dev = tl.load(acc_ptr + 2 * slot) + (t0 - tl.load(tpost_ptr + slot))
        waited = tl.load(acc_ptr + 2 * slot + 1) + (t1 - t0)
        tl.store(acc_ptr + 2 * slot, dev)
        tl.store(acc_ptr + 2 * slot + 1, waited)
        tl.store(ctrl + DEV_NS, dev)
        tl.store(ctrl + WAIT_NS, waited)


@triton.jit(do_not_specialize=["slot"])
def _add_kernel(out_ptr, n_elem, ok_ptr, slot, res_addr, NPROG, OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """out += result rows when ok[slot] (set by _wait_kernel just before, in stream order)."""
    pid = tl.program_id(0)
    res = res_addr.to(tl.int64).to(tl.pointer_type(tl.float32))
    n_ok = tl.where(tl.load(ok_ptr + slot) != 0, n_elem, 0)  # nothing to add after a timeout
    for off in range(pid * BLOCK, n_elem, NPROG * BLOCK):
        offs = off + tl.arange(0, BLOCK)
        m = offs < n_ok
        r = tl.load(res + offs, mask=m, other=0.0, cache_modifier=".cv")  # host lines change per round
        o = tl.load(out_ptr + offs, mask=m, other=0.0)
        tl.store(out_ptr + offs, _to_out(o.to(tl.float32) + r, OUT_BF16), mask=m)


class Mailbox:
    """Per-slot request/result areas in mapped pinned host memory, and the device counters.

    slots: independent mailboxes (e.g. one per MoE layer); hidden: row width H; max_tokens:
    largest T per request; device: where x, out and the sequence counters live (CPU: plain
    memory and Triton's interpreter); meta_words: int32 words of side data a post may carry
    with x (the CPU lane's routing), copied by the same kernel before the release.
    """

    def __init__(
        self, slots: int, hidden: int, max_tokens: int, device: torch.device | str, meta_words: int = 0
    ) -> None:
        self.slots, self.hidden, self.max_tokens = int(slots), int(hidden), int(max_tokens)
        self.meta_words = int(meta_words)
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        s, t, h = self.slots, self.max_tokens, self.hidden
        self.x_host = torch.zeros(s, t, h, dtype=torch.bfloat16, pin_memory=pin)  # [S, Tmax, H] requests
        self.result = torch.zeros(s, t, h, dtype=torch.float32, pin_memory=pin)  # [S, Tmax, H] answers
        self.ctrl = torch.zeros(s, MAILBOX_CTRL, dtype=torch.int64, pin_memory=pin)  # [S, 16]
        self.meta = torch.zeros(s, max(1, self.meta_words), dtype=torch.int32, pin_memory=pin)  # [S, M] side data
        self.seq = torch.zeros(s, dtype=torch.int64, device=self.device)  # [S] last posted number
        self.ok = torch.zeros(s, dtype=torch.int32, device=self.device)  # [S] last wait succeeded
        self.t_post = torch.zeros(s, dtype=torch.int64, device=self.device)  # [S] device clock at the last post
        self.timing = torch.zeros(s, 2, dtype=torch.int64, device=self.device)  # [S, 2] ns: own work, waiting
        self._ctrl_np = self.ctrl.numpy()
        self._asm = pin and not _INTERPRET

    # raw addresses handed to the kernels (host address == device address under UVA)
    def _req_addr(self, slot: int) -> int:
        return self.x_host[slot].data_ptr()

    def _res_addr(self, slot: int) -> int:
        return self.result[slot].data_ptr()

    def _ctrl_addr(self, slot: int) -> int:
        return self.ctrl[slot].data_ptr()

    def _meta_addr(self, slot: int) -> int:
        return self.meta[slot].data_ptr()

    def _check(self, slot: int, t: torch.Tensor) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} outside 0..{self.slots - 1}")
        if t.dim() != 2 or t.shape[1] != self.hidden or not 1 <= t.shape[0] <= self.max_tokens:
            raise ValueError(f"expected [T<={self.max_tokens}, {self.hidden}], got {list(t.shape)}")
        if t.device != self.seq.device or not t.is_contiguous():
            raise ValueError(f"tensor must be contiguous on {self.seq.device}")

    def post(self, slot: int, x: torch.Tensor, meta: torch.Tensor | None = None) -> None:
        """Queue x [T, H] (bf16, fp16 or fp32; sent as bf16) and optionally meta int32 [<=
        meta_words] (same device, contiguous) for the host on the current stream."""
        self._check(slot, x)
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
        if meta is None:
            meta, n_meta = self.seq, 0  # any device tensor: nothing is read
        else:
            if (
                meta.dtype != torch.int32
                or meta.dim() != 1
                or not meta.is_contiguous()
                or meta.device != self.seq.device
            ):
                raise ValueError(f"meta must be a contiguous 1-D int32 tensor on {self.seq.device}")
            if meta.numel() > self.meta_words:
                raise ValueError(f"meta of {meta.numel()} words exceeds meta_words={self.meta_words}")
            n_meta = meta.numel()
        _post_kernel[(1,)](
            x,
            x.numel(),
            x.shape[0],
            self.seq,
            self.t_post,
            slot,
            self._req_addr(slot),
            self._ctrl_addr(slot),
            meta,
            n_meta,
            self._meta_addr(slot),
            POSTED=MAILBOX_POSTED,
            NTOK=MAILBOX_NTOK,
            X_BF16=x.dtype == torch.bfloat16,
            BLOCK=1024,
            ASM=self._asm,
            num_warps=4,
        )

    def wait_add(self, slot: int, out: torch.Tensor, max_spins: int = DEFAULT_MAX_SPINS) -> None:
        """out [T, H] (bf16 or fp32) += the host's answer to this slot's last post, in place."""
        self._check(slot, out)
        if out.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"out must be bf16 or fp32, got {out.dtype}")
        n = out.numel()
        _wait_kernel[(1,)](
            self.seq,
            slot,
            self.ok,
            self._ctrl_addr(slot),
            int(max_spins),
            self.t_post,
            self.timing,
            DONE=MAILBOX_DONE,
            POLLS=MAILBOX_POLLS,
            ERR=MAILBOX_ERR,
            ASM=self._asm,
            TIMED=True,
            DEV_NS=MAILBOX_DEV_NS,
            WAIT_NS=MAILBOX_WAIT_NS,
            num_warps=1,
        )
        block = 4096 if _INTERPRET else 1024
        nprog = min(triton.cdiv(n, block), 4 if _INTERPRET else 64)
        _add_kernel[(nprog,)](
            out,
            n,
            self.ok,
            slot,
            self._res_addr(slot),
            nprog,
            OUT_BF16=out.dtype == torch.bfloat16,
            BLOCK=block,
            num_warps=4,
        )

    # ---------------------------------------------------------------- host-side views
    def posted(self) -> np.ndarray:
        """int64 [S]: last sequence number the device published (read without a sync)."""
        return self._ctrl_np[:, MAILBOX_POSTED].copy()

    def done(self) -> np.ndarray:
        return self._ctrl_np[:, MAILBOX_DONE].copy()

    def errors(self) -> np.ndarray:
        """int64 [S]: 0 = fine; > 0 the device gave up waiting for that number; < 0 compute_fn failed."""
        return self._ctrl_np[:, MAILBOX_ERR].copy()

    def wait_polls(self) -> int:
        """Polls the device's waits made, over every slot, before their answers were there."""
        return int(self._ctrl_np[:, MAILBOX_POLLS].sum())

    def device_seconds(self) -> tuple[float, float]:
        """(seconds the device worked on its own between each post and its wait, seconds it waited),
        summed over every slot's waits; read without a sync (CUDA only: zeros elsewhere)."""
        return (float(self._ctrl_np[:, MAILBOX_DEV_NS].sum()) / 1e9,
                float(self._ctrl_np[:, MAILBOX_WAIT_NS].sum()) / 1e9)

    def reset(self) -> None:
        """Zero every counter (device and host); no request may be in flight."""
        self.seq.zero_()
        self.ctrl.zero_()
        self.timing.zero_()


class MailboxServer:
    """A host thread that answers a Mailbox: polls `posted`, runs compute_fn, publishes `done`.

    compute_fn(slot, x) gets x bf16 [T, H] (a view of the pinned request rows, valid until it
    returns) and returns fp32 [T, H]; with a mailbox of meta_words > 0 it is called as
    compute_fn(slot, x, meta), meta the slot's int32 [meta_words] side data (a view, same
    life). threads: torch intra-op threads for this thread's work (0 = leave as is). spin_s:
    busy polling after the last request before backing off to short sleeps (latency when
    requests come back to back; sleeps of up to max_sleep_s when idle). active: an Event the
    owner sets while posts may come (e.g. during a step that hands work over) and clears when
    none can; while it is clear the thread sleeps on it instead of polling, so it neither wakes
    thousands of times a second nor takes the GIL from other threads between such steps. cpu:
    the one CPU the thread runs on (None: any), e.g. the core a CPU lane keeps for the thread
    that calls it, so the lane's threads and the engine's never share a core.
    If compute_fn raises, the slot's result is zeroed, ERR = -seq, done is still published (the
    device must not stall) and the exception is kept in `failure`. `served` counts answers
    (failed ones included); once the device has seen an answer, it is counted.
    """

    def __init__(
        self,
        mailbox: Mailbox,
        compute_fn: Callable[[int, torch.Tensor], torch.Tensor],
        threads: int = 0,
        *,
        spin_s: float = 2e-3,
        max_sleep_s: float = 5e-4,
        active: threading.Event | None = None,
        cpu: int | None = None,
    ) -> None:
        self.mb, self.compute_fn, self.threads, self.cpu = mailbox, compute_fn, int(threads), cpu
        self.active = active
        self.spin_s, self.max_sleep_s = float(spin_s), float(max_sleep_s)
        self.served = 0
        self.failed = 0  # answers whose compute_fn raised (counted in served too)
        self.serve_s = 0.0  # wall seconds in compute_fn and the result copy (the lane's side of each answer)
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def set_active(self, on: bool) -> None:
        """Poll (a step that may post runs) or park between such steps (the `active` event)."""
        if self.active is not None:
            self.active.set() if on else self.active.clear()

    def start(self) -> "MailboxServer":
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="mailbox-server", daemon=True)
            self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        """The serving thread is running (started and not ended)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop polling and join the thread (None: however long its current answer takes); a
        thread still busy after `timeout` is kept, so `alive` stays true."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._thread = None

    def __enter__(self) -> "MailboxServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _serve(self, slot: int, seq: int) -> None:
        ctrl = self.mb._ctrl_np
        t = int(ctrl[slot, MAILBOX_NTOK])
        res = self.mb.result[slot, :t]  # [T, H] fp32, pinned
        t0 = time.perf_counter()
        try:
            extra = (self.mb.meta[slot],) if self.mb.meta_words else ()
            y = self.compute_fn(slot, self.mb.x_host[slot, :t], *extra)
            if tuple(y.shape) != (t, self.mb.hidden):
                raise ValueError(f"compute_fn returned {list(y.shape)}, expected [{t}, {self.mb.hidden}]")
            res.copy_(y)
        except Exception as exc:  # the device must still be released; the caller sees ERR < 0
            self.failure = exc
            self.failed += 1
            res.zero_()
            ctrl[slot, MAILBOX_ERR] = -seq
        self.serve_s += time.perf_counter() - t0
        # Counted before done is published: a caller that saw the device get past its wait (a
        # stream sync) then reads a count that includes this answer. Counted after, the device
        # could read done and finish while the count still lagged by one.
        self.served += 1
        ctrl[slot, MAILBOX_DONE] = seq  # after the result bytes (x86 stores are not reordered)

    def _run(self) -> None:
        if self.threads > 0:
            torch.set_num_threads(self.threads)
        if self.cpu is not None:
            try:
                os.sched_setaffinity(0, {self.cpu})  # this thread only (Linux)
            except OSError as exc:
                log.info("mailbox server: not pinned to CPU %d (%s)", self.cpu, exc)
        ctrl = self.mb._ctrl_np
        served = ctrl[:, MAILBOX_DONE].copy()
        last = time.perf_counter()
        sleep, polls = 1e-5, 0
        while not self._stop.is_set():
            posted = ctrl[:, MAILBOX_POSTED].copy()  # one snapshot, then the request rows
            todo = np.nonzero(posted > served)[0]
            for s in todo:
                self._serve(int(s), int(posted[s]))
                served[s] = posted[s]
            now = time.perf_counter()
            if len(todo):
                last, sleep = now, 1e-5
            elif self.active is not None and not self.active.is_set():
                self.active.wait(0.05)  # parked until posts may come (`stop` is seen within 50 ms)
                last, sleep = time.perf_counter(), 1e-5
            elif now - last <= self.spin_s:
                polls += 1
                if polls % 256 == 0:  # hand the GIL over now and then (a syscall: 50 us in a sandboxed kernel)
                    time.sleep(0)
            else:
                time.sleep(sleep)
                sleep = min(sleep * 2, self.max_sleep_s)
