"""The CPU lane's compiled kernel (lane_kernel.cpp): built with the machine's C++ compiler on first
use, loaded through ctypes.

Why ctypes and a plain shared library instead of a torch C++ extension: the library depends on
nothing but the C++ runtime, so it compiles in seconds (torch's headers take a minute) and one
build serves every torch version (CI's 2.13 CPU build, the GPU machine's 2.11); ctypes releases
the GIL for the call, so the lane computes while Python threads (the engine, the mailbox server)
run. One library holds scalar, AVX2 and AVX-512 code; the pool picks the best the CPU has.

The library lands in a directory the caller names (moe/lane_kernel.py: the user's cache), under
a name that hashes the sources, the compiler's version and the flags, written atomically so
concurrent first uses agree. No compiler, or a failed build: `NativeUnavailable` with the reason;
the lane then computes with its plain-torch twin (reference.lane_experts_ref).
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE_DIR = Path(__file__).resolve().parent
SOURCES = ("lane_kernel.cpp", "lane_dot.h", "lane_server.h")
ABI = 8  # TM_ABI of lane_kernel.cpp: a library of another ABI is rebuilt
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-w")
ISA_NAMES = ("scalar", "avx2", "avx512", "avx512bf16")
KINDS = {"bf16": 0, "int4": 1, "int8": 2, "int3": 3}  # record kinds the kernel reads (KIND_* of lane_dot.h)


LANE_ERRORS = {-1: "a record shape, expert id or routing it does not take", -2: "out of memory"}  # posted jobs


class NativeUnavailable(RuntimeError):
    """The compiled kernel cannot be built or loaded here (the message says why)."""


class TmLaneJob(ctypes.Structure):
    """struct TmLaneJob of lane_kernel.cpp, field for field."""

    _fields_ = [("kind", ctypes.c_int32), ("hidden", ctypes.c_int32), ("inter", ctypes.c_int32),
                ("group", ctypes.c_int32), ("gu_q", ctypes.c_int64), ("gu_s", ctypes.c_int64),
                ("dn_q", ctypes.c_int64), ("dn_s", ctypes.c_int64), ("n_exp", ctypes.c_int32),
                ("n_tok", ctypes.c_int32), ("rec", ctypes.c_void_p), ("tok_off", ctypes.c_void_p),
                ("tok_idx", ctypes.c_void_p), ("tok_w", ctypes.c_void_p), ("x", ctypes.c_void_p),
                ("out", ctypes.c_void_p), ("round_bf16", ctypes.c_int32), ("has_limit", ctypes.c_int32),
                ("limit", ctypes.c_float)]


class TmPostedJob(ctypes.Structure):
    """struct TmPostedJob of lane_kernel.cpp, field for field."""

    _fields_ = [("job", TmLaneJob), ("meta", ctypes.c_void_p), ("lane_cap", ctypes.c_int32),
                ("top_k", ctypes.c_int32), ("rec_of", ctypes.c_void_p), ("layout_of", ctypes.c_void_p),
                ("n_experts", ctypes.c_int32), ("layout", ctypes.c_int32), ("xb", ctypes.c_void_p)]


class TmServerLayout(ctypes.Structure):
    """struct TmServerLayout of lane_server.h."""

    _fields_ = [("job", TmLaneJob), ("weight_bytes", ctypes.c_int64)]


class TmServerSlot(ctypes.Structure):
    """struct TmServerSlot of lane_server.h."""

    _fields_ = [("rec_of", ctypes.c_void_p), ("layout_of", ctypes.c_void_p), ("n_experts", ctypes.c_int32)]


class TmServerSpec(ctypes.Structure):
    """struct TmServerSpec of lane_server.h."""

    _fields_ = [("ctrl", ctypes.c_void_p), ("x", ctypes.c_void_p), ("result", ctypes.c_void_p),
                ("meta", ctypes.c_void_p)] + [(n, ctypes.c_int32) for n in (
                    "slots", "ctrl_words", "hidden", "max_tokens", "meta_words", "lane_cap", "top_k", "n_layouts",
                    "w_posted", "w_ntok", "w_done", "w_err", "cpu")] + [
                ("layouts", ctypes.c_void_p), ("slot_specs", ctypes.c_void_p)]


class TmServerStats(ctypes.Structure):
    """struct TmServerStats of lane_server.h."""

    _fields_ = [(n, ctypes.c_int64) for n in ("served", "failed", "experts", "layers", "weight_bytes", "busy_ns",
                                              "serve_ns")] + [("last_error", ctypes.c_int32),
                                                              ("alive", ctypes.c_int32)]


def find_compiler() -> str | None:
    """$CXX, else the first of g++, c++, clang++ on PATH."""
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx)
    return next((p for p in map(shutil.which, ("g++", "c++", "clang++")) if p), None)


def _fingerprint(compiler: str) -> str:
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((SOURCE_DIR / name).read_bytes())
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"{compiler} --version failed: {exc}") from None
    h.update(version.encode())
    h.update(" ".join(FLAGS).encode())
    h.update(platform.machine().encode())
    return h.hexdigest()[:16]


def build_library(directory: Path, compiler: str | None = None) -> Path:
    """The compiled library in `directory`, built now if it is not there yet."""
    compiler = compiler or find_compiler()
    if compiler is None:
        raise NativeUnavailable("no C++ compiler found (g++, c++ or clang++; or set CXX)")
    lib = Path(directory) / f"tiermoe_lane-{_fingerprint(compiler)}.so"
    if lib.is_file():
        return lib
    try:
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=lib.stem + ".", suffix=".tmp", dir=lib.parent)
        os.close(fd)
    except OSError as exc:
        raise NativeUnavailable(f"cannot write to {lib.parent}: {exc.strerror or exc}") from None
    try:
        cmd = [compiler, *FLAGS, "-o", tmp, str(SOURCE_DIR / SOURCES[0])]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as exc:
            raise NativeUnavailable(f"{compiler} failed to run: {exc}") from None
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise NativeUnavailable(f"{compiler} could not build the lane kernel: {last}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


_LOADED: dict[Path, ctypes.CDLL] = {}
_LOAD_LOCK = threading.Lock()


def load_library(path: Path) -> ctypes.CDLL:
    """Load (once per process) a library from build_library and declare its functions."""
    with _LOAD_LOCK:
        if path in _LOADED:
            return _LOADED[path]
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            raise NativeUnavailable(f"cannot load {path.name}: {exc}") from None
        lib.tm_abi.restype = ctypes.c_int32
        if lib.tm_abi() != ABI:
            raise NativeUnavailable(f"{path.name} has ABI {lib.tm_abi()}, expected {ABI}")
        lib.tm_cpu_isa.restype = ctypes.c_int32
        lib.tm_pool_new.restype = ctypes.c_void_p
        lib.tm_pool_new.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32]
        lib.tm_pool_free.argtypes = [ctypes.c_void_p]
        lib.tm_pool_tune.restype = ctypes.c_int32
        lib.tm_pool_tune.argtypes = [ctypes.c_void_p] + [ctypes.c_int32] * 4
        lib.tm_pool_isa.restype = ctypes.c_int32
        lib.tm_pool_isa.argtypes = [ctypes.c_void_p]
        lib.tm_lane_run.restype = ctypes.c_int32
        lib.tm_lane_run.argtypes = [ctypes.c_void_p, ctypes.POINTER(TmLaneJob)]
        lib.tm_lane_posted.restype = ctypes.c_int32
        lib.tm_lane_posted.argtypes = [ctypes.c_void_p, ctypes.POINTER(TmPostedJob), ctypes.POINTER(ctypes.c_int32)]
        lib.tm_server_start.restype = ctypes.c_void_p
        lib.tm_server_start.argtypes = [ctypes.c_void_p, ctypes.POINTER(TmServerSpec)]
        lib.tm_server_active.argtypes = [ctypes.c_void_p, ctypes.c_int32]
        lib.tm_server_limit.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_float]
        lib.tm_server_stats.argtypes = [ctypes.c_void_p, ctypes.POINTER(TmServerStats)]
        lib.tm_server_stop.argtypes = [ctypes.c_void_p, ctypes.POINTER(TmServerStats)]
        lib.tm_read.restype = ctypes.c_uint64
        lib.tm_read.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        _LOADED[path] = lib
        return lib


@dataclass(frozen=True)
class LaneTuning:
    """How a lane job is cut into work items and how far its reads prefetch: gate/up rows (of
    each half) and down rows per item, rows ahead of the computed ones that prefetches reach (0:
    none; only within an item, whose rows one thread reads in order), and the prefetches' locality
    (3: into L1, 2: L2, 1: L3). Longer items read longer runs of a record in one thread; shorter
    ones balance better between threads."""

    rows_gu: int = 16
    rows_down: int = 16
    ahead_rows: int = 2
    hint: int = 3


class LanePool:
    """One pool of `threads` threads (the caller's plus threads-1 workers, pinned to `cpus[1:]`
    when given) that computes lane jobs; one job at a time (calls serialize). isa: the most the
    pool may use ("avx512bf16", "avx512", "avx2" or "scalar"; the CPU may allow less; a job
    that cannot use it runs on the next one: bf16 dot products only with bf16 numerics)."""

    def __init__(self, lib: ctypes.CDLL, threads: int, cpus: list[int] | None = None, isa: str = "avx512bf16",
                 spin_us: int = 500) -> None:
        if isa not in ISA_NAMES:
            raise ValueError(f"isa must be one of {ISA_NAMES}, got {isa!r}")
        self.lib, self.threads = lib, max(1, int(threads))
        self.spin_us = int(spin_us)  # how long workers spin after a job before they sleep
        self.cpus = list(cpus or ())  # cpus[0]: the caller's core, where the caller pins itself
        arr = (ctypes.c_int32 * max(1, len(cpus or ())))(*(cpus or ()))
        self._pool = lib.tm_pool_new(self.threads, arr, len(cpus or ()), ISA_NAMES.index(isa), int(spin_us))
        if not self._pool:
            raise NativeUnavailable("could not start the lane's thread pool")
        self.isa = ISA_NAMES[lib.tm_pool_isa(self._pool)]

    def run(self, layout, records: list[int], tok_off: torch.Tensor, tok_idx: torch.Tensor, tok_w: torch.Tensor,
            x: torch.Tensor, out: torch.Tensor, round_bf16: bool, limit: float | None) -> None:
        """out [T, H] fp32 += the experts' weighted outputs. layout: kernels.layout.ExpertLayout;
        records: each expert's record address (ascending ids); tok_off int32 [n+1], tok_idx
        int32 [m] (rows of x), tok_w fp32 [m]; x fp32 [T, H] contiguous."""
        n = len(records)
        if n == 0:
            return
        for t, dt in ((tok_off, torch.int32), (tok_idx, torch.int32), (tok_w, torch.float32), (x, torch.float32),
                      (out, torch.float32)):
            if t.dtype != dt or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"lane kernel operand must be a contiguous CPU {dt} tensor, got {t.dtype}")
        if x.shape != out.shape or x.shape[1] != layout.hidden or tok_off.numel() != n + 1:
            raise ValueError("lane kernel operands do not match the layout")
        recs = (ctypes.c_uint64 * n)(*records)
        job = TmLaneJob(KINDS[layout.kind], layout.hidden, layout.inter, layout.group_size, layout.gate_up_q,
                        layout.gate_up_s, layout.down_q, layout.down_s, n, x.shape[0], ctypes.addressof(recs),
                        tok_off.data_ptr(), tok_idx.data_ptr(), tok_w.data_ptr(), x.data_ptr(), out.data_ptr(),
                        int(bool(round_bf16)), int(limit is not None), float(limit or 0.0))
        rc = self.lib.tm_lane_run(self._pool, ctypes.byref(job))
        if rc != 0:
            why = {-1: "a record shape or routing it does not take", -2: "out of memory"}.get(rc, f"error {rc}")
            raise RuntimeError(f"lane kernel failed: {why}")

    def run_posted(self, layout, meta: torch.Tensor, lane_cap: int, top_k: int, rec_of: torch.Tensor,
                   layout_of: torch.Tensor | None, layout_index: int, x: torch.Tensor, out: torch.Tensor,
                   round_bf16: bool, limit: float | None) -> int:
        """A decode layer as the device posted it: out [T, H] fp32 += its lane experts of `layout_index`;
        returns how many experts that was. meta int32 [>= lane_cap + 2 T top_k]: lane ids (-1: none) |
        topk ids [T, k] | routing weights (fp32 bits) [T, k]; rec_of int64 [E]: each expert's record
        address; layout_of int8 [E] (None: one layout); x bf16 [T, H] contiguous. The routing set-up
        (each lane expert's rows and weights, in the order of `run`'s callers) is done in C."""
        t = x.shape[0]
        checks = ((meta, torch.int32), (rec_of, torch.int64), (x, torch.bfloat16), (out, torch.float32))
        for ten, dt in checks + (((layout_of, torch.int8),) if layout_of is not None else ()):
            if ten.dtype != dt or not ten.is_contiguous() or ten.device.type != "cpu":
                raise ValueError(f"lane kernel operand must be a contiguous CPU {dt} tensor, got {ten.dtype}")
        if x.shape != out.shape or x.shape[1] != layout.hidden or meta.numel() < lane_cap + 2 * t * top_k:
            raise ValueError("lane kernel operands do not match the layout")
        if layout_of is not None and layout_of.numel() != rec_of.numel():
            raise ValueError("layout_of must name a layout for every expert of rec_of")
        job = TmLaneJob(KINDS[layout.kind], layout.hidden, layout.inter, layout.group_size, layout.gate_up_q,
                        layout.gate_up_s, layout.down_q, layout.down_s, 0, t, None, None, None, None, None,
                        out.data_ptr(), int(bool(round_bf16)), int(limit is not None), float(limit or 0.0))
        posted = TmPostedJob(job, meta.data_ptr(), int(lane_cap), int(top_k), rec_of.data_ptr(),
                             layout_of.data_ptr() if layout_of is not None else None, rec_of.numel(),
                             int(layout_index), x.data_ptr())
        computed = ctypes.c_int32(0)
        rc = self.lib.tm_lane_posted(self._pool, ctypes.byref(posted), ctypes.byref(computed))
        if rc != 0:
            why = LANE_ERRORS.get(rc, f"error {rc}")
            raise RuntimeError(f"lane kernel failed: {why}")
        return computed.value

    def tune(self, tuning: "LaneTuning") -> None:
        """Work items and prefetches of the jobs that follow (ValueError: out of range)."""
        if self.lib.tm_pool_tune(self._pool, tuning.rows_gu, tuning.rows_down, tuning.ahead_rows, tuning.hint):
            raise ValueError(f"lane tuning out of range: {tuning}")

    def read(self, buf: torch.Tensor) -> None:
        """Read every byte of the contiguous CPU tensor `buf` with the pool's threads."""
        self.lib.tm_read(self._pool, buf.data_ptr(), buf.numel() * buf.element_size())

    def close(self) -> None:
        if self._pool:
            self.lib.tm_pool_free(self._pool)
            self._pool = None

    def __del__(self) -> None:
        self.close()


class NativeMailboxServer:
    """The CPU lane's mailbox server as a native thread (lane_server.h): it polls a Mailbox
    (kernels/triton/mailbox.py) and answers each post with the pool's posted-job kernel, the
    arithmetic of CpuLane.compute_posted, without taking Python's interpreter lock (module doc of
    lane_server.h says why). Same attributes as MailboxServer: served, failed, serve_s, failure
    (the last failure's reason, until set to None), alive, start(), stop(); plus set_active (poll
    or park), set_limit (the SwiGLU clamp) and stats().

    slots: per mailbox slot, (rec_of int64 [E] each expert's record address, read at every post,
    so a view the owner updates in place stays current; layout_of int8 [E] or None); layouts:
    kernels.layout.ExpertLayout per layout index, weight_bytes their expert weight bytes. The
    tensors must stay alive as long as the server (it keeps references)."""

    def __init__(self, pool: LanePool, mailbox, slots: list, layouts: list, weight_bytes: list[int], *,
                 lane_cap: int, top_k: int, round_bf16: bool, cpu: int | None = None) -> None:
        from tiermoe.kernels.reference import MAILBOX_CTRL, MAILBOX_DONE, MAILBOX_ERR, MAILBOX_NTOK, MAILBOX_POSTED

        if len(slots) != mailbox.slots:
            raise ValueError(f"{len(slots)} slot specs for a mailbox of {mailbox.slots} slots")
        self.pool, self.mailbox, self.lib = pool, mailbox, pool.lib
        self._keep = [t for pair in slots for t in pair if t is not None]  # what the thread reads, kept alive
        for rec_of, layout_of in slots:
            if rec_of.dtype != torch.int64 or not rec_of.is_contiguous() or (
                    layout_of is not None and (layout_of.dtype != torch.int8 or layout_of.numel() != rec_of.numel())):
                raise ValueError("a slot takes a contiguous int64 rec_of and an int8 layout_of of the same length")
        self._slots = (TmServerSlot * max(1, len(slots)))(*[
            TmServerSlot(r.data_ptr(), lo.data_ptr() if lo is not None else None, r.numel()) for r, lo in slots])
        self._layouts = (TmServerLayout * len(layouts))(*[
            TmServerLayout(TmLaneJob(KINDS[lay.kind], lay.hidden, lay.inter, lay.group_size, lay.gate_up_q,
                                     lay.gate_up_s, lay.down_q, lay.down_s, 0, 0, None, None, None, None, None, None,
                                     int(bool(round_bf16)), 0, 0.0), int(wb))
            for lay, wb in zip(layouts, weight_bytes)])
        mb = mailbox
        self._spec = TmServerSpec(mb.ctrl.data_ptr(), mb.x_host.data_ptr(), mb.result.data_ptr(), mb.meta.data_ptr(),
                                  mb.slots, MAILBOX_CTRL, mb.hidden, mb.max_tokens, mb.meta.shape[1], int(lane_cap),
                                  int(top_k), len(layouts), MAILBOX_POSTED, MAILBOX_NTOK, MAILBOX_DONE, MAILBOX_ERR,
                                  -1 if cpu is None else int(cpu), ctypes.addressof(self._layouts),
                                  ctypes.addressof(self._slots))
        self._srv = None
        self._last = TmServerStats()  # the counters at stop (what stats() reads afterwards)
        self._lock = threading.Lock()  # stats() (any thread: /stats) against stop() freeing the server
        self._acknowledged = 0  # failures already reported

    def start(self) -> "NativeMailboxServer":
        """Start the thread (parked until set_active(True); a post while parked is answered within 50 ms).
        Until stop() the server is kept alive here too: its thread reads memory the wrapper holds."""
        with self._lock:
            if self._srv is None:
                self._srv = self.lib.tm_server_start(self.pool._pool, ctypes.byref(self._spec))
                if not self._srv:
                    raise NativeUnavailable("could not start the lane's mailbox server thread")
                _RUNNING.add(self)
        return self

    def set_active(self, on: bool) -> None:
        """Poll without pause (a step that may post runs) or park between such steps."""
        if self._srv is not None:
            self.lib.tm_server_active(self._srv, int(bool(on)))

    def set_limit(self, limit: float | None) -> None:
        """The SwiGLU clamp of the answers that follow (None: none)."""
        if self._srv is not None:
            self.lib.tm_server_limit(self._srv, int(limit is not None), float(limit or 0.0))

    def stats(self) -> TmServerStats:
        """The thread's counters now (cumulative; after stop(), its final ones)."""
        with self._lock:
            if self._srv is None:
                return TmServerStats.from_buffer_copy(self._last)
            s = TmServerStats()
            self.lib.tm_server_stats(self._srv, ctypes.byref(s))
            return s

    @property
    def alive(self) -> bool:
        return bool(self.stats().alive)

    @property
    def served(self) -> int:
        return int(self.stats().served)

    @property
    def failed(self) -> int:
        return int(self.stats().failed)

    @property
    def serve_s(self) -> float:
        return self.stats().serve_ns / 1e9

    @property
    def failure(self) -> str | None:
        """The reason of the last failed answer not yet reported (None: none)."""
        s = self.stats()
        if s.failed <= self._acknowledged:
            return None
        return f"lane kernel failed: {LANE_ERRORS.get(s.last_error, f'error {s.last_error}')}"

    @failure.setter
    def failure(self, value: None) -> None:
        if value is not None:
            raise ValueError("a native server's failure can only be acknowledged (set to None)")
        self._acknowledged = int(self.stats().failed)

    def stop(self, timeout: float | None = None) -> None:
        """Stop polling and join the thread (after its current answer; `timeout` is not used)."""
        with self._lock:
            if self._srv is not None:
                srv, self._srv = self._srv, None
                self.lib.tm_server_stop(srv, ctypes.byref(self._last))
                self._last.alive = 0
        _RUNNING.discard(self)


# Servers started and not stopped: kept alive (their thread reads the mailbox's pinned memory, the records'
# addresses and the pool, which the wrapper holds) and stopped at interpreter exit, before the teardown frees them.
_RUNNING: "set[NativeMailboxServer]" = set()


@atexit.register
def _stop_running_servers() -> None:
    for server in list(_RUNNING):
        server.stop()
