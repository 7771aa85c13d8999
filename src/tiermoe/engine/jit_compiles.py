"""Triton compilations of a serving process, timed: each one is a stall of the step that needed it.

Why: Triton compiles a kernel for each new combination of its launch configuration and its integer
arguments' value classes (kernels/README.md, "Specialisation"). The start-up warm-up runs the step shapes it
knows of; a shape it missed compiles inside a request's step, which then takes seconds instead of
milliseconds (a compile, or a load from Triton's disk cache when another process compiled it before). The
counters say how many, how long, and how many came after the warm-up (/stats, `engine.jit`); each compile
after the warm-up is logged at INFO, naming the kernel, so a missed shape is found from the log alone.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("tiermoe.engine.steps")


class JitCompiles:
    """Counts from Triton's compile hooks (`jit_cache_hook` before, `jit_post_compile_hook` after each
    compilation, on the compiling thread); hooks installed before are still called."""

    def __init__(self) -> None:
        self.compiles = 0
        self.seconds = 0.0
        self.after_warm_up = 0  # compiles since mark_warm_up()
        self.warm = False
        self.last: str | None = None  # the kernel of the latest compile
        self._started = threading.local()
        self._chained: tuple = (None, None)

    def mark_warm_up(self) -> None:
        """The warm-up is over: later compiles are stalls of served steps."""
        self.warm = True

    def before(self, **kwargs) -> bool | None:
        self._started.t = time.perf_counter()
        first = self._chained[0]
        return first(**kwargs) if first is not None else None  # truthy: the chained hook skips the compile

    def after(self, **kwargs) -> None:
        started = getattr(self._started, "t", None)
        took = time.perf_counter() - started if started is not None else 0.0
        self._started.t = None
        name = kwargs["fn"].name
        self.compiles += 1
        self.seconds += took
        self.last = name
        if self.warm:
            self.after_warm_up += 1
            log.info("triton: %s compiled (or loaded from its cache) while serving, in %.0f ms: a step shape the "
                     "warm-up did not run", name, 1e3 * took)
        elif log.isEnabledFor(logging.DEBUG):
            log.debug("triton: %s compiled in %.0f ms", name, 1e3 * took)
        second = self._chained[1]
        if second is not None:
            second(**kwargs)

    def counters(self) -> dict:
        return {"compiles": self.compiles, "seconds": round(self.seconds, 3), "after_warm_up": self.after_warm_up,
                "last": self.last}


COMPILES = JitCompiles()


def watch() -> JitCompiles | None:
    """Time this process's Triton compilations from now on (once per process); None where this Triton has no
    compile hooks (before its `knobs` module) or runs kernels in its interpreter, which compiles nothing."""
    try:
        import triton
        runtime = triton.knobs.runtime
    except (ImportError, AttributeError):
        return None
    if runtime.interpret:
        return None
    if runtime.jit_post_compile_hook is not COMPILES.after:
        COMPILES._chained = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = COMPILES.before, COMPILES.after
    return COMPILES
