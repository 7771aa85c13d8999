"""`tiermoe pack`: Hugging Face checkpoint -> packed expert store.

Pipeline: the main thread loads one expert at a time (memory-mapped safetensors slices) and
encodes it into one of a few aligned buffers; a writer thread pwrite()s it (O_DIRECT where
the filesystem allows), hashes it and, every ~64 MiB after fdatasync, appends the finished
records to OUT/pack.journal. A restart with the same source and options skips journaled
records. Nothing is reported as done until every record has been read back from disk
(O_DIRECT) and matched its sha256; records that fail are rewritten once, then pack fails.
The manifest is written last, so a store without manifest.json is known to be incomplete; it
records the sha256 of every dense shard too, for `tiermoe verify`.

OUT must be new, empty, or an earlier pack of the same source and settings (pack_checks.py),
and pack holds OUT/store.lock exclusively while it writes: a process reading the store holds it
shared (lock.py), so packing into a store in use fails instead of rewriting it under its reader.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from tiermoe.errors import UserError
from tiermoe.store.catalog import Checkpoint, itemsize, text_config
from tiermoe.store.disk import O_DIRECT, DiskReader, aligned_buffer, probe_direct_io
from tiermoe.store.lock import StoreLock
from tiermoe.store.mixed import RecordPlan, mixed_plan
from tiermoe.store.pack_checks import (DEFAULT_HOT_SHARE, JOURNAL_NAME, check_cold_args, check_target,
                                       choose_group_size)
from tiermoe.store.records import (
    EXPERTS_NAME,
    FORMAT_VERSION,
    FLOAT_KINDS,
    INT_KINDS,
    MANIFEST_NAME,
    QUANT_KINDS,
    RecordInfo,
    RecordLayout,
    dtype_name,
    encode_expert,
    write_manifest,
)

DENSE_INDEX = "model.safetensors.index.json"
SYNC_BYTES = 64 << 20


@dataclass
class PackResult:
    out: Path
    records: int
    written: int  # records written by this run (the rest were resumed)
    rewritten: int  # records rewritten after a failed read-back
    direct_io: bool
    notes: list[str]
    group_size: int | None = None  # int8/int4/int3: the group size used (picked when none was given)
    layout_counts: list[int] | None = None  # records per layout (two entries for a mixed store)
    cold_group_size: int | None = None  # mixed stores: the cold kind's group size


class Journal:
    """Append-only log of durable work: 'R <index> <sha256>' and 'S <shard> <size> <sha256>'
    lines (journals of earlier versions lack the shard's sha256: it is computed again)."""

    def __init__(self, path: Path, fingerprint: str):
        self.path = path
        self.records: dict[int, str] = {}
        self.shards: dict[str, int] = {}
        self.shard_sha: dict[str, str] = {}
        if path.is_file():
            lines = path.read_text().splitlines()
            if lines and lines[0] == f"tiermoe-pack {fingerprint}":
                for line in lines[1:]:
                    parts = line.split()
                    if len(parts) == 3 and parts[0] == "R":
                        self.records[int(parts[1])] = parts[2]
                    elif len(parts) in (3, 4) and parts[0] == "S":
                        self.shards[parts[1]] = int(parts[2])
                        if len(parts) == 4:
                            self.shard_sha[parts[1]] = parts[3]
                self._f = open(path, "a")
                return
        self._f = open(path, "w")
        self._f.write(f"tiermoe-pack {fingerprint}\n")
        self._sync()

    def _sync(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())

    def add_records(self, done: list[tuple[int, str]]) -> None:
        for idx, sha in done:
            self._f.write(f"R {idx} {sha}\n")
            self.records[idx] = sha
        self._sync()

    def add_shard(self, name: str, size: int, sha: str) -> None:
        self._f.write(f"S {name} {size} {sha}\n")
        self.shards[name] = size
        self.shard_sha[name] = sha
        self._sync()

    def close(self) -> None:
        self._f.close()


def _fingerprint(ck: Checkpoint, plan: RecordPlan, shard_bytes: int, source: str | None = None) -> str:
    """What a resumed pack must share with the first run: the source (its directory, files, sizes
    and mtimes, or the caller's `source` description), the record layout and the shard size."""
    files = [(f, (ck.root / f).stat().st_size, (ck.root / f).stat().st_mtime_ns) for f in ck.files]
    src = source or [str(ck.root.resolve()), files]
    layouts = [lay.to_json() for lay in plan.layouts]
    which = hashlib.sha256(bytes(plan.layout_of)).hexdigest() if len(plan.layouts) > 1 else None
    blob = json.dumps([src, layouts[0] if which is None else [layouts, which], len(ck.experts), shard_bytes,
                       FORMAT_VERSION], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class _RecordFile:
    """experts.bin opened for aligned writes, O_DIRECT when the filesystem takes it."""

    def __init__(self, path: Path, size: int, want_direct: bool, notes: list[str]):
        self.path, self.notes = path, notes
        self.direct = False
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        os.ftruncate(fd, size)
        os.close(fd)
        if want_direct and O_DIRECT:
            try:
                self.fd = os.open(path, os.O_RDWR | O_DIRECT)
                self.direct = True
                return
            except OSError as exc:
                notes.append(f"O_DIRECT writes unavailable ({exc.strerror}); using buffered writes + fdatasync")
        self.fd = os.open(path, os.O_RDWR)

    def write(self, view: memoryview, offset: int) -> None:
        try:
            n = os.pwritev(self.fd, [view], offset)
        except OSError as exc:
            if self.direct and exc.errno == 22:  # EINVAL: filesystem refuses O_DIRECT after all
                self.notes.append("O_DIRECT write refused (EINVAL); using buffered writes + fdatasync")
                os.close(self.fd)
                self.fd, self.direct = os.open(self.path, os.O_RDWR), False
                return self.write(view, offset)
            raise UserError(f"{self.path}: write failed at offset {offset}: {exc.strerror}") from None
        if n != len(view):
            raise UserError(f"{self.path}: short write at offset {offset} ({n} of {len(view)} bytes; disk full?)")

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def close(self) -> None:
        os.fdatasync(self.fd)
        if not self.direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read-back must hit the disk
        os.close(self.fd)


def _write_records(ck, plan: RecordPlan, keys, todo, rf: _RecordFile, journal: Journal, bar, shas: dict[int, str],
                   device: torch.device | None = None) -> None:
    """Encode (main thread) and write + hash + journal (writer thread) the records in `todo`."""
    n_buf = 4
    free: queue.Queue = queue.Queue()
    for _ in range(n_buf):
        free.put(aligned_buffer(plan.entry_bytes))
    work: queue.Queue = queue.Queue(maxsize=n_buf)
    failure: list[BaseException] = []

    def writer() -> None:
        pending: list[tuple[int, str]] = []
        since_sync = 0
        while True:
            item = work.get()
            if item is None:
                break
            idx, buf = item
            try:
                if not failure:
                    length = plan.layout(idx).length
                    view = memoryview(buf.numpy())[:length]
                    sha = hashlib.sha256(view).hexdigest()
                    rf.write(view, plan.offsets[idx])
                    shas[idx] = sha
                    pending.append((idx, sha))
                    since_sync += length
                    bar.update(length)
                    if since_sync >= SYNC_BYTES:
                        rf.sync()
                        journal.add_records(pending)
                        pending, since_sync = [], 0
            except BaseException as exc:  # surfaced in the main thread
                failure.append(exc)
            finally:
                free.put(buf)
        if pending and not failure:
            rf.sync()
            journal.add_records(pending)

    t = threading.Thread(target=writer, name="tiermoe-pack-writer", daemon=True)
    t.start()
    try:
        for idx in todo:
            if failure:
                break
            layer, expert = keys[idx]
            gate, up, down = ck.load_expert(layer, expert)
            if device is not None:  # quantize on the GPU: same IEEE ops, same bits, much faster
                gate, up, down = (x.to(device, non_blocking=True) for x in (gate, up, down))
            buf = free.get()
            encode_expert(plan.layout(idx), gate, up, down, out=buf)
            work.put((idx, buf))
    finally:
        work.put(None)
        t.join()
    if failure:
        raise failure[0]


def _read_back(path: Path, infos: list[RecordInfo], direct: bool, threads: int = 8) -> list[RecordInfo]:
    """Re-read every record (O_DIRECT if possible); return the ones whose sha256 differs."""
    bad: list[RecordInfo] = []
    if not infos:
        return bad
    with DiskReader(path, direct=direct, threads=threads) as reader:
        bufs = [aligned_buffer(max(r.length for r in infos)) for _ in range(threads * 2)]
        window: list[tuple[RecordInfo, object]] = []
        for n, rec in enumerate(infos):
            if len(window) == len(bufs):
                r, fut = window.pop(0)
                if fut.result() != r.sha256:
                    bad.append(r)
            window.append((rec, reader.submit(rec, bufs[n % len(bufs)], check=False)))
        for r, fut in window:
            if fut.result() != r.sha256:
                bad.append(r)
    return bad


def _plan_shards(ck: Checkpoint, shard_bytes: int) -> list[list[tuple[str, str]]]:
    shards: list[list[tuple[str, str]]] = [[]]
    size = 0
    for file, key in ck.dense:
        sl = ck.handle(file).get_slice(key)
        n = 1
        for d in sl.get_shape():
            n *= d
        nbytes = n * itemsize(sl.get_dtype())
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((file, key))
        size += nbytes
    return [s for s in shards if s]


def _write_dense(ck: Checkpoint, out: Path, shard_bytes: int, journal: Journal, progress: bool) -> dict:
    """Stream non-expert tensors into ~shard_bytes safetensors shards (+ index json)."""
    plan = _plan_shards(ck, shard_bytes)
    total = len(plan)
    weight_map: dict[str, str] = {}
    total_size = 0
    names = []
    shas: dict[str, str] = {}
    for n, group in enumerate(tqdm(plan, desc="dense shards", unit="shard", disable=not progress or total == 0), 1):
        name = f"model-{n:05d}-of-{total:05d}.safetensors"
        names.append(name)
        path = out / name
        tensors = None
        if not (journal.shards.get(name) and path.is_file() and path.stat().st_size == journal.shards[name]):
            tensors = {key: ck.handle(file).get_tensor(key).contiguous() for file, key in group}
            tmp = out / (name + ".tmp")
            save_file(tensors, str(tmp), metadata={"format": "pt"})
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
            journal.add_shard(name, path.stat().st_size, file_sha256(path))
        elif name not in journal.shard_sha:  # journaled by an earlier version, without its hash
            journal.shard_sha[name] = file_sha256(path)
        shas[name] = journal.shard_sha[name]
        for file, key in group:
            weight_map[key] = name
            if tensors is not None:
                total_size += tensors[key].numel() * tensors[key].element_size()
        del tensors
    if total_size == 0 and weight_map:
        total_size = ck.dense_nbytes()
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (out / DENSE_INDEX).write_text(json.dumps(index, indent=1) + "\n")
    return {"index": DENSE_INDEX, "shards": names, "tensors": len(weight_map), "sha256": shas}


def file_sha256(path: Path) -> str:
    """Hex sha256 of a whole file (a dense shard just written: read back from the page cache)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(16 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check_space(out: Path, path: Path, need: int) -> None:
    """UserError up front instead of ENOSPC hours into a pack."""
    have = path.stat().st_size if path.exists() else 0
    for f in out.glob("model-*.safetensors"):
        have += f.stat().st_size
    free = shutil.disk_usage(out).free
    if need - have > free:
        raise UserError(f"{out}: needs {(need - have) / 2**30:.1f} GiB more disk space, {free / 2**30:.1f} GiB free")


def pack(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    quant: str = "bf16",
    group_size: int | None = None,
    shard_bytes: int = 2_000_000_000,
    direct_io: bool = True,
    progress: bool = True,
    log: Callable[[str], None] = print,
    device: str | None = "auto",
    source: str | None = None,
    cold_quant: str | None = None,
    cold_group_size: int | None = None,
    hot_share: float = DEFAULT_HOT_SHARE,
    expert_stats: str | os.PathLike | None = None,
) -> PackResult:
    """Pack checkpoint `src` into store directory `out` (see module docstring).

    `group_size` (int8/int4/int3): None picks the largest that divides the shapes, up to 128
    (int3: 64; pack_checks.PREFERRED_GROUP_SIZE).
    `device` runs the quantization there ("auto": CUDA when available, else CPU). int8/int4
    give bit-identical records either way (the same IEEE fp32 divide and round-half-even).
    int3's scale search (quant.py) is about 15x int4's work, so the GPU matters most there; it
    compares summed squared errors, and the devices sum in different orders, so a near-tie
    between two candidate scales may resolve differently: either record is a valid int3 record
    of the same weights, each checksummed as written.
    `source` stands for `src` in the resume fingerprint where `src` is itself a temporary
    conversion (a GGUF import): it names what the checkpoint was made from.
    `cold_quant` (with `expert_stats`) makes a mixed store: per layer, the most-picked experts
    holding `hot_share` of the picks stay `quant`, the rest are packed `cold_quant` (mixed.py).
    """
    if quant not in QUANT_KINDS:
        raise UserError(f"--quant {quant!r}: choose one of {', '.join(QUANT_KINDS)}")
    if not str(out).strip():  # Path("") is the working directory: an unset $OUT would pack into it
        raise UserError("OUT is empty: give the directory to write the store to")
    ck = Checkpoint(src)
    out = Path(out)
    if out.resolve() == ck.root.resolve():
        raise UserError(f"{out}: OUT must differ from SRC")
    if quant in INT_KINDS:
        group_size = choose_group_size(ck.hidden, ck.intermediate, group_size, quant)
    layout = RecordLayout.build(quant, ck.hidden, ck.intermediate, group_size)
    keys = ck.expert_keys()
    if cold_quant is None:
        plan = RecordPlan.uniform(layout, len(keys))
    else:
        if cold_quant not in QUANT_KINDS:
            raise UserError(f"--cold-quant {cold_quant!r}: choose one of {', '.join(QUANT_KINDS)}")
        check_cold_args(quant, cold_quant, None if expert_stats is None else str(expert_stats), hot_share)
        if cold_quant in INT_KINDS:
            cold_group_size = choose_group_size(ck.hidden, ck.intermediate, cold_group_size, cold_quant,
                                                flag="--cold-group-size")
        cold = RecordLayout.build(cold_quant, ck.hidden, ck.intermediate, cold_group_size)
        plan = mixed_plan(keys, ck.experts_per_layer, layout, cold, str(expert_stats), hot_share, log)
    fingerprint = _fingerprint(ck, plan, shard_bytes, source)
    check_target(out, fingerprint)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a parent that is a file, or one this user cannot write
        raise UserError(f"{out}: cannot create the store directory ({exc.strerror or exc})") from None
    lock = StoreLock.exclusive(out)
    if lock.unavailable:
        log(f"note: {lock.path} cannot be locked here ({lock.unavailable}): a process using this store would "
            "not be noticed")
    try:
        return _pack_locked(ck, out, plan, fingerprint, shard_bytes=shard_bytes, direct_io=direct_io,
                            progress=progress, log=log, device=device)
    finally:
        lock.release()
        ck.close()


def _pack_locked(ck: Checkpoint, out: Path, plan: RecordPlan, fingerprint: str, *, shard_bytes: int,
                 direct_io: bool, progress: bool, log: Callable[[str], None], device: str | None) -> PackResult:
    """The pack itself, with OUT checked and locked."""
    layout = plan.layouts[0]
    quant = layout.kind
    qdev = None
    if any(lay.bits for lay in plan.layouts) and device not in (None, "cpu"):
        if device == "auto":
            qdev = torch.device("cuda") if torch.cuda.is_available() else None
        else:
            qdev = torch.device(device)
    (out / MANIFEST_NAME).unlink(missing_ok=True)  # incomplete until rewritten at the end
    keys = ck.expert_keys()
    notes: list[str] = []
    journal = Journal(out / JOURNAL_NAME, fingerprint)
    shas = {i: s for i, s in journal.records.items() if i < len(keys)}
    todo = [i for i in range(len(keys)) if i not in shas]
    if shas:
        log(f"resuming: {len(shas)} of {len(keys)} records already written")
    path = out / EXPERTS_NAME
    _check_space(out, path, plan.total + ck.dense_nbytes())
    rf = _RecordFile(path, plan.total, direct_io, notes)
    bar = tqdm(total=plan.total, initial=sum(plan.layout(i).length for i in shas), unit="B", unit_scale=True,
               unit_divisor=1024, desc="experts", disable=not progress)
    try:
        _write_records(ck, plan, keys, todo, rf, journal, bar, shas, qdev)
    finally:
        bar.close()
        rf.close()
    read_direct = direct_io and probe_direct_io(path) is None
    if direct_io and not read_direct:
        notes.append("O_DIRECT reads unavailable; read-back used buffered reads after dropping the page cache")
    infos = _infos(plan, keys, shas)
    bad = _read_back(path, infos, read_direct)
    rewritten = len(bad)
    if bad:
        log(f"{len(bad)} record(s) failed read-back; rewriting them")
        rf = _RecordFile(path, plan.total, direct_io, notes)
        try:
            _write_records(ck, plan, keys, [r.index for r in bad], rf, journal, tqdm(disable=True), shas, qdev)
        finally:
            rf.close()
        infos = _infos(plan, keys, shas)
        still = _read_back(path, [infos[r.index] for r in bad], read_direct)
        if still:
            raise UserError(f"{path}: {still[0].name()} does not read back as written (failing disk?)")
    dense = _write_dense(ck, out, shard_bytes, journal, progress)
    journal.close()
    for p in ck.extra_files():
        shutil.copyfile(p, out / p.name)
    cfg = ck.config
    tc = text_config(cfg)
    manifest = {
        "format_version": FORMAT_VERSION,
        "model_config": cfg,
        "quantization": _quantization(plan),
        "dtype": dtype_name(FLOAT_KINDS[quant]) if quant in FLOAT_KINDS else dtype_name(ck.source_dtype),
        "source_dtype": dtype_name(ck.source_dtype),
        "num_layers": int(tc.get("num_hidden_layers", max(ck.layers) + 1)),
        "moe_layers": ck.layers,
        "experts_per_layer": {str(k): v for k, v in ck.experts_per_layer.items()},
        "expert_prefixes": {str(k): v for k, v in sorted(ck.prefixes.items())},
        "experts_file": EXPERTS_NAME,
        "record_align": 4096,
        "layouts": [lay.to_json() for lay in plan.layouts],
        "records": [
            {
                "layer": r.layer,
                "expert": r.expert,
                "offset": r.offset,
                "length": r.length,
                "sha256": r.sha256,
                "layout": r.layout,
            }
            for r in infos
        ],
        "dense": dense,
    }
    write_manifest(out, manifest)
    cold_group = plan.layouts[1].group_size if len(plan.layouts) > 1 else None
    return PackResult(out, len(keys), len(todo), rewritten, rf.direct, notes, layout.group_size, plan.counts(),
                      cold_group)


def _infos(plan: RecordPlan, keys: list[tuple[int, int]], shas: dict[int, str]) -> list[RecordInfo]:
    return [RecordInfo(i, l, e, plan.offsets[i], plan.layout(i).length, shas[i], plan.layout_of[i])
            for i, (l, e) in enumerate(keys)]


def _quantization(plan: RecordPlan) -> dict:
    """manifest["quantization"]: the kind (and for a mixed store the cold kind, the hot share and the
    statistics file that chose the hot experts)."""
    hot = plan.layouts[0]
    q = {"kind": hot.kind, "group_size": hot.group_size}
    if len(plan.layouts) > 1:
        cold = plan.layouts[1]
        q.update(cold_kind=cold.kind, cold_group_size=cold.group_size, hot_share=plan.hot_share,
                 expert_stats=plan.stats_name, records_per_layout=plan.counts())
    return q

