"""Which record layout each expert gets: one for a plain store, two for a mixed-precision one.

`tiermoe pack --quant int4 --cold-quant int3 --expert-stats FILE` keeps, in every MoE layer, the
most-picked experts that together take `--hot-share` of the layer's picks at the first kind and
packs the rest at the cold kind. Under real routing a few experts take most picks (GLM-5.3-Flash:
the top 25 % of a layer's experts take 61 % of its decode picks), and those are the experts the
GPU slots and host RAM hold; the cold rest are the ones read over PCIe, from disk or by the CPU
lane on a miss, so their fewer bytes shorten the misses while most picks keep the better kind.

The `RecordPlan` puts records back to back in key order at their own lengths (each a multiple
of 4096, so every offset stays O_DIRECT-aligned); a tier entry holds the longest.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tiermoe.errors import UserError
from tiermoe.store.records import RecordLayout


@dataclass(frozen=True)
class RecordPlan:
    layouts: tuple[RecordLayout, ...]
    layout_of: tuple[int, ...]  # per key (manifest record order): index into layouts
    offsets: tuple[int, ...]  # per key: byte offset in experts.bin
    total: int  # bytes of experts.bin
    hot_share: float | None = None  # mixed stores: the pick share kept at layouts[0]
    stats_name: str | None = None  # mixed stores: the statistics file that chose the hot experts

    @classmethod
    def uniform(cls, layout: RecordLayout, n_keys: int) -> "RecordPlan":
        return cls((layout,), (0,) * n_keys, tuple(i * layout.length for i in range(n_keys)), n_keys * layout.length)

    @classmethod
    def by_index(cls, layouts: tuple[RecordLayout, ...], layout_of: list[int], hot_share: float | None = None,
                 stats_name: str | None = None) -> "RecordPlan":
        offsets, off = [], 0
        for idx in layout_of:
            offsets.append(off)
            off += layouts[idx].length
        return cls(layouts, tuple(layout_of), tuple(offsets), off, hot_share, stats_name)

    @property
    def entry_bytes(self) -> int:
        """Bytes of the longest record (an encode buffer, a tier entry)."""
        return max(lay.length for lay in self.layouts)

    def layout(self, key: int) -> RecordLayout:
        return self.layouts[self.layout_of[key]]

    def counts(self) -> list[int]:
        """Records per layout."""
        return [self.layout_of.count(i) for i in range(len(self.layouts))]


def hot_experts(counts: list[float], share: float) -> set[int]:
    """The fewest most-picked experts (ties: lower id first) whose picks reach `share` of the total;
    all of them when the counts are all zero."""
    total = float(sum(counts))
    if total <= 0:
        return set(range(len(counts)))
    order = sorted(range(len(counts)), key=lambda e: (-counts[e], e))
    hot, acc = set(), 0.0
    for e in order:
        if acc >= share * total:
            break
        hot.add(e)
        acc += counts[e]
    return hot


def mixed_plan(keys: list[tuple[int, int]], experts_per_layer: dict[int, int], hot: RecordLayout,
               cold: RecordLayout, stats_file: str, share: float, log) -> RecordPlan:
    """Layout 0 (hot) for each layer's most-picked experts by `stats_file`, layout 1 (cold) for the
    rest. A layer the statistics lack keeps all its experts hot (said once in `log`)."""
    from tiermoe.store.planner import load_stats

    if not 0.0 <= share <= 1.0:
        raise UserError(f"--hot-share {share}: give a share of picks between 0 and 1")
    stats = load_stats(stats_file)
    for layer, n in experts_per_layer.items():
        if layer in stats and len(stats[layer]) != n:
            raise UserError(f"{stats_file}: layer {layer} lists {len(stats[layer])} experts, the checkpoint has {n}")
    if not set(stats) & set(experts_per_layer):
        raise UserError(f"{stats_file}: none of its layers is a MoE layer of the checkpoint "
                        f"({min(experts_per_layer)}..{max(experts_per_layer)})")
    missing = sorted(set(experts_per_layer) - set(stats))
    if missing:
        log(f"note: {stats_file} lacks MoE layers {missing}; their experts stay {hot.kind}")
    hot_sets = {layer: hot_experts(stats[layer], share) for layer in experts_per_layer if layer in stats}
    layout_of = [0 if layer not in hot_sets or e in hot_sets[layer] else 1 for layer, e in keys]
    return RecordPlan.by_index((hot, cold), layout_of, share, Path(stats_file).name)
