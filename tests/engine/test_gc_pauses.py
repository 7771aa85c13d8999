"""The collector's pauses are counted (for /stats and the step log) and the start-up heap can be frozen."""

from __future__ import annotations

import gc
import logging

from tiermoe.engine import gc_pauses
from tiermoe.engine.gc_pauses import GcPauses, freeze_startup_heap


def test_pauses_counted_by_generation(caplog):
    pauses = GcPauses()
    gc.callbacks.append(pauses.hook)
    try:
        with caplog.at_level(logging.DEBUG, logger="tiermoe.engine.steps"):
            gc.collect(0)
            gc.collect(2)
    finally:
        gc.callbacks.remove(pauses.hook)
    c = pauses.counters()
    assert c["collections"][0] >= 1 and c["collections"][2] >= 1
    assert c["seconds"][2] > 0 and c["max_pause_ms"] >= 1e3 * c["seconds"][2] / c["collections"][2] - 1e-6
    assert any("gc: full collection in" in r.getMessage() for r in caplog.records)


def test_watch_installs_once():
    first = gc_pauses.watch()
    assert gc_pauses.watch() is first
    assert gc.callbacks.count(first.hook) == 1


def test_freeze_leaves_live_objects_out_of_collections():
    class Cycle:
        pass

    alive = [Cycle()]  # a live object made before the freeze is frozen with the rest
    before = gc.get_freeze_count()
    try:
        frozen = freeze_startup_heap()
        assert frozen >= before and frozen > 0
        assert not any(o is alive for o in gc.get_objects())  # collections no longer walk it
    finally:
        gc.unfreeze()


def test_engine_stats_report_the_pauses(tiny_dir):
    from tiermoe.engine.build import build_engine_core

    engine = build_engine_core(str(tiny_dir("glm4_moe")), device="cpu", dtype="float32", max_num_seqs=1, options={})
    gc.collect()
    stats = engine.stats()["gc"]
    assert stats["collections"][2] >= 1 and stats["seconds"][2] > 0
    assert set(stats) == {"collections", "seconds", "max_pause_ms", "frozen_objects"}
