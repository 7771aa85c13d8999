"""Python's cyclic garbage collector in a serving process: the start-up heap frozen, its pauses counted.

Why: a full (generation 2) collection walks every object the collector tracks, and a loaded engine holds
hundreds of thousands of them (the model's modules, torch's and Triton's caches, the tokenizer, the server's
routes and models). The pass holds the interpreter lock, so it stalls the engine's thread in the middle of
whichever step crosses the collector's threshold: one step then takes far longer than its neighbours, at no
step that the workload chose. `freeze_startup_heap` moves everything alive once start-up is over into the
permanent generation, which collections skip (vLLM does the same after its warm-up); objects made later
are still tracked and collected. `watch` times every collection through `gc.callbacks`, for /stats (the
engine's `gc`) and the step log (`serve --log-level debug`).
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("tiermoe.engine.steps")  # beside the step log: a slow step and its collection together


def freeze_startup_heap() -> int:
    """Collect, then freeze what is left (call once, between start-up and the first request); returns the
    objects frozen. Collecting first keeps today's garbage out of the permanent generation."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """Collections and their wall time by generation, from the collector's own start and stop callbacks
    (both run on the collecting thread, with the interpreter lock held: collections never overlap)."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.max_s = 0.0
        self._started: float | None = None

    def hook(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:  # installed during a collection
            return
        took, self._started = time.perf_counter() - self._started, None
        gen = min(int(info.get("generation", 2)), 2)
        self.collections[gen] += 1
        self.seconds[gen] += took
        self.max_s = max(self.max_s, took)
        if gen == 2 and log.isEnabledFor(logging.DEBUG):
            log.debug("gc: full collection in %.1f ms, %d objects freed", 1e3 * took, info.get("collected", 0))

    def counters(self) -> dict:
        return {"collections": list(self.collections), "seconds": [round(s, 6) for s in self.seconds],
                "max_pause_ms": round(1e3 * self.max_s, 3), "frozen_objects": gc.get_freeze_count()}


PAUSES = GcPauses()


def watch() -> GcPauses:
    """Count this process's collections from now on (once per process; later calls return the same counts)."""
    if PAUSES.hook not in gc.callbacks:
        gc.callbacks.append(PAUSES.hook)
    return PAUSES
