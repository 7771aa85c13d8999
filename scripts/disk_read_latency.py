"""Latency of one expert record read from disk as the disk tier reads it (store/disk.DiskReader), by check.

A decode step that needs a record the disk holds waits for that one read, so its latency (not the disk's
throughput) is what the step pays. Two ways, each over the same records one at a time, O_DIRECT: the first
read of a record (sha256 against the manifest, overlapped with the piece reads); a later read (each piece's
crc32 against the verified read's, computed by the thread that read the piece).

    python scripts/disk_read_latency.py [DIR] [--records 24] [--mb 13]

DIR (default: the current directory) must allow O_DIRECT; a file of RECORDS x MB is written there and removed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time
from pathlib import Path

from tiermoe.store.disk import DiskReader, aligned_buffer
from tiermoe.store.records import RECORD_ALIGN, RecordInfo


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", nargs="?", default=".")
    p.add_argument("--records", type=int, default=24)
    p.add_argument("--mb", type=float, default=13.0)
    args = p.parse_args()
    length = int(args.mb * 1e6) // RECORD_ALIGN * RECORD_ALIGN
    path = Path(args.dir) / "tiermoe-read-latency.bin"
    records = []
    with open(path, "wb") as f:
        for i in range(args.records):
            data = os.urandom(length)
            records.append(RecordInfo(index=i, layer=0, expert=i, offset=i * length, length=length,
                                      sha256=hashlib.sha256(data).hexdigest(), layout=0))
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        with DiskReader(path, threads=16) as reader:
            buf = aligned_buffer(length)

            def timed() -> list[float]:
                out = []
                for rec in records:
                    t0 = time.perf_counter()
                    reader.read(rec, buf)
                    out.append((time.perf_counter() - t0) * 1e3)
                return out

            rows = [("first read: sha256 against the manifest", timed()),
                    ("later read: the pieces' crc32", timed())]
        for name, ms in rows:
            print(f"{name:<58} median {statistics.median(ms):6.2f} ms, mean {statistics.mean(ms):6.2f} ms "
                  f"({length / 1e6:.1f} MB records, {len(ms)} reads, one at a time)")
    finally:
        path.unlink()


if __name__ == "__main__":
    main()
