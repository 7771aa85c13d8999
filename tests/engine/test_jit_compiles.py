"""Triton compilations are counted, and those after the warm-up logged (engine/jit_compiles.py). CI has no GPU, so
the hooks are called here as Triton calls them, with its keyword arguments."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from tiermoe.engine import jit_compiles
from tiermoe.engine.jit_compiles import JitCompiles


def _compile(jit: JitCompiles, name: str) -> None:
    info = SimpleNamespace(module="tiermoe.kernels.triton.fused_moe", name=name)
    kwargs = dict(key="k", repr=name, fn=info, compile={}, is_manual_warmup=False, already_compiled=False)
    assert not jit.before(**kwargs)  # falsy: Triton goes on to compile
    jit.after(**kwargs)


def test_counts_and_logs_compiles_after_the_warm_up(caplog):
    jit = JitCompiles()
    with caplog.at_level(logging.INFO, logger="tiermoe.engine.steps"):
        _compile(jit, "_moe_gemm_kernel")
        assert not caplog.records  # during the warm-up: expected, not logged at INFO
        jit.mark_warm_up()
        _compile(jit, "_align_small_kernel")
    c = jit.counters()
    assert c["compiles"] == 2 and c["after_warm_up"] == 1 and c["last"] == "_align_small_kernel"
    assert c["seconds"] >= 0
    [record] = caplog.records
    assert "_align_small_kernel compiled" in record.getMessage() and "warm-up did not run" in record.getMessage()


def test_hooks_installed_before_are_still_called():
    calls = []
    jit = JitCompiles()
    jit._chained = (lambda **kw: calls.append(("before", kw["fn"].name)),
                    lambda **kw: calls.append(("after", kw["fn"].name)))
    _compile(jit, "_cache_step_kernel")
    assert calls == [("before", "_cache_step_kernel"), ("after", "_cache_step_kernel")]


def test_nothing_to_watch_in_the_interpreter(monkeypatch):
    import triton

    monkeypatch.setattr(triton.knobs.runtime, "interpret", True)
    assert jit_compiles.watch() is None
