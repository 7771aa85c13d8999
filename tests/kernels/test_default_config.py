"""The fused MoE's heuristic launch configuration (fused_moe.default_config) serves record widths that are not a
power of two: the embedded default model (SmolLM2-135M as glm4_moe: hidden 576 = 64 x 9, 128-wide experts) must
run the Triton kernels on CUDA, or exact mode falls back to the torch expert path, whose numerics fast mode's CPU
lane does not share."""

import pytest

from tiermoe.kernels.layout import expert_layout
from tiermoe.kernels.triton import fused_moe as F
from tiermoe.moe.backends import _check_pow2


@pytest.mark.parametrize("kind,group", [("int4", 64), ("int4", 32), ("int8", 32), ("int3", 64), ("bf16", 128)])
@pytest.mark.parametrize("hidden,inter", [(576, 128), (576, 192), (4096, 2048), (2880, 2880)])
def test_gpu_default_fits_the_record_shape(monkeypatch, kind, group, hidden, inter):
    monkeypatch.setattr(F, "_INTERPRET", False)  # the CUDA heuristic, not the interpreter's small tiles
    lay = expert_layout(kind, hidden, inter, group)
    for tokens in (1, F.DECODE_MAX_TOKENS + 1):
        cfg = F.default_config(lay, tokens)
        F._check_config(lay, cfg, tokens)  # raises on a tile that does not divide its matrix
        _check_pow2(cfg)
        for stage, (n, k) in (("gate_up", (inter, hidden)), ("down", (hidden, inter))):
            assert n % cfg[stage]["BN"] == 0 and k % cfg[stage]["BK"] == 0
            assert cfg[stage]["BN"] >= 16


def test_fit_keeps_the_asked_tile_where_it_divides():
    assert F._fit_block(128, 4096, 16) == 128
    assert F._fit_block(128, 576, 16) == 64  # 576 = 64 x 9
    assert F._fit_block(64, 100, 32) == 64  # nothing from 64 down to 32 divides 100: the check refuses it later
