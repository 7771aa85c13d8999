"""The launch-configuration search only tries tiles the kernel accepts, including K tiles that
span several small scale groups (int4 group 32, Q4_0's block)."""

import pytest

from tiermoe.kernels.layout import expert_layout
from tiermoe.kernels.triton import fused_moe as F
from tiermoe.kernels.triton import tuning


@pytest.mark.parametrize("shape", [("int4", 4096, 1536, 32), ("int4", 4096, 2048, 128), ("int8", 2048, 768, 64),
                                   ("bf16", 4096, 1536, 0), ("int3", 4096, 1536, 32), ("int3", 2048, 768, 128)])
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


def test_int3_candidates_keep_k_tiles_of_64():
    """int3 block tiles are four phase dots of BK / 4: the search never tries a K tile below 64,
    and still has decode, prefill and matrix-vector shapes for a Qwen3-30B-sized int3 layer."""
    lay = expert_layout("int3", 2048, 768, 32)
    block = tuning._decode_candidates(lay) + tuning._prefill_candidates(lay, 64) + tuning._prefill_candidates(lay, 128)
    assert min(c["BK"] for c in block) == 64 and tuning._prefill_candidates(lay, 128)
    assert tuning._gemv_candidates(lay)


def test_tune_moe_refuses_without_cuda(capsys):
    import torch

    from tiermoe.cli import main

    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    assert main(["bench", "tune-moe", "--hidden", "4096", "--inter", "1536"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert main(["bench", "tune-moe", "--hidden", "4096", "--inter", "1536", "--kind", "int3"]) == 2  # a kind it takes
    assert "needs a CUDA device" in capsys.readouterr().err
