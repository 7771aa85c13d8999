"""What `tiermoe pack` checks before any slow work, and how a half-written store is named.

A wrong --group-size used to fail only after the checkpoint was read (for a GGUF source, after
the whole import), and pack wrote into any directory it was given, even one holding other
files or a store packed with other settings. These checks read only config.json (or a GGUF
file's metadata) and directory listings, and import no torch, so the CLI runs them first.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tiermoe.errors import UserError
from tiermoe.store.lock import LOCK_NAME

JOURNAL_NAME = "pack.journal"
DEFAULT_HOT_SHARE = 0.6  # pack --cold-quant: the share of each layer's picks whose experts stay at --quant
MANIFEST_NAME = "manifest.json"  # also records.MANIFEST_NAME (that module imports torch)
EXPERTS_NAME = "experts.bin"
INT_QUANTS = ("int8", "int4", "int3")
# The largest group size picked when none is given. int3 has only eight levels, so a scale per
# 64 columns instead of 128 buys back more error than its 4 % more bytes cost (GLM-5.3-Flash's
# expert: 10,223,616 bytes against 9,830,400; relative weight error 5 % lower on normal weights
# and 13 % lower on Student-t(3) ones: tests/store/test_pack_guards.py).
PREFERRED_GROUP_SIZE = {"int8": 128, "int4": 128, "int3": 64}
_POWERS = (256, 128, 64, 32, 16)


def working_group_sizes(hidden: int, intermediate: int) -> list[int]:
    """Group sizes an int8/int4/int3 store of these shapes can use, best first: powers of two from
    256 down to 16 that divide both, else any even common divisor (largest first)."""
    sizes = [g for g in _POWERS if hidden % g == 0 and intermediate % g == 0]
    if sizes:
        return sizes
    return [g for g in range(min(hidden, intermediate), 1, -1) if g % 2 == 0 and hidden % g == 0
            and intermediate % g == 0][:4]


def choose_group_size(hidden: int, intermediate: int, given: int | None, quant: str = "int4",
                      flag: str = "--group-size") -> int:
    """`given` when it divides both shapes, else UserError listing the sizes that would; with
    none given, the largest working size up to PREFERRED_GROUP_SIZE[quant]. int3 also needs
    both shapes to be multiples of 8 (a row's high-bit plane is whole bytes)."""
    sizes = working_group_sizes(hidden, intermediate)
    shapes = f"hidden_size {hidden} and expert intermediate size {intermediate}"
    if quant == "int3" and (hidden % 8 or intermediate % 8):
        raise UserError(f"--quant int3 needs {shapes} to be multiples of 8 (use --quant int4 or int8)")
    if given is not None:
        if given > 0 and given % 2 == 0 and hidden % given == 0 and intermediate % given == 0:
            return given
        if not sizes:
            raise UserError(f"{flag} {given}: no group size divides {shapes}; {quant} needs even shapes "
                            "(use --quant bf16)")
        listed = ", ".join(str(g) for g in sizes)
        raise UserError(f"{flag} {given} does not divide {shapes}; these would: {listed} "
                        f"(or leave {flag} out to pick one)")
    if not sizes:
        raise UserError(f"no {quant} group size divides {shapes} (use --quant bf16)")
    preferred = PREFERRED_GROUP_SIZE.get(quant, 128)
    return next((g for g in sizes if g <= preferred), sizes[0])


def source_shapes(src: str | os.PathLike) -> tuple[int, int] | None:
    """(hidden size, routed expert intermediate size) a pack of `src` will have, from its
    config.json or GGUF metadata alone; None where they cannot be read cheaply (the packer then
    checks the real tensor shapes)."""
    src = Path(src)
    if src.suffix == ".gguf":
        from tiermoe.importers.probe import gguf_expert_shape

        return gguf_expert_shape(src)
    try:
        config = json.loads((src / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    hidden = text.get("hidden_size")
    inter = text.get("moe_intermediate_size")
    if inter is None and text.get("model_type") == "mixtral":  # Mixtral's per-expert width
        inter = text.get("intermediate_size")
    if isinstance(hidden, int) and isinstance(inter, int) and hidden > 0 and inter > 0:
        return hidden, inter
    return None


def check_target(out: str | os.PathLike, fingerprint: str | None = None) -> None:
    """UserError unless `out` is absent, empty, or an earlier pack of this same source and
    settings (its journal starts with `fingerprint`; any journal when fingerprint is None)."""
    out = Path(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise UserError(f"{out}: exists and is not a directory")
    try:
        entries = [e.name for e in out.iterdir() if e.name != LOCK_NAME]
    except OSError as exc:
        raise UserError(f"{out}: cannot list the directory ({exc.strerror or exc})") from None
    if not entries:
        return
    journal = out / JOURNAL_NAME
    if not journal.is_file():
        raise UserError(f"{out}: directory is not empty and holds no earlier pack ({len(entries)} entries, no "
                        f"{JOURNAL_NAME}); choose a new or empty directory")
    if fingerprint is None:
        return
    try:
        with open(journal) as f:
            first = f.readline().strip()
    except OSError as exc:
        raise UserError(f"{journal}: unreadable ({exc.strerror or exc})") from None
    if first != f"tiermoe-pack {fingerprint}":
        raise UserError(f"{out}: holds a pack of another source or other settings; choose a new or empty "
                        f"directory, or delete {out} first")


def incomplete_store(root: str | os.PathLike) -> str | None:
    """One line naming what a directory that looks like a store lacks, or None (a complete
    store, or no store at all): without it, a store missing manifest.json was loaded as a plain
    checkpoint and failed on the first expert tensor it could not find."""
    root = Path(root)
    if not root.is_dir() or (root / MANIFEST_NAME).is_file():
        return None
    if (root / JOURNAL_NAME).is_file():
        return (f"{root}: packed expert store without its {MANIFEST_NAME} (its pack did not finish, or the file "
                "was removed); run the same `tiermoe pack` command again to finish it")
    if (root / EXPERTS_NAME).exists():
        return (f"{root}: packed expert store without its {MANIFEST_NAME}; run `tiermoe pack` into this "
                "directory again")
    return None


def check_cold_args(quant: str, cold_quant: str, expert_stats: str | None, hot_share: float) -> None:
    """pack --cold-quant: a kind other than --quant, statistics that exist, a share in [0, 1]."""
    if cold_quant == quant:
        raise UserError(f"--cold-quant {cold_quant} is --quant itself; leave it out for a store of one kind")
    if expert_stats is None:
        raise UserError("--cold-quant needs --expert-stats FILE: the routing statistics that say which experts are "
                        "picked most (they stay at --quant)")
    if not os.path.isfile(expert_stats):
        raise UserError(f"--expert-stats {expert_stats}: no such file")
    if not 0.0 <= hot_share <= 1.0:
        raise UserError(f"--hot-share {hot_share}: give a share of picks between 0 and 1")
