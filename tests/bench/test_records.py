"""Random expert records (tune-moe, synthetic stores, benchmarks) are valid records."""

import torch

from tiermoe.bench.records import random_records
from tiermoe.kernels import reference as R
from tiermoe.kernels.layout import expert_layout


def test_random_records_are_valid():
    lay = expert_layout("int4", 64, 32, 32)
    recs = random_records(lay, 3, torch.device("cpu"), torch.Generator().manual_seed(0), chunk=2)
    w = R.dequant_matrix(recs[2], lay, "down").float()
    assert torch.isfinite(w).all() and w.abs().max() > 0
    s = recs[0, lay.gate_up_s : lay.gate_up_s + 2 * 32 * 2 * 2].view(torch.bfloat16)
    assert (s > 0).all()
