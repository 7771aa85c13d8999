"""Expert-store flags given for a checkpoint are named in one warning: the checkpoint loads whole and reads none."""

from __future__ import annotations

import logging

from tiermoe.engine.build import engine_config


def test_store_flags_on_a_checkpoint_are_named(tiny_dir, caplog):
    path = str(tiny_dir("glm4_moe"))
    with caplog.at_level(logging.WARNING, logger="tiermoe.engine"):
        cfg = engine_config(path, device="cpu", options={"mode": "fast", "gpu_expert_gb": 1.0, "no_direct_io": True})
    assert cfg.experts is None  # served whole: no expert store
    [line] = [r.getMessage() for r in caplog.records if "not a packed store" in r.getMessage()]
    assert "--gpu-expert-gb, --no-direct-io, --mode" in line and "tiermoe pack" in line


def test_no_warning_without_store_flags(tiny_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="tiermoe.engine"):
        engine_config(str(tiny_dir("glm4_moe")), device="cpu", options={"mode": "exact"})
    assert not [r for r in caplog.records if "not a packed store" in r.getMessage()]


def test_no_warning_for_a_packed_store(tiny_dir, tmp_path, caplog):
    from tiermoe.store.pack import pack

    pack(str(tiny_dir("glm4_moe")), str(tmp_path / "store"), quant="bf16", progress=False)
    with caplog.at_level(logging.WARNING, logger="tiermoe.engine"):
        engine_config(str(tmp_path / "store"), device="cpu", options={"gpu_expert_gb": 0.001, "mode": "fast"})
    assert not [r for r in caplog.records if "not a packed store" in r.getMessage()]
