"""Disk tier: O_DIRECT record reads by a pool of threads, with sha256 checks.

Why O_DIRECT: the record store is far larger than RAM; buffered reads would fill the page
cache with experts the RAM tier already holds (a second copy) and evict the RAM tier's own
pages under pressure. O_DIRECT needs 4096-aligned offsets, lengths and buffer addresses, which
the record format guarantees and `aligned_buffer` provides. Filesystems without O_DIRECT
(tmpfs, some FUSE and network filesystems) are refused by `probe_direct_io` unless the user
asks for buffered reads, which then drop each record from the page cache after reading
(posix_fadvise DONTNEED).

Integrity: a record read from disk is checked before anyone may decode it, so no output is ever
computed from a corrupted record; a mismatch raises StoreIntegrityError naming the record. Its
first read is hashed (sha256, in the reader thread: hashlib releases the GIL) and compared with the
manifest; that read also keeps the crc32 of each of its pieces, and with verify "always" every later
read of the record is checked against those, each piece's crc computed in the thread that read it.
Why: sha256 is sequential (about 6 ms for a 13 MB record on the machines measured, as long as the
read), so every read of a disk-tier decode step waited for it; the pieces' crc32s cost a fraction of
a millisecond after the last piece lands (docs/results.md), and catch a record that changed on disk
after it was verified as surely as any 32-bit check.

Pieces: a record is read as READ_PIECE-byte preads on a second pool, all in flight at once, and
hashed piece by piece as they land in order. Hashing a record takes about as long as reading it,
so one after the other a decode step that waits for a read waits for both; this way it waits for
the longer of the two, and the disk sees many requests at once instead of one.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Sequence

import torch

from tiermoe.errors import StoreError, StoreIntegrityError, UserError
from tiermoe.store.records import RECORD_ALIGN, RecordInfo

O_DIRECT = getattr(os, "O_DIRECT", 0)
VERIFY_MODES = ("always", "first")
READ_PIECE = 2 << 20  # bytes per pread of a record (a multiple of RECORD_ALIGN: O_DIRECT offsets stay aligned)


class StoreIOError(StoreError):
    """A record could not be read (I/O error or short read); the message names the record."""


def aligned_buffer(nbytes: int, *, pin: bool = False, align: int = RECORD_ALIGN) -> torch.Tensor:
    """A uint8 CPU tensor [nbytes] whose data pointer is `align`-aligned (for O_DIRECT).

    With pin=True (and CUDA present) the memory is page-locked so host->GPU copies are DMA'd
    without a bounce. The tensor is a view into a slightly larger allocation.
    """
    pin = pin and torch.cuda.is_available()
    base = torch.empty(nbytes + align, dtype=torch.uint8, pin_memory=pin)
    shift = (-base.data_ptr()) % align
    out = base[shift : shift + nbytes]
    assert out.data_ptr() % align == 0
    return out


def probe_direct_io(path: str | os.PathLike) -> str | None:
    """None if `path` can be read with O_DIRECT, else a one-line reason why not."""
    if not O_DIRECT:
        return "this platform has no O_DIRECT"
    try:
        fd = os.open(path, os.O_RDONLY | O_DIRECT)
    except OSError as exc:
        return f"open(O_DIRECT) failed: {exc.strerror or exc}"
    try:
        if os.fstat(fd).st_size == 0:
            return None
        buf = aligned_buffer(RECORD_ALIGN)
        os.preadv(fd, [memoryview(buf.numpy())], 0)
    except OSError as exc:
        return f"an O_DIRECT read failed: {exc.strerror or exc}"
    finally:
        os.close(fd)
    return None


def require_direct_io(path: str | os.PathLike) -> None:
    """Refuse (UserError, one line) a filesystem without O_DIRECT."""
    reason = probe_direct_io(path)
    if reason:
        raise UserError(
            f"{path}: the filesystem does not support O_DIRECT reads ({reason}); "
            "pass --no-direct-io to use buffered reads"
        )


def pread_exact(fd: int, view: memoryview, offset: int, what: str) -> None:
    """Fill `view` from `offset`; StoreIOError on EIO (or any OSError) or a short read."""
    want = len(view)
    got = 0
    while got < want:
        try:
            n = os.preadv(fd, [view[got:]], offset + got)
        except OSError as exc:
            raise StoreIOError(f"I/O error reading {what}: {exc.strerror or exc} (errno {exc.errno})") from None
        if n <= 0:
            raise StoreIOError(f"short read of {what}: got {got} of {want} bytes (file truncated?)")
        got += n


def _pread_crc(fd: int, view: memoryview, offset: int, what: str) -> int:
    """pread_exact, then the crc32 of the bytes read (zlib releases the GIL for large buffers)."""
    pread_exact(fd, view, offset, what)
    return zlib.crc32(view)


def measure_read_gbs(path: str | os.PathLike, records: Sequence[RecordInfo], *, max_bytes: int = 256 << 20,
                     threads: int = 8) -> tuple[float, int, str]:
    """(GB/s, bytes read, "O_DIRECT" or "buffered") of reading records of experts.bin at `path` as the
    disk tier does: records spread evenly over the file (up to `max_bytes`), `threads` readers at
    once, no hashing. Where O_DIRECT is refused the pages are dropped before the reads (and after),
    so the figure is still the device's rather than the page cache's, where the kernel allows."""
    if not records:
        return 0.0, 0, "none"
    n = max(1, min(len(records), max_bytes // max(1, max(r.length for r in records))))
    picked = [records[i * len(records) // n] for i in range(n)]
    direct = probe_direct_io(path) is None
    fd = os.open(path, os.O_RDONLY | (O_DIRECT if direct else 0))
    advise = not direct and hasattr(os, "posix_fadvise")

    def drop() -> None:
        if advise:
            for rec in picked:
                os.posix_fadvise(fd, rec.offset, rec.length, os.POSIX_FADV_DONTNEED)

    def read_share(k: int) -> None:  # reader k: records k, k + threads, ... into one aligned buffer
        buf = aligned_buffer(max(r.length for r in picked))
        for rec in picked[k::threads]:
            pread_exact(fd, memoryview(buf.numpy())[: rec.length], rec.offset, f"{rec.name()} from {path}")

    try:
        drop()
        workers = max(1, min(threads, n))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tiermoe-disk-probe") as pool:
            t0 = time.perf_counter()
            for f in [pool.submit(read_share, k) for k in range(workers)]:
                f.result()
            seconds = time.perf_counter() - t0
        drop()
    finally:
        os.close(fd)
    nbytes = sum(r.length for r in picked)
    return nbytes / max(seconds, 1e-9) / 1e9, nbytes, "O_DIRECT" if direct else "buffered"


class DiskReader:
    """A pool of reader threads over experts.bin.

    `submit(rec, dest)` reads record `rec` into `dest` (an aligned uint8 CPU tensor of at least
    rec.length bytes) and returns a Future resolving to `dest` once the bytes are in and, per
    `verify`, checked: "always" checks every read (the first by sha256, later ones by its pieces' crc32s:
    module doc), "first" only the first read of each record.
    """

    def __init__(self, path: str | os.PathLike, *, direct: bool = True, threads: int = 16, verify: str = "always",
                 piece_bytes: int = READ_PIECE):
        if verify not in VERIFY_MODES:
            raise UserError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
        self.path = Path(path)
        self.direct = bool(direct)
        self.verify = verify
        if self.direct:
            require_direct_io(self.path)
        flags = os.O_RDONLY | (O_DIRECT if self.direct else 0)
        try:
            self._fd = os.open(self.path, flags)
        except OSError as exc:
            raise UserError(f"{self.path}: cannot open ({exc.strerror or exc})") from None
        if piece_bytes <= 0 or piece_bytes % RECORD_ALIGN:
            raise ValueError(f"piece_bytes must be a positive multiple of {RECORD_ALIGN}")
        self.piece_bytes = int(piece_bytes)
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="tiermoe-disk")
        self._pieces = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="tiermoe-disk-piece")
        self._lock = threading.Lock()
        self._verified: set[int] = set()
        self._piece_crcs: dict[int, tuple[int, ...]] = {}  # record -> crc32 of each piece of its verified read
        self.in_flight = 0
        self.reads = 0
        self.bytes_read = 0
        self.checks = 0

    def _read_hashing(self, rec: RecordInfo, view: memoryview, what: str, hashing: bool
                      ) -> tuple[str | None, tuple[int, ...]]:
        """All pieces of `rec` in flight at once into `view`: (the sha256 of the bytes when hashing, else
        None; the crc32 of each piece). Every piece has finished, read or failed, before this returns or
        raises: `view` is the caller's buffer, which no read may still be writing afterwards."""
        step = self.piece_bytes
        spans = [(o, min(step, rec.length - o)) for o in range(0, rec.length, step)]
        futures = [self._pieces.submit(_pread_crc, self._fd, view[o:o + n], rec.offset + o, what) for o, n in spans]
        hasher = hashlib.sha256() if hashing else None
        crcs = []
        try:
            for (o, n), fut in zip(spans, futures):
                crcs.append(fut.result())
                if hasher is not None:
                    hasher.update(view[o:o + n])
        except BaseException:
            wait(futures)
            raise
        return (hasher.hexdigest() if hasher is not None else None), tuple(crcs)

    def _read(self, rec: RecordInfo, dest: torch.Tensor, check: bool) -> torch.Tensor | str:
        view = memoryview(dest.numpy())[: rec.length]
        what = f"{rec.name()} from {self.path}"
        try:
            known = self._piece_crcs.get(rec.index) if check and self.verify == "always" else None
            hashing = known is None and (not check or self.verify == "always" or rec.index not in self._verified)
            digest, crcs = self._read_hashing(rec, view, what, hashing)
            if not self.direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self._fd, rec.offset, rec.length, os.POSIX_FADV_DONTNEED)
            with self._lock:
                self.reads += 1
                self.bytes_read += rec.length
            if not check:
                return digest
            if known is not None:
                with self._lock:
                    self.checks += 1
                if crcs != known:
                    raise StoreIntegrityError(
                        f"{self.path}: checksum mismatch for {rec.name()} (it changed on disk since its first read "
                        f"was verified); the store is corrupted (run `tiermoe verify {self.path.parent}`)"
                    )
            if hashing:
                with self._lock:
                    self.checks += 1
                if digest != rec.sha256:
                    raise StoreIntegrityError(
                        f"{self.path}: checksum mismatch for {rec.name()}; the store is corrupted "
                        f"(run `tiermoe verify {self.path.parent}`)"
                    )
                self._verified.add(rec.index)
                self._piece_crcs[rec.index] = crcs
            return dest
        finally:
            with self._lock:
                self.in_flight -= 1

    def submit(self, rec: RecordInfo, dest: torch.Tensor, *, check: bool = True) -> Future:
        """Start reading `rec` into `dest`; with check=False the Future yields the hex sha256."""
        if dest.numel() < rec.length or dest.data_ptr() % RECORD_ALIGN:
            raise ValueError("destination buffer too small or not 4096-aligned")
        with self._lock:
            self.in_flight += 1
        try:
            return self._pool.submit(self._read, rec, dest, check)
        except BaseException:
            with self._lock:
                self.in_flight -= 1
            raise

    def read(self, rec: RecordInfo, dest: torch.Tensor) -> torch.Tensor:
        """Synchronous read + check."""
        return self.submit(rec, dest).result()

    def close(self) -> None:
        if self._fd >= 0:
            self._pool.shutdown(wait=True)
            self._pieces.shutdown(wait=True)
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "DiskReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
