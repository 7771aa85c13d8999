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


def test_random_int3_records_fill_exactly_their_bit_planes():
    """int3: 3K/8 bytes of uniform codes a row (every stored value 0..7 about equally often),
    nothing written past a section, positive scales; dequantized finite and about unit gain."""
    lay = expert_layout("int3", 128, 64, 32)
    recs = random_records(lay, 4, torch.device("cpu"), torch.Generator().manual_seed(1), chunk=3)
    q_bytes = 2 * 64 * 128 * 3 // 8
    assert (recs[:, lay.gate_up_q + q_bytes : lay.gate_up_s] == 0).all()  # alignment padding untouched
    codes = R.unpack_int3(recs[0, lay.gate_up_q : lay.gate_up_q + q_bytes].view(2 * 64, 3 * 128 // 8))  # [2I, H]
    counts = torch.bincount((codes + 4).reshape(-1), minlength=8)
    assert counts.numel() == 8 and counts.min() > 0.8 * codes.numel() / 8
    s = recs[:, lay.down_s : lay.down_s + 128 * (64 // 32) * 2].view(torch.bfloat16)
    assert (s > 0).all()
    w = R.dequant_matrix(recs[3], lay, "gate_up").float()  # [2I, H]
    gain = (w @ torch.randn(128, 256, generator=torch.Generator().manual_seed(2))).std()
    assert torch.isfinite(w).all() and 0.5 < gain < 2.0

