"""Packed expert stores of the tiny random checkpoints (tests/conftest.py's `tiny_dir`)."""

from __future__ import annotations

from pathlib import Path


def pack_tiny(tiny_dir, tmp_path_factory, arch: str, *, dtype: str = "float32", quant: str,
              **pack_options) -> tuple[Path, Path]:
    """Pack the tiny `arch` checkpoint of `dtype` into a fresh store with `quant` (extra options,
    e.g. group_size, go to tiermoe.store.pack.pack). Returns (checkpoint path, store path)."""
    from tiermoe.store.pack import pack

    src = tiny_dir(arch, dtype)
    out = tmp_path_factory.mktemp("store") / f"{arch}-{quant}"
    pack(str(src), str(out), quant=quant, progress=False, log=lambda _: None, **pack_options)
    return src, out
