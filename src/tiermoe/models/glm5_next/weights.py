"""Memory-mapped safetensors access by Hugging Face checkpoint key.

A checkpoint directory holds `model.safetensors` or shards listed in
`model.safetensors.index.json`. Tensors are returned as views over a copy-on-write mmap of the
file, so opening a 300B checkpoint costs nothing until a tensor's pages are touched, and the
expert store can read single experts without loading a layer. Every lookup failure is a
one-line `UserError` naming the file and the key.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

from tiermoe.errors import UserError

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class _File:
    """One safetensors file: parsed header plus a lazily created mmap."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{path}: not a readable safetensors file ({e.__class__.__name__})") from None
        header.pop("__metadata__", None)
        self.entries = header
        self.data_start = 8 + n
        self._mm: mmap.mmap | None = None

    def tensor(self, key: str) -> torch.Tensor:
        meta = self.entries[key]
        dtype = _DTYPES.get(meta["dtype"])
        if dtype is None:
            raise UserError(f"{self.path}: tensor '{key}' has unsupported dtype {meta['dtype']}")
        begin, end = meta["data_offsets"]
        shape = tuple(meta["shape"])
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        if self._mm is None:
            with open(self.path, "rb") as f:
                # ACCESS_COPY: writable (torch.frombuffer wants that) but never writes the file.
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        count = (end - begin) // torch.empty((), dtype=dtype).element_size()
        flat = torch.frombuffer(self._mm, dtype=dtype, count=count, offset=self.data_start + begin)
        return flat.view(shape)


class Checkpoint:
    """Key -> tensor lookup over all safetensors files of a checkpoint directory."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        self._files: dict[str, _File] = {}
        self._where: dict[str, str] = {}
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError) as e:
                raise UserError(f"{index}: unreadable weight_map ({e.__class__.__name__})") from None
            self.source = index
            self._where = dict(weight_map)
        else:
            shards = sorted(self.dir.glob("*.safetensors"))
            if not shards:
                raise UserError(f"{self.dir}: no *.safetensors files")
            self.source = shards[0] if len(shards) == 1 else self.dir
            for p in shards:
                for k in self._file(p.name).entries:
                    self._where[k] = p.name

    def _file(self, name: str) -> _File:
        f = self._files.get(name)
        if f is None:
            p = self.dir / name
            if not p.exists():
                raise UserError(f"{p}: listed in {self.source.name} but missing")
            f = self._files[name] = _File(p)
        return f

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def file_of(self, key: str) -> Path:
        """The shard that holds `key` (for error messages and packers)."""
        return self.dir / self._where[key]

    def get(self, key: str) -> torch.Tensor:
        """The tensor stored under `key` as an mmap view; UserError naming file and key if absent."""
        name = self._where.get(key)
        if name is None:
            raise UserError(f"{self.source}: missing tensor '{key}'")
        f = self._file(name)
        if key not in f.entries:
            raise UserError(f"{f.path}: missing tensor '{key}' (listed in {self.source.name})")
        return f.tensor(key)

    def first(self, *candidates: str) -> torch.Tensor:
        """The first present key among `candidates`; the error names the first (canonical) one."""
        for k in candidates:
            if k in self._where:
                return self.get(k)
        raise UserError(f"{self.source}: missing tensor '{candidates[0]}'")
