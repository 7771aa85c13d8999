"""Routing trace files: which experts every token picked, per MoE layer (`--record-routing`).

One numpy `.npz` (uncompressed: recording must stay cheap) with three arrays:

    picks   uint16 [N, L, k]  expert ids per token and MoE layer, in the model's MoE-layer order
    decode  bool   [N]        True for decode tokens, False for prefill tokens
    header  0-d unicode       JSON: {"format": "tiermoe-routing-trace", "version": 1,
                              "model": str, "moe_layers": [model layer indices],
                              "num_experts": E, "top_k": k}

Tokens are in forward order (a step's tokens in batch order), so replaying a trace keeps its
temporal locality. Readers: `tiermoe sim --trace`, `--routing-replay`, and, as per-layer pick
counts (`trace_counts`), every statistics flag (`--expert-stats`, `plan --stats`, `sim --stats`).
This module imports no torch (the simulator and the CLI use it); numpy only.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import numpy as np

from tiermoe.errors import UserError

FORMAT = "tiermoe-routing-trace"
VERSION = 1
MAX_EXPERTS = 65536  # expert ids are stored as uint16


def make_header(model: str, moe_layers: list[int], num_experts: int, top_k: int) -> dict:
    return {"format": FORMAT, "version": VERSION, "model": str(model), "moe_layers": [int(x) for x in moe_layers],
            "num_experts": int(num_experts), "top_k": int(top_k)}


def write_trace(path: str | os.PathLike, header: dict, picks: np.ndarray, decode: np.ndarray) -> None:
    """Write a trace atomically (a temporary file renamed over `path`), so a reader, or a server
    killed while writing, never leaves a half-written file under the final name.

    picks [N, L, k] integer expert ids; decode [N] bool.
    """
    picks = np.asarray(picks)
    decode = np.asarray(decode, dtype=bool)
    _check(str(path), header, picks, decode)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, picks=picks.astype(np.uint16, copy=False), decode=decode,
                     header=np.array(json.dumps(header, sort_keys=True)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        try:  # under a file (NotADirectoryError) there is no temp file to remove either
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise UserError(f"{path}: cannot write the routing trace ({exc.strerror or exc})") from None


def read_trace(path: str | os.PathLike) -> tuple[dict, np.ndarray, np.ndarray]:
    """(header dict, picks uint16 [N, L, k], decode bool [N]); UserError (one line) for a file
    that is not a complete, consistent trace."""
    p = str(path)
    try:
        with open(p, "rb") as f:
            if f.read(4) != b"PK\x03\x04":
                raise UserError(f"{p}: not a routing trace (not an .npz file)")
        with np.load(p, allow_pickle=False) as z:
            names = set(z.files)
            missing = sorted({"picks", "decode", "header"} - names)
            if missing:
                raise UserError(f"{p}: not a routing trace (no {', '.join(missing)} array)")
            picks, decode, raw = z["picks"], z["decode"], z["header"]
    except UserError:
        raise
    except FileNotFoundError:
        raise UserError(f"{p}: no such routing trace file") from None
    except OSError as exc:
        raise UserError(f"{p}: cannot read the routing trace ({exc.strerror or exc})") from None
    except (ValueError, EOFError, zipfile.BadZipFile, KeyError) as exc:
        raise UserError(f"{p}: truncated or corrupt routing trace ({_first_line(exc)})") from None
    if raw.shape != () or raw.dtype.kind != "U":
        raise UserError(f"{p}: routing trace header is not a JSON string")
    try:
        header = json.loads(str(raw[()]))
    except ValueError as exc:
        raise UserError(f"{p}: routing trace header is not valid JSON ({exc})") from None
    _check(p, header, picks, decode)
    return header, picks, decode


def is_trace(path: str | os.PathLike) -> bool:
    """Whether `path` is a zip archive (an .npz trace) rather than a JSON statistics file."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False  # the reader of the other format names the problem


def trace_counts(path: str | os.PathLike) -> dict[int, list[float]]:
    """{model layer index: picks per expert id} of a trace's decode tokens (of all its tokens
    when it holds no decode token): the statistics format of store/planner.load_stats. Decode
    tokens because the tiers serve decode; prefill chunks pick experts in bulk."""
    header, picks, decode = read_trace(path)
    if picks.shape[0] == 0:
        raise UserError(f"{path}: the routing trace holds no tokens")
    chosen = picks[decode] if decode.any() else picks
    n = header["num_experts"]
    return {layer: np.bincount(chosen[:, i].reshape(-1), minlength=n).astype(float).tolist()
            for i, layer in enumerate(header["moe_layers"])}


def _check(p: str, header, picks: np.ndarray, decode: np.ndarray) -> None:
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise UserError(f"{p}: not a routing trace (header format is not {FORMAT!r})")
    if header.get("version") != VERSION:
        raise UserError(f"{p}: routing trace version {header.get('version')!r}; this tiermoe reads version {VERSION}")
    if not isinstance(header.get("model"), str):
        raise UserError(f"{p}: routing trace header: model must be a string")
    layers, e, k = header.get("moe_layers"), header.get("num_experts"), header.get("top_k")
    if not isinstance(layers, list) or not all(isinstance(x, int) for x in layers) or not layers:
        raise UserError(f"{p}: routing trace header: moe_layers must be a non-empty list of layer indices")
    if not isinstance(e, int) or not isinstance(k, int) or not 0 < k <= e <= MAX_EXPERTS:
        raise UserError(f"{p}: routing trace header: need 0 < top_k ({k!r}) <= num_experts ({e!r}) <= {MAX_EXPERTS}")
    if picks.ndim != 3 or picks.dtype.kind not in "ui" or picks.shape[1:] != (len(layers), k):
        raise UserError(f"{p}: routing trace picks have shape {tuple(picks.shape)} ({picks.dtype}); the header says "
                        f"[N, {len(layers)}, {k}] integers")
    if decode.shape != (picks.shape[0],) or decode.dtype != np.bool_:
        raise UserError(f"{p}: routing trace decode flags have shape {tuple(decode.shape)} ({decode.dtype}); "
                        f"expected [{picks.shape[0]}] bool")
    if picks.size and (int(picks.min()) < 0 or int(picks.max()) >= e):
        raise UserError(f"{p}: routing trace expert ids must be in 0..{e - 1}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
