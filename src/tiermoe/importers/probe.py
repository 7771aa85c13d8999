"""The expert shapes a GGUF file imports to, read from its first metadata keys (no torch).

`tiermoe pack model.gguf --quant int4` needs the hidden size and the routed experts' width to
check (or pick) a group size; importing the file first took most of a minute before a wrong
group size was reported, and gguf's GGUFReader parses every key (the tokenizer's vocabulary
too: 4 s for SmolLM2). The keys needed here come first in files written by llama.cpp, so this
reads the key-value header only until it has them (GGUF v2/v3 layout, little-endian).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

from tiermoe.importers.moeify import plan_experts

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def gguf_expert_shape(path: str | Path, experts_per_layer: int = 8) -> tuple[int, int] | None:
    """(hidden size, routed expert intermediate size) of the checkpoint `gguf_to_hf` writes from
    `path` with these options; None when the header does not say (the import reports it later)."""
    try:
        with open(path, "rb") as f:
            meta = _read_keys(f)
        arch = meta["general.architecture"]
        hidden = int(meta[f"{arch}.embedding_length"])
        if arch == "qwen3moe":
            return hidden, int(meta[f"{arch}.expert_feed_forward_length"])
        ffn = int(meta[f"{arch}.feed_forward_length"])
        return hidden, plan_experts(ffn, experts_per_layer, source=str(path)).slice_size
    except Exception:  # an unreadable or unusual file: the import names the problem itself
        return None


def _read_keys(f: BinaryIO) -> dict:
    """Scalar and string keys of the header, until the architecture's shape keys are in."""
    magic, version = f.read(4), struct.unpack("<I", f.read(4))[0]
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError("not a GGUF v2/v3 file")
    _, kv_count = struct.unpack("<QQ", f.read(16))
    meta: dict = {}
    for _ in range(kv_count):
        key = _string(f)
        meta[key] = _value(f, struct.unpack("<I", f.read(4))[0])
        arch = meta.get("general.architecture")
        width = "expert_feed_forward_length" if arch == "qwen3moe" else "feed_forward_length"
        if arch and f"{arch}.embedding_length" in meta and f"{arch}.{width}" in meta:
            break
    return meta


def _string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", "replace")


def _value(f: BinaryIO, kind: int):
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        elem, count = struct.unpack("<IQ", f.read(12))
        items = [_value(f, elem) for _ in range(count)]
        return items[0] if items and elem != _STRING and len(set(items)) == 1 else items
    fmt = _SCALARS[kind]
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
