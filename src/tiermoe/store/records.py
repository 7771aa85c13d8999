"""On-disk expert record format and the manifest that indexes it (docs/store-format.md).

One routed expert = one record = exactly the bytes a GPU slot holds, so moving an expert
between tiers is a single contiguous copy and decoding is a view:

  float stores (bf16/fp16/fp32):  gate_up [2I, H] | down [H, I]
  int8 / int4 / int3 stores:      gate_up_q | gate_up_s | down_q | down_s   (see quant.py)

Every section starts 256-byte aligned inside the record, the record length is padded to a
multiple of 4096, and records sit at 4096-aligned offsets of experts.bin, which is what
O_DIRECT needs. The manifest lists the store's `RecordLayout`s once under "layouts" and each
record refers to its own by index: one layout for a store of one kind, two for a mixed store
(`pack --cold-quant`: the most-picked experts in the first layout's kind, the rest in the
second's). Records then differ in length; a tier entry (a GPU slot, a host RAM entry) holds the
longest, `Manifest.record_bytes`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tiermoe.errors import UserError
from tiermoe.store.quant import dequantize_groupwise, packed_cols, quantize_groupwise

FORMAT_VERSION = 1
RECORD_ALIGN = 4096
SECTION_ALIGN = 256
MANIFEST_NAME = "manifest.json"
EXPERTS_NAME = "experts.bin"

FLOAT_KINDS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
INT_KINDS = {"int8": 8, "int4": 4, "int3": 3}
QUANT_KINDS = tuple(FLOAT_KINDS) + tuple(INT_KINDS)

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"dtype {dtype} has no store name")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r}") from None


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Section:
    name: str
    offset: int  # bytes from the record start, SECTION_ALIGN-aligned
    shape: tuple[int, ...]
    dtype: str  # a key of _DTYPES

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * dtype_from_name(self.dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "offset": self.offset, "shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class RecordLayout:
    """Byte layout shared by every record of a store."""

    kind: str  # one of QUANT_KINDS
    hidden: int  # H
    intermediate: int  # I
    group_size: int | None  # int kinds only
    sections: tuple[Section, ...]
    length: int  # padded record length, multiple of RECORD_ALIGN

    @classmethod
    def build(cls, kind: str, hidden: int, intermediate: int, group_size: int | None = None) -> "RecordLayout":
        h, i = hidden, intermediate
        if kind in FLOAT_KINDS:
            dt = dtype_name(FLOAT_KINDS[kind])
            specs = [("gate_up", (2 * i, h), dt), ("down", (h, i), dt)]
            group_size = None
        elif kind in INT_KINDS:
            bits = INT_KINDS[kind]
            if not group_size or group_size % 2:
                raise UserError(f"--group-size must be a positive even number, got {group_size}")
            for name, k in (("hidden_size", h), ("moe intermediate size", i)):
                if k % group_size:
                    raise UserError(f"{name} {k} is not a multiple of --group-size {group_size}")
                if bits == 3 and k % 8:
                    raise UserError(f"--quant int3 needs a {name} that is a multiple of 8, got {k}")
            qdt = "int8" if bits == 8 else "uint8"
            specs = [
                ("gate_up_q", (2 * i, packed_cols(h, bits)), qdt),
                ("gate_up_s", (2 * i, h // group_size), "bfloat16"),
                ("down_q", (h, packed_cols(i, bits)), qdt),
                ("down_s", (h, i // group_size), "bfloat16"),
            ]
        else:
            raise UserError(f"unknown quantization {kind!r}; choose one of {', '.join(QUANT_KINDS)}")
        sections, off = [], 0
        for name, shape, dt in specs:
            off = align_up(off, SECTION_ALIGN)
            s = Section(name, off, shape, dt)
            sections.append(s)
            off += s.nbytes
        return cls(kind, h, i, group_size, tuple(sections), align_up(off, RECORD_ALIGN))

    @property
    def bits(self) -> int | None:
        return INT_KINDS.get(self.kind)

    def section(self, name: str) -> Section:
        for s in self.sections:
            if s.name == name:
                return s
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "hidden": self.hidden,
            "intermediate": self.intermediate,
            "group_size": self.group_size,
            "length": self.length,
            "sections": [s.to_json() for s in self.sections],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RecordLayout":
        built = cls.build(d["kind"], int(d["hidden"]), int(d["intermediate"]), d.get("group_size"))
        stored = tuple(Section(s["name"], int(s["offset"]), tuple(s["shape"]), s["dtype"]) for s in d["sections"])
        if stored != built.sections or int(d["length"]) != built.length:
            raise UserError("manifest.json: record layout does not match this version's format rules")
        return built


def _as_u8(buf: Any) -> torch.Tensor:
    """A flat uint8 torch view of a record buffer (torch tensor, numpy array or bytes-like)."""
    if isinstance(buf, torch.Tensor):
        return buf.view(torch.uint8).reshape(-1)
    if isinstance(buf, np.ndarray):
        return torch.from_numpy(buf.view(np.uint8).reshape(-1))
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8)


def section_view(layout: RecordLayout, buf: Any, name: str) -> torch.Tensor:
    """A typed view (no copy) of one section of a record buffer."""
    s = layout.section(name)
    u8 = _as_u8(buf)
    return u8[s.offset : s.offset + s.nbytes].view(dtype_from_name(s.dtype)).view(s.shape)


def encode_expert(
    layout: RecordLayout, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Encode gate [I, H], up [I, H], down [H, I] into one record (uint8 [layout.length]).

    `out` may be a caller-provided (e.g. aligned) uint8 buffer of at least layout.length bytes.
    Padding bytes are zero, so a record's sha256 depends only on the weights.
    """
    h, i = layout.hidden, layout.intermediate
    for name, t, shape in (("gate", gate, (i, h)), ("up", up, (i, h)), ("down", down, (h, i))):
        if tuple(t.shape) != shape:
            raise UserError(f"expert {name} has shape {tuple(t.shape)}, expected {shape}")
    if out is None:
        rec = torch.zeros(layout.length, dtype=torch.uint8)
    else:
        rec = out.view(torch.uint8).reshape(-1)[: layout.length]
    if out is not None:
        rec.zero_()
    if layout.kind in FLOAT_KINDS:
        dt = FLOAT_KINDS[layout.kind]
        gu = section_view(layout, rec, "gate_up")  # [2I, H]
        gu[:i].copy_(gate.to(dt))
        gu[i:].copy_(up.to(dt))
        section_view(layout, rec, "down").copy_(down.to(dt))  # [H, I]
    else:
        bits, g = layout.bits, layout.group_size
        gate_up = torch.cat((gate, up), dim=0)  # [2I, H]
        for prefix, w in (("gate_up", gate_up), ("down", down)):
            q, s = quantize_groupwise(w, bits, g)
            section_view(layout, rec, prefix + "_q").copy_(q)
            section_view(layout, rec, prefix + "_s").copy_(s)
    return rec


def decode_record(
    layout: RecordLayout, buf: Any, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Record bytes -> (gate_up [2I, H], down [H, I]) in `dtype`.

    Float stores return views into `buf` when `dtype` is the stored dtype (one contiguous copy
    otherwise); int stores dequantize (quant.dequantize_groupwise) into fresh tensors.
    """
    if layout.kind in FLOAT_KINDS:
        stored = FLOAT_KINDS[layout.kind]
        gu, dn = section_view(layout, buf, "gate_up"), section_view(layout, buf, "down")
        if dtype is None or dtype == stored:
            return gu, dn
        return gu.to(dtype), dn.to(dtype)
    dtype = dtype or torch.bfloat16
    bits, g = layout.bits, layout.group_size
    gu = dequantize_groupwise(
        section_view(layout, buf, "gate_up_q"), section_view(layout, buf, "gate_up_s"), bits, g, dtype
    )
    dn = dequantize_groupwise(section_view(layout, buf, "down_q"), section_view(layout, buf, "down_s"), bits, g, dtype)
    return gu, dn


@dataclass(frozen=True)
class RecordInfo:
    index: int  # position in manifest["records"] (layer-major, expert-minor)
    layer: int
    expert: int
    offset: int
    length: int
    sha256: str
    layout: int

    def name(self) -> str:
        return f"layer {self.layer} expert {self.expert} (offset {self.offset})"


class Manifest:
    """Parsed manifest.json with record look-ups; `data` is the raw JSON object."""

    def __init__(self, data: dict[str, Any], root: Path):
        self.data = data
        self.root = root
        self.layouts = [RecordLayout.from_json(d) for d in data["layouts"]]
        self.records = [
            RecordInfo(
                n,
                int(r["layer"]),
                int(r["expert"]),
                int(r["offset"]),
                int(r["length"]),
                r["sha256"],
                int(r.get("layout", 0)),
            )
            for n, r in enumerate(data["records"])
        ]
        self._by_key = {(r.layer, r.expert): r for r in self.records}
        self.moe_layers: list[int] = [int(x) for x in data["moe_layers"]]
        self.experts_per_layer: dict[int, int] = {int(k): int(v) for k, v in data["experts_per_layer"].items()}

    @property
    def config(self) -> dict[str, Any]:
        return self.data["model_config"]

    @property
    def layout(self) -> RecordLayout:
        """The first layout: every record's in a store of one kind, the hot experts' in a mixed one."""
        return self.layouts[0]

    @property
    def mixed(self) -> bool:
        """True when records use more than one layout (pack --cold-quant)."""
        return len(self.layouts) > 1

    @property
    def record_bytes(self) -> int:
        """Bytes of a tier entry: the longest record layout."""
        return max(lay.length for lay in self.layouts)

    def layout_of(self, rec: RecordInfo) -> RecordLayout:
        return self.layouts[rec.layout]

    def layout_ids(self, layer: int) -> list[int]:
        """Layout index of each routed expert of `layer`, in expert-id order (0 for all but the cold
        experts of a mixed store)."""
        return [self._by_key[(layer, e)].layout for e in range(self.experts_per_layer[layer])]

    @property
    def experts_path(self) -> Path:
        return self.root / self.data.get("experts_file", EXPERTS_NAME)

    @property
    def dtype(self) -> torch.dtype:
        return dtype_from_name(self.data["dtype"])

    def record(self, layer: int, expert: int) -> RecordInfo:
        try:
            return self._by_key[(layer, expert)]
        except KeyError:
            raise KeyError(f"no record for layer {layer} expert {expert}") from None

    def index(self, layer: int, expert: int) -> int:
        return self.record(layer, expert).index


def write_manifest(root: Path, data: dict[str, Any]) -> None:
    """Atomically write manifest.json (temp file + fsync + rename)."""
    tmp = root / (MANIFEST_NAME + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / MANIFEST_NAME)


def load_manifest(root: str | os.PathLike) -> Manifest:
    """Load and sanity-check OUT/manifest.json; UserError (one line) if it is absent or invalid."""
    root = Path(root)
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise UserError(f"{path}: not found (is {root} a store written by `tiermoe pack`?)")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: unreadable JSON ({exc})") from None
    if not isinstance(data, dict):  # a list or a number has no fields to check: say so, not AttributeError
        raise UserError(f"{path}: expected a JSON object (the store's manifest), got {type(data).__name__}")
    if data.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path}: format_version {data.get('format_version')!r}, this build reads {FORMAT_VERSION}")
    try:
        m = Manifest(data, root)
        if not isinstance(m.config, dict):
            raise TypeError(f"model_config is a {type(m.config).__name__}, not an object")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UserError(f"{path}: malformed manifest ({exc!r})") from None
    return m


def check_experts_file(m: Manifest) -> None:
    """UserError if experts.bin is missing or shorter than the records the manifest lists."""
    p = m.experts_path
    if not p.is_file():
        raise UserError(f"{p}: expert record file not found")
    need = max((r.offset + r.length for r in m.records), default=0)
    size = p.stat().st_size
    if size < need:
        raise UserError(f"{p}: truncated ({size} bytes, manifest needs {need})")
