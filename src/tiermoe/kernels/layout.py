"""Byte layout of one expert record, as the kernels address it.

The record format is shared with the store (docs/store-format.md): one routed SwiGLU expert is
one contiguous record, identical in every tier, so a pointer-table entry (one int64 address)
is enough for a kernel to find every section:

  bf16 record:        gate_up [2I, H] | down [H, I]
  int3 / int4 / int8 record: gate_up_q [2I, 3H/8 | H/2 | H] | gate_up_s [2I, H/G] bf16
                             | down_q [H, 3I/8 | I/2 | I]     | down_s [H, I/G] bf16
  (int3 rows: K/4 bytes of low-two-bit plane, then K/8 bytes of high-bit plane; store/quant.py)

Every section starts 256-byte aligned, the record length is a multiple of 4096. This module
re-derives the offsets from those rules instead of importing the store, because `kernels/`
depends on nothing else in the package; a test checks both derivations agree.
"""

from __future__ import annotations

from dataclasses import dataclass

SECTION_ALIGN = 256
RECORD_ALIGN = 4096
KINDS = ("bf16", "int4", "int8", "int3")
_BITS = {"int3": 3, "int4": 4, "int8": 8}


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class ExpertLayout:
    """Offsets (bytes from the record start) of each section of one expert record.

    For bf16 records `gate_up_s` and `down_s` are -1 (no scales); `gate_up_q`/`down_q` then
    hold the offsets of the bf16 `gate_up`/`down` matrices.
    """

    kind: str  # "bf16" | "int4" | "int8" | "int3"
    hidden: int  # H
    inter: int  # I
    group_size: int  # G (0 for bf16)
    gate_up_q: int
    gate_up_s: int
    down_q: int
    down_s: int
    length: int  # padded record length in bytes

    @property
    def bits(self) -> int:
        return _BITS.get(self.kind, 16)

    @property
    def weight_bytes(self) -> int:
        """Bytes a kernel must read per expert (sections only, not padding)."""
        h, i = self.hidden, self.inter
        if self.kind == "bf16":
            return 3 * h * i * 2
        return 3 * h * i * self.bits // 8 + (2 * i * (h // self.group_size) + h * (i // self.group_size)) * 2


def expert_layout(kind: str, hidden: int, inter: int, group_size: int = 128) -> ExpertLayout:
    """Layout of a `kind` record for hidden size H and expert intermediate size I."""
    h, i = int(hidden), int(inter)
    if kind not in KINDS:
        raise ValueError(f"unknown record kind {kind!r}; expected one of {KINDS}")
    if kind == "bf16":
        sizes = [2 * i * h * 2, h * i * 2]
        offs, off = [], 0
        for s in sizes:
            off = _align(off, SECTION_ALIGN)
            offs.append(off)
            off += s
        return ExpertLayout(kind, h, i, 0, offs[0], -1, offs[1], -1, _align(off, RECORD_ALIGN))
    g = int(group_size)
    if g <= 0 or g % 2 or h % g or i % g:
        raise ValueError(f"group_size {g} must be even and divide hidden {h} and inter {i}")
    if kind == "int3" and (h % 8 or i % 8):
        raise ValueError(f"int3 records need hidden {h} and inter {i} to be multiples of 8")
    bits = _BITS[kind]
    sizes = [2 * i * h * bits // 8, 2 * i * (h // g) * 2, h * i * bits // 8, h * (i // g) * 2]
    offs, off = [], 0
    for s in sizes:
        off = _align(off, SECTION_ALIGN)
        offs.append(off)
        off += s
    return ExpertLayout(kind, h, i, g, offs[0], offs[1], offs[2], offs[3], _align(off, RECORD_ALIGN))


def layout_from(obj) -> ExpertLayout:
    """Accept an ExpertLayout or any object shaped like the store's RecordLayout.

    Duck-typed (kind, hidden, intermediate, group_size, length, section(name).offset) so that
    kernels never import the store; the derived layout is checked against the object's.
    """
    if isinstance(obj, ExpertLayout):
        return obj
    lay = expert_layout(obj.kind, obj.hidden, obj.intermediate, obj.group_size or 0)
    if obj.kind == "bf16":
        got = (obj.section("gate_up").offset, obj.section("down").offset)
        want = (lay.gate_up_q, lay.down_q)
    else:
        got = tuple(obj.section(n).offset for n in ("gate_up_q", "gate_up_s", "down_q", "down_s"))
        want = (lay.gate_up_q, lay.gate_up_s, lay.down_q, lay.down_s)
    if got != want or int(obj.length) != lay.length:
        raise ValueError(f"record layout {got}/{obj.length} differs from the kernels' {want}/{lay.length}")
    return lay
