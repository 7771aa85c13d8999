"""GGUF -> Hugging Face checkpoint directory of a family the engine serves.

Many users hold models as GGUF files (llama.cpp's format). The engine loads Hugging Face
checkpoint directories (config.json + safetensors + tokenizer files), so a GGUF is imported
once: every tensor is dequantised with the `gguf` package to float32, renamed to the HF key,
cast to the requested dtype (bf16 by default) and streamed into safetensors shards; the
tokenizer and its chat template are rebuilt by transformers from the GGUF metadata.

Families (see families.py):
  - dense `llama`, `qwen2`, `qwen3` -> `glm4_moe`, each MLP cut into experts (moeify.py) so the
    converted model with all experts routed computes what the dense one does;
  - `qwen3moe` -> `qwen3_moe`, a direct rename (experts un-stacked per expert).

Pitfall: llama.cpp's converter permutes the rows of Q and K of `llama` models (it rotates
interleaved pairs where HF rotates halves); we undo that exactly as transformers' GGUF loader
does. Qwen models use the half-rotation already and are not permuted.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tiermoe.errors import UserError
from tiermoe.importers import CONVERTER_VERSION

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_MISSING = object()
# llama.cpp's recommended-sampling metadata -> the generation_config.json field of the same meaning
_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                  "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
                  "general.sampling.penalty_repeat": "repetition_penalty"}


def parse_dtype(dtype: str) -> torch.dtype:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise UserError(f"dtype '{dtype}' is not one of {', '.join(sorted(set(_DTYPES)))}") from None


class GGUFFile:
    """Metadata and dequantising tensor access for one GGUF file; tracks which tensors were used.

    Tensors come back as float32 torch tensors in HF orientation ([out, in] for matrices,
    [E, out, in] for stacked experts), because numpy's row order of a GGUF tensor is the reverse
    of its ggml dims, which is already PyTorch's order.
    """

    def __init__(self, path: str | Path):
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(f"{self.path}: no such GGUF file")
        try:
            self.reader = GGUFReader(str(self.path))
        except (ValueError, OSError) as exc:
            raise UserError(f"{self.path}: not a readable GGUF file ({exc})") from None
        self._tensors = {t.name: t for t in self.reader.tensors}
        self._used: set[str] = set()
        self.arch = str(self.get("general.architecture", ""))

    # -- metadata -------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def get(self, key: str, default: Any = _MISSING) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise UserError(f"{self.path}: GGUF field '{key}' is missing")
            return default
        value = field.contents()
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        return value

    def arch_get(self, suffix: str, default: Any = _MISSING) -> Any:
        """`{arch}.{suffix}`, e.g. arch_get('block_count') reads 'llama.block_count'."""
        return self.get(f"{self.arch}.{suffix}", default)

    def arch_int(self, suffix: str, default: Any = _MISSING) -> int:
        value = self.arch_get(suffix, default)
        if isinstance(value, list):  # per-layer arrays (e.g. variable kv heads) are not supported
            if len(set(value)) != 1:
                raise UserError(f"{self.path}: GGUF field '{self.arch}.{suffix}' varies per layer; unsupported")
            value = value[0]
        return int(value)

    # -- tensors --------------------------------------------------------------------------
    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> torch.Tensor:
        """Dequantised float32 copy of a tensor; marks it used."""
        from gguf.quants import dequantize

        t = self._tensors.get(name)
        if t is None:
            raise UserError(f"{self.path}: GGUF tensor '{name}' is missing")
        try:
            arr = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise UserError(
                f"{self.path}: tensor '{name}' has quantisation {t.tensor_type.name}, which cannot be dequantised"
            ) from None
        self._used.add(name)
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if not arr.flags.writeable:  # plain F32 tensors are views of the read-only memory map
            arr = arr.copy()
        return torch.from_numpy(arr)

    def unused_tensors(self) -> list[str]:
        return [n for n in self._tensors if n not in self._used]

    def expert_source_types(self) -> dict[str, int]:
        """{GGML type name: tensors} of the MLP weights that become routed experts (the stacked
        `ffn_*_exps` of a MoE file, else the dense `ffn_gate/up/down`). What `tiermoe pack` tells
        the user about re-quantizing them: Q3_K sub-blocks fit --quant int3 --group-size 16."""
        import re

        pat = re.compile(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight")
        names = [n for n in self._tensors if pat.fullmatch(n)]
        if not names:
            names = [n for n in self._tensors if re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)\.weight", n)]
        counts: dict[str, int] = {}
        for n in names:
            kind = self._tensors[n].tensor_type.name
            counts[kind] = counts.get(kind, 0) + 1
        return counts


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (same as transformers' `_reverse_permute_weights`).

    llama.cpp stores, per head, rows in the order (pairs, 2); HF stores (2, pairs). Works on
    weights [n_head * d, H] and biases [n_head * d].
    """
    d = w.shape[0] // n_head // 2
    return w.reshape(n_head, d, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's forward permutation (HF -> GGUF); the inverse of `unpermute_qk`."""
    d = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, d, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def export_tokenizer(g: GGUFFile, out_dir: Path, context_length: int | None) -> dict | None:
    """Rebuild the tokenizer (and chat template) from GGUF metadata; None if the file has none."""
    if not g.has("tokenizer.ggml.model"):
        return None
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(g.path.parent), gguf_file=g.path.name)
    except Exception as exc:  # transformers raises many types for unsupported vocabularies
        model = g.get("tokenizer.ggml.model", "?")
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{g.path}: tokenizer.ggml.model '{model}' could not be converted ({msg})") from None
    if context_length:
        tok.model_max_length = context_length
    tok.save_pretrained(str(out_dir))
    ids = {
        key: g.get(f"tokenizer.ggml.{key}", None)
        for key in ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id")
    }
    return {
        "bos_token_id": ids["bos_token_id"],
        "eos_token_id": ids["eos_token_id"],
        "pad_token_id": ids["padding_token_id"],
        "has_chat_template": bool(getattr(tok, "chat_template", None)),
    }


def gguf_to_hf(
    gguf_path: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "bfloat16",
    experts_per_layer: int = 8,
    top_k: int | None = None,
    shared_slices: int | None = None,
    generation: dict | None = None,
) -> Path:
    """Convert a GGUF file into a Hugging Face checkpoint directory at `out_dir`; returns it.

    Dense llama/qwen2/qwen3 become glm4_moe with `experts_per_layer` routed experts per layer
    (plus a shared expert of `shared_slices` slices, chosen automatically when None) and
    `top_k` routed experts per token (None: all, which reproduces the dense model exactly; a
    smaller value calibrates a router, see router_fit.py). qwen3moe becomes qwen3_moe; there
    `top_k` overrides the file's experts-per-token and the other two options are ignored.

    generation_config.json holds the token ids, the file's recommended sampling
    (`general.sampling.*`, which `tiermoe serve` applies to requests that leave it out) and
    `generation` on top (the embedded default model's, from its model card).

    The directory is built under a temporary name next to `out_dir` and renamed into place
    when complete, so an interrupted conversion never leaves a half-written checkpoint there.
    Raises UserError for unsupported architectures or tensors and for an existing non-empty
    `out_dir`.
    """
    from tiermoe.importers import families

    out_dir = Path(out_dir)
    torch_dtype = parse_dtype(dtype)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"{out_dir}: output directory exists and is not empty")
    g = GGUFFile(gguf_path)
    convert = families.CONVERTERS.get(g.arch)
    if convert is None:
        raise UserError(
            f"{g.path}: general.architecture '{g.arch}' is not supported"
            f" (supported: {', '.join(sorted(families.CONVERTERS))})"
        )
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    except OSError as exc:
        raise UserError(f"{out_dir}: cannot create the output directory ({exc.strerror or exc})") from None
    try:
        t0 = time.monotonic()
        context = g.arch_int("context_length", 0) or None
        tok_info = export_tokenizer(g, tmp, context)
        result = convert(
            g,
            tmp,
            torch_dtype=torch_dtype,
            experts_per_layer=experts_per_layer,
            top_k=top_k,
            shared_slices=shared_slices,
        )
        config = result.config
        if tok_info:
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                if tok_info[key] is not None:
                    config[key] = int(tok_info[key])
        config["dtype"] = str(torch_dtype).removeprefix("torch.")
        _write_json(tmp / "config.json", config)
        gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
        gen.update({hf: int(g.get(key)) if hf == "top_k" else round(float(g.get(key)), 6)  # stored as float32
                    for key, hf in _SAMPLING_KEYS.items() if g.has(key)})
        gen.update(generation or {})
        if gen:
            _write_json(tmp / "generation_config.json", gen)
        if result.finish is not None:  # e.g. router calibration, needs the whole directory
            result.finish(tmp, result.provenance)
        result.provenance.update(
            {
                "converter_version": CONVERTER_VERSION,
                "source": str(g.path.resolve()),
                "source_bytes": g.path.stat().st_size,
                "source_architecture": g.arch,
                "source_name": g.get("general.name", None),
                # informational (absent from older imports, so no CONVERTER_VERSION bump): the
                # GGML types of the tensors the routed experts come from
                "expert_source_types": g.expert_source_types(),
                "dtype": config["dtype"],
                "tokenizer": tok_info is not None,
                "seconds": round(time.monotonic() - t0, 2),
            }
        )
        _write_json(tmp / "tiermoe_import.json", result.provenance)
        _fix_modes(tmp)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        tmp.rename(out_dir)
    except OSError as exc:  # disk full, permissions: the user's to fix, not a traceback
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"{out_dir}: writing the checkpoint failed ({exc.strerror or exc})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _fix_modes(directory: Path) -> None:
    """mkdtemp makes the directory 0700; give it (and its files) the modes the umask allows."""
    import os

    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for f in directory.iterdir():
        f.chmod(0o666 & ~umask)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
