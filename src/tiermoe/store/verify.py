"""`tiermoe verify`: check a store's manifest, re-read every expert record and every dense
shard, and compare them with the sha256 the manifest recorded.

The manifest first (`check_manifest`): a store that has none, or one whose records overlap,
leave gaps in a layer or disagree with the record layout, is reported as such rather than as a
missing tensor later. Dense shards (`verify_dense`): each one the manifest lists must exist,
hold the tensors the index assigns to it and, for stores packed since the manifest records
them, match its sha256.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from tiermoe.errors import UserError
from tiermoe.store.disk import DiskReader, StoreIOError, aligned_buffer, probe_direct_io
from tiermoe.store.pack_checks import incomplete_store
from tiermoe.store.records import RECORD_ALIGN, Manifest, RecordInfo, check_experts_file, load_manifest


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
    m = open_manifest(root)
    path = m.experts_path
    if direct_io:
        reason = probe_direct_io(path)
        if reason:
            raise UserError(f"{path}: O_DIRECT reads unavailable ({reason}); pass --no-direct-io")
    bad: list[RecordInfo] = []
    if not m.records:
        return 0, bad
    threads = min(threads, len(m.records))  # readers beyond one a record idle, and each holds buffers
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


def open_manifest(root: str | os.PathLike) -> Manifest:
    """The store's manifest, checked (UserError, one line, for a missing or inconsistent one)."""
    problem = incomplete_store(root)
    if problem:
        raise UserError(problem)
    m = load_manifest(root)
    check_manifest(m)
    check_experts_file(m)
    return m


def check_manifest(m: Manifest) -> None:
    """UserError unless every record of every listed layer is present once, aligned, of the
    layout's length, and no two records overlap."""
    where = m.root / "manifest.json"
    seen = {(r.layer, r.expert) for r in m.records}
    if len(seen) != len(m.records):
        raise UserError(f"{where}: a (layer, expert) pair is listed twice")
    for layer in m.moe_layers:
        n = m.experts_per_layer.get(layer, 0)
        missing = [e for e in range(n) if (layer, e) not in seen]
        if n == 0 or missing:
            raise UserError(f"{where}: layer {layer} lacks the records of experts {missing[:4] or 'all'}")
    end = 0
    for r in sorted(m.records, key=lambda r: r.offset):
        if r.length != m.layouts[r.layout].length or r.offset % RECORD_ALIGN or r.offset < end:
            raise UserError(f"{where}: record {r.name()} is misaligned, overlaps another or has the wrong length")
        end = r.offset + r.length


def verify_dense(m: Manifest, on_bad: Callable[[str, str], None] | None = None) -> tuple[int, list[str]]:
    """(dense shards checked, names of the bad ones); on_bad(name, why) for each bad one."""
    from safetensors import safe_open

    from tiermoe.store.pack import file_sha256

    dense = m.data.get("dense")
    if not isinstance(dense, dict) or not isinstance(dense.get("shards"), list):
        raise UserError(f"{m.root / 'manifest.json'}: lists no dense shards (not written by `tiermoe pack`?)")
    index_path = m.root / str(dense.get("index", "model.safetensors.index.json"))
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{index_path}: missing or unreadable dense index ({type(exc).__name__})") from None
    shas = dense.get("sha256") or {}
    bad: list[str] = []

    def fail(name: str, why: str) -> None:
        bad.append(name)
        if on_bad:
            on_bad(name, why)

    for name in sorted(set(weight_map.values()) - set(dense["shards"])):
        fail(name, "named by the dense index but not listed in the manifest")
    for name in dense["shards"]:
        path = m.root / name
        if not path.is_file():
            fail(name, "missing")
            continue
        try:
            with safe_open(str(path), framework="pt") as f:
                keys = set(f.keys())
        except Exception as exc:  # safetensors raises its own error types for a damaged header
            fail(name, f"unreadable safetensors file ({str(exc).splitlines()[0][:120] if str(exc) else exc})")
            continue
        lacking = [k for k, v in weight_map.items() if v == name and k not in keys]
        if lacking:
            fail(name, f"lacks {len(lacking)} tensor(s) the index puts there, e.g. {lacking[0]}")
        elif name in shas and file_sha256(path) != shas[name]:
            fail(name, "sha256 differs from the manifest's")
    return len(dense["shards"]), bad
