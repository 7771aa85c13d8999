"""`tiermoe verify`: re-read every record of a store and check its sha256."""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Callable

from tqdm import tqdm

from tiermoe.errors import UserError
from tiermoe.store.disk import DiskReader, StoreIOError, aligned_buffer, probe_direct_io
from tiermoe.store.records import RecordInfo, check_experts_file, load_manifest


def verify_store(
    root: str | os.PathLike,
    *,
    direct_io: bool = True,
    threads: int = 8,
    progress: bool = False,
    on_bad: Callable[[RecordInfo, str], None] | None = None,
) -> tuple[int, list[RecordInfo]]:
    """(records checked, bad records). UserError if the manifest or experts.bin is missing/truncated.

    With direct_io and a filesystem that refuses O_DIRECT this raises UserError (the caller
    may retry with direct_io=False, which reads buffered and drops pages after each read).
    """
    m = load_manifest(root)
    check_experts_file(m)
    path = m.experts_path
    if direct_io:
        reason = probe_direct_io(path)
        if reason:
            raise UserError(f"{path}: O_DIRECT reads unavailable ({reason}); pass --no-direct-io")
    bad: list[RecordInfo] = []
    if not m.records:
        return 0, bad
    depth = 2 * threads
    bufs = [aligned_buffer(max(r.length for r in m.records)) for _ in range(depth)]
    window: list[tuple[RecordInfo, Future]] = []
    bar = tqdm(total=sum(r.length for r in m.records), unit="B", unit_scale=True, unit_divisor=1024,
               desc="verify", disable=not progress)

    def finish(rec: RecordInfo, fut: Future) -> None:
        try:
            got = fut.result()
        except StoreIOError as exc:  # unreadable counts as bad; keep checking the rest
            got = f"unreadable: {exc}"
        bar.update(rec.length)
        if got != rec.sha256:
            bad.append(rec)
            if on_bad:
                on_bad(rec, got)

    with DiskReader(path, direct=direct_io, threads=threads) as reader:
        for n, rec in enumerate(m.records):
            if len(window) == depth:
                finish(*window.pop(0))
            window.append((rec, reader.submit(rec, bufs[n % depth], check=False)))
        for item in window:
            finish(*item)
    bar.close()
    return len(m.records), bad
