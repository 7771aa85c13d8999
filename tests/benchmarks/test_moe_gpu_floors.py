"""The hardware floors `tiermoe bench moe-gpu` prints, from a measured result (no GPU needed)."""

from __future__ import annotations

import types

import pytest

from benchmarks.moe_gpu_floors import add_floors

MB = 1_000_000


def _result(stage: bool) -> dict:
    decode = {str(t): {"step_ms": 10.0 * t, "hits_per_step": 30.0 * t, "misses_per_step": 60.0 * t,
                       "admitted_per_step": 2.0} for t in (1, 2, 4)}
    return {"args": {"stage_misses": stage}, "model": {"layers": 10, "top_k": 8, "hidden": 4096, "inter": 2048},
            "bandwidth": {"hbm_copy_GBps": 4000.0, "h2d_pinned_GBps": 50.0, "zero_copy_read_GBps": 45.0,
                          "bf16_matmul_TFLOPs": 800.0},
            "decode": decode,
            "prefill": {"tokens": 8192, "tok_s": 5000.0, "staged_per_layer": 250.0, "resident_used_per_layer": 32.0}}


@pytest.mark.parametrize("stage", [True, False])
def test_floors_use_the_measured_bandwidths_at_every_batch_size(stage):
    res = _result(stage)
    add_floors(res, types.SimpleNamespace(weight_bytes=10 * MB, length=12 * MB))
    for t in (1, 2, 4):
        d = res["decode"][str(t)]
        pcie_s = 60 * t * 10 * MB / 50e9  # misses x weight bytes / best PCIe rate
        hbm_s = (30 * t + 10) * 10 * MB / 4000e9  # hits + one shared expert per layer
        assert d["floor_step_ms"] == pytest.approx(1e3 * max(pcie_s, hbm_s))
        assert d["pct_of_floor"] == pytest.approx(100 * 1e3 * max(pcie_s, hbm_s) / (10.0 * t))
    p = res["prefill"]
    assert p["floor"]["pcie_s"] == pytest.approx(250 * 10 * 10 * MB / 50e9)
    assert p["floor"]["tok_s"] == pytest.approx(8192 / p["floor"]["pcie_s"])
