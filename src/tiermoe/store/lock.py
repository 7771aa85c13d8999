"""The store's lock file: processes that read a store hold it shared, `tiermoe pack` exclusive.

Why: `tiermoe pack` rewrites experts.bin in place. Packing into the directory of a store that a
server is reading replaced the bytes under it, and every later read failed its checksum. Now
every process that opens a store (ExpertStore.open: the server, generate, eval, bench) holds a
shared flock on OUT/store.lock for as long as the store is open, and pack takes it exclusively
without waiting: while anyone reads the store, pack fails with one line naming their pids.

flock locks belong to the open file, so they vanish with the process (no stale locks after a
crash) and two stores opened by one process do not release each other's lock. The holders' pids
come from /proc/locks (Linux); where that is unavailable the message says "another process".
This module imports no torch: the CLI checks the lock before its slow imports.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from tiermoe.errors import UserError

LOCK_NAME = "store.lock"


class StoreLock:
    """An open lock file holding a shared or exclusive flock; `release()` (or exit) drops it."""

    def __init__(self, fd: int, path: Path, unavailable: str | None = None):
        self._fd = fd
        self.path = path
        self.unavailable = unavailable  # why the filesystem took no lock (the lock then holds nothing)

    @classmethod
    def shared(cls, root: str | os.PathLike) -> "StoreLock":
        """Hold the store shared (a reader); UserError while a pack holds it. Where the lock file
        cannot be created (a read-only store, which nobody can pack into either) the lock holds
        nothing."""
        path = Path(root) / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
        except OSError:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                return cls(-1, path)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(f"{root}: `tiermoe pack` is writing this store ({_who(path)}); "
                            "wait for it to finish") from None
        except OSError:  # a filesystem without flock (some network ones): serve without the lock
            os.close(fd)
            return cls(-1, path)
        return cls(fd, path)

    @classmethod
    def exclusive(cls, root: str | os.PathLike) -> "StoreLock":
        """Hold the store alone (pack); UserError naming the holders while anyone else holds it."""
        path = Path(root) / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise UserError(f"{path}: cannot create the lock file ({exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(f"{root}: the store is in use ({_who(path)}); stop it before packing into "
                            "this directory, or pack into another one") from None
        except OSError as exc:  # a filesystem without flock: pack goes on, saying it could not check
            os.close(fd)
            return cls(-1, path, unavailable=exc.strerror or str(exc))
        return cls(fd, path)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the only descriptor of the open file drops the flock
            self._fd = -1

    def __enter__(self) -> "StoreLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def holders(path: str | os.PathLike) -> list[int]:
    """Pids holding a flock on `path`, from /proc/locks (empty where unknown)."""
    try:
        st = os.stat(path)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    pids = []
    for line in lines:
        parts = line.split()
        if "->" in parts:  # a waiter, not a holder
            continue
        if len(parts) < 6 or parts[1] != "FLOCK":
            continue
        try:
            major, minor, inode = parts[5].split(":")
            pid, dev = int(parts[4]), (int(major, 16), int(minor, 16))
        except ValueError:
            continue
        if int(inode) == st.st_ino and dev == (os.major(st.st_dev), os.minor(st.st_dev)) and pid not in pids:
            pids.append(pid)
    return pids


def _who(path: Path) -> str:
    pids = holders(path)
    if not pids:
        return "held by another process"
    return ("held by pid " if len(pids) == 1 else "held by pids ") + ", ".join(str(p) for p in pids)
