"""The launch-configuration search only tries tiles the kernel accepts, including K tiles that
span several small scale groups (int4 group 32, Q4_0's block)."""

import pytest

from tiermoe.kernels.layout import expert_layout
from tiermoe.kernels.triton import fused_moe as F
from tiermoe.kernels.triton import tuning


@pytest.mark.parametrize("shape", [("int4", 4096, 1536, 32), ("int4", 4096, 2048, 128), ("int8", 2048, 768, 64),
                                   ("bf16", 4096, 1536, 0)])
def test_every_candidate_passes_the_kernels_config_check(shape):
    kind, h, i, g = shape
    lay = expert_layout(kind, h, i, g or 128)
    cands = tuning._decode_candidates(lay) + tuning._prefill_candidates(lay, 64) + tuning._prefill_candidates(lay, 128)
    assert cands
    for c in cands:
        F._check_config(lay, {"gate_up": c, "down": c}, 1)
    from tiermoe.kernels.triton.moe_gemv import check_gemv_config

    gemv = tuning._gemv_candidates(lay)
    assert gemv and {c["acc"] for c in gemv} == {"tile", "row"}
    for c in gemv:  # the matrix-vector path's shapes pass its own check
        check_gemv_config(lay, {"gate_up": c, "down": c})


def test_small_groups_get_k_tiles_beyond_the_group():
    lay = expert_layout("int4", 4096, 1536, 32)
    assert {c["BK"] for c in tuning._prefill_candidates(lay, 64)} >= {64, 128}
    assert any(c["BK"] == 128 for c in tuning._decode_candidates(lay))


def test_tune_moe_refuses_without_cuda(capsys):
    import torch

    from tiermoe.cli import main

    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    assert main(["bench", "tune-moe", "--hidden", "4096", "--inter", "1536"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
