"""The JSON envelope every bench result shares, so `bench report` can render any of them.

Each result carries `kind` (which subcommand made it), `version`, the UTC time it was taken,
the exact command line, and the host; numbers without the command that produced them are
not reproducible, so the command is part of the record.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

from tiermoe.errors import UserError

SCHEMA_VERSION = 1
KINDS = ("sweep", "stream-rate", "gates", "panel", "panel-score", "floor", "lane")


def envelope(kind: str, **fields: Any) -> dict:
    """A result dict with the shared header fields filled in."""
    assert kind in KINDS, kind
    return {
        "kind": f"tiermoe.bench.{kind}",
        "version": SCHEMA_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
        "host": platform.node(),
        **fields,
    }


def command_line() -> str:
    argv = list(sys.argv)
    if argv and argv[0].endswith(("tiermoe", "__main__.py", "cli.py")):
        argv[0] = "tiermoe"
    return shlex.join(argv)


def kind_of(result: dict) -> str:
    kind = str(result.get("kind", ""))
    return kind.removeprefix("tiermoe.bench.")


def write_json(result: dict, out: str | None) -> None:
    """Write to `out` (creating parent folders); nothing when out is None."""
    if not out:
        return
    path = Path(out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
    except OSError as exc:
        raise UserError(f"cannot write {out}: {exc.strerror or exc}") from exc


def check_out(out: str | None) -> None:
    """Refuse an --out that write_json cannot write, before the measurement it would hold is taken (a
    benchmark can run for minutes; failing only at the end loses its figures)."""
    if not out:
        return
    path = Path(out)
    if path.is_dir():
        raise UserError(f"cannot write {out}: Is a directory")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # write_json creates the missing folders
    if not parent.is_dir():
        raise UserError(f"cannot write {out}: Not a directory ({parent})")


def read_json(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError as exc:
        raise UserError(f"{path}: no such file") from exc
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object at the top level")
    return data


def median(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def parse_sizes(text: str, name: str) -> list[int]:
    """'8k,32k,512' -> [8192, 32768, 512]; k means 1024."""
    sizes = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            sizes.append(int(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
        except ValueError as exc:
            raise UserError(f"{name}: cannot read size {part!r} (use e.g. 8k,32k or 256,512)") from exc
    if not sizes or any(s <= 0 for s in sizes):
        raise UserError(f"{name}: need one or more positive sizes")
    return sizes


def parse_ints(text: str, name: str) -> list[int]:
    try:
        vals = [int(p) for p in text.split(",") if p.strip()]
    except ValueError as exc:
        raise UserError(f"{name}: expected comma-separated integers, got {text!r}") from exc
    if not vals or any(v <= 0 for v in vals):
        raise UserError(f"{name}: need one or more positive integers")
    return vals
