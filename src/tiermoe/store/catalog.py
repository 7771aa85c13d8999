"""Find the routed experts of a Hugging Face checkpoint (expert -> source tensors).

Only names and shapes are read (safetensors headers); tensor data is fetched one expert at a
time through memory-mapped `safe_open` handles, so packing never holds a second copy of the
model in RAM. Recognised names (w1 = gate, w3 = up, w2 = down):

  <prefix>.layers.<L>.<mlp|block_sparse_moe>.experts.<E>.<gate_proj|up_proj|down_proj|w1|w3|w2>.weight
  <prefix>.layers.<L>.<mlp|block_sparse_moe>.experts.gate_up_proj   [E, 2I, H]  (fused, rows: gate then up)
  <prefix>.layers.<L>.<mlp|block_sparse_moe>.experts.down_proj      [E, H, I]

Shared experts, routers, score-correction biases and everything else are "dense" tensors.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tiermoe.errors import UserError

_PER_EXPERT = re.compile(
    r"^(?P<prefix>(?:.*\.)?layers)\.(?P<layer>\d+)\.(?P<block>mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
_FUSED = re.compile(
    r"^(?P<prefix>(?:.*\.)?layers)\.(?P<layer>\d+)\.(?P<block>mlp|block_sparse_moe)\.experts\."
    r"(?P<proj>gate_up_proj|down_proj)(?:\.weight)?$"
)
_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_SRC_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_COPY_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template*",
)


@dataclass(frozen=True)
class TensorRef:
    """Where one expert's projection lives: a tensor, optionally one expert / row range of it."""

    file: str
    key: str
    expert: int | None = None  # index into dim 0 of a fused [E, ...] tensor
    rows: tuple[int, int] | None = None  # row range inside the (per-expert) matrix


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a (possibly multimodal) config."""
    tc = config.get("text_config")
    return tc if isinstance(tc, dict) and "hidden_size" in tc else config


class Checkpoint:
    """A Hugging Face checkpoint directory, indexed by routed expert."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        cfg_path = self.root / "config.json"
        if not self.root.is_dir():
            raise UserError(f"{self.root}: not a directory")
        if not cfg_path.is_file():
            raise UserError(f"{cfg_path}: not found (SRC must be a Hugging Face checkpoint directory)")
        try:
            self.config: dict[str, Any] = json.loads(cfg_path.read_text())
        except ValueError as exc:
            raise UserError(f"{cfg_path}: invalid JSON ({exc})") from None
        self.files = self._weight_files()
        self._handles: dict[str, Any] = {}
        self.dense: list[tuple[str, str]] = []  # (file, key) of every non-expert tensor
        self.experts: dict[tuple[int, int], dict[str, TensorRef]] = {}
        self.prefixes: dict[int, str] = {}  # layer -> "<prefix>.<L>.<block>.experts"
        self.source_dtype: torch.dtype | None = None
        self.hidden = self.intermediate = 0
        self._scan()

    def _weight_files(self) -> list[str]:
        index = self.root / "model.safetensors.index.json"
        if index.is_file():
            try:
                names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, AttributeError) as exc:
                raise UserError(f"{index}: malformed index ({exc!r})") from None
            for n in names:
                if not (self.root / n).is_file():
                    raise UserError(f"{self.root / n}: listed in {index.name} but missing")
            return names
        names = sorted(p.name for p in self.root.glob("*.safetensors"))
        if not names:
            raise UserError(f"{self.root}: no *.safetensors files")
        return names

    def handle(self, file: str):
        h = self._handles.get(file)
        if h is None:
            try:
                h = safe_open(str(self.root / file), framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise UserError(f"{self.root / file}: unreadable safetensors file ({exc})") from None
            self._handles[file] = h
        return h

    def _note_dtype(self, key: str, dt: str) -> None:
        if dt not in _SRC_DTYPES:
            raise UserError(
                f"{key}: unsupported dtype {dt} for a routed expert (only BF16, F16 and F32 checkpoints can be packed)"
            )
        t = _SRC_DTYPES[dt]
        if self.source_dtype is None:
            self.source_dtype = t
        elif self.source_dtype != t:
            raise UserError(f"{key}: dtype {dt} differs from other experts ({self.source_dtype})")

    def _set_prefix(self, layer: int, prefix: str, key: str) -> None:
        old = self.prefixes.setdefault(layer, prefix)
        if old != prefix:
            raise UserError(f"{key}: layer {layer} has experts under two prefixes ({old}, {prefix})")

    def _scan(self) -> None:
        seen: set[str] = set()
        fused: dict[int, dict[str, tuple[str, str, list[int]]]] = {}
        for file in self.files:
            h = self.handle(file)
            for key in h.keys():
                if key in seen:
                    raise UserError(f"{key}: present in more than one file of {self.root}")
                seen.add(key)
                m = _PER_EXPERT.match(key)
                if m:
                    layer, expert = int(m["layer"]), int(m["expert"])
                    self._note_dtype(key, h.get_slice(key).get_dtype())
                    self._set_prefix(layer, f"{m['prefix']}.{layer}.{m['block']}.experts", key)
                    self.experts.setdefault((layer, expert), {})[_PROJ[m["proj"]]] = TensorRef(file, key)
                    continue
                m = _FUSED.match(key)
                if m:
                    layer = int(m["layer"])
                    sl = h.get_slice(key)
                    self._note_dtype(key, sl.get_dtype())
                    self._set_prefix(layer, f"{m['prefix']}.{layer}.{m['block']}.experts", key)
                    fused.setdefault(layer, {})[m["proj"]] = (file, key, list(sl.get_shape()))
                    continue
                self.dense.append((file, key))
        for layer, parts in fused.items():
            self._add_fused(layer, parts)
        if not self.experts:
            raise UserError(
                f"{self.root}: no routed expert tensors found "
                "(expected names like model.layers.N.mlp.experts.E.gate_proj.weight)"
            )
        self._check_shapes()

    def _add_fused(self, layer: int, parts: dict[str, tuple[str, str, list[int]]]) -> None:
        if set(parts) != {"gate_up_proj", "down_proj"}:
            key = next(iter(parts.values()))[1]
            raise UserError(f"{key}: fused experts need both gate_up_proj and down_proj in layer {layer}")
        (f_gu, k_gu, s_gu), (f_d, k_d, s_d) = parts["gate_up_proj"], parts["down_proj"]
        # Expected [E, 2I, H] and [E, H, I]; transposed layouts (e.g. [E, H, 2I]) are refused.
        if len(s_gu) != 3 or len(s_d) != 3 or s_gu[0] != s_d[0] or s_gu[1] != 2 * s_d[2] or s_gu[2] != s_d[1]:
            raise UserError(f"{k_gu}: fused expert shapes {s_gu} / {s_d} are not [E, 2I, H] / [E, H, I]")
        i = s_d[2]
        for e in range(s_gu[0]):
            self.experts[(layer, e)] = {
                "gate": TensorRef(f_gu, k_gu, e, (0, i)),
                "up": TensorRef(f_gu, k_gu, e, (i, 2 * i)),
                "down": TensorRef(f_d, k_d, e, None),
            }

    def _shape(self, ref: TensorRef) -> tuple[int, int]:
        shape = self.handle(ref.file).get_slice(ref.key).get_shape()
        if ref.expert is not None:
            shape = shape[1:]
        if ref.rows is not None:
            shape = [ref.rows[1] - ref.rows[0], shape[1]]
        return tuple(shape)

    def _check_shapes(self) -> None:
        for layer in self.layers:
            n = self.experts_per_layer[layer]
            for e in range(n):
                parts = self.experts.get((layer, e))
                if parts is None:
                    raise UserError(f"{self.prefixes[layer]}: expert {e} missing (experts must be numbered 0..{n - 1})")
                missing = {"gate", "up", "down"} - set(parts)
                if missing:
                    raise UserError(f"{self.prefixes[layer]}.{e}: missing {', '.join(sorted(missing))} projection")
        first = self.experts[min(self.experts)]
        gate_shape = self._shape(first["gate"])
        self.intermediate, self.hidden = gate_shape
        want = {"gate": gate_shape, "up": gate_shape, "down": (self.hidden, self.intermediate)}
        for (layer, e), parts in self.experts.items():
            for proj, ref in parts.items():
                if ref.expert is not None and ref.expert > 0:
                    continue  # fused tensors were checked as a whole
                if self._shape(ref) != want[proj]:
                    raise UserError(
                        f"{ref.key}: shape {self._shape(ref)} differs from {want[proj]} (all experts must match)"
                    )

    @property
    def layers(self) -> list[int]:
        return sorted({layer for layer, _ in self.experts})

    @property
    def experts_per_layer(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for layer, e in self.experts:
            out[layer] = max(out.get(layer, 0), e + 1)
        return out

    def expert_keys(self) -> list[tuple[int, int]]:
        """Every (layer, expert), layer-major: the record order of experts.bin."""
        return sorted(self.experts)

    def load(self, ref: TensorRef) -> torch.Tensor:
        sl = self.handle(ref.file).get_slice(ref.key)
        if ref.expert is None:
            t = sl[:]
        elif ref.rows is None:
            t = sl[ref.expert]
        else:
            t = sl[ref.expert : ref.expert + 1, ref.rows[0] : ref.rows[1]][0]
        return t

    def load_expert(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [I, H], up [I, H], down [H, I]) in the checkpoint's dtype."""
        parts = self.experts[(layer, expert)]
        return self.load(parts["gate"]), self.load(parts["up"]), self.load(parts["down"])

    def dense_nbytes(self) -> int:
        total = 0
        for file, key in self.dense:
            sl = self.handle(file).get_slice(key)
            n = 1
            for d in sl.get_shape():
                n *= d
            total += n * itemsize(sl.get_dtype())
        return total

    def extra_files(self) -> list[Path]:
        """Config, tokenizer and chat-template files to copy next to the store."""
        out: dict[str, Path] = {}
        for pat in _COPY_PATTERNS:
            for p in self.root.glob(pat):
                if p.is_file():
                    out[p.name] = p
        return [out[k] for k in sorted(out)]

    def close(self) -> None:
        self._handles.clear()


def itemsize(dt: str) -> int:
    """Bytes per element of a safetensors dtype string."""
    sizes = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}
    return sizes.get(dt, 1)
