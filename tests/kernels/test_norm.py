"""glm5_next's RMSNorm and clamped SwiGLU kernels (kernels/triton/norm.py) against their twins
(kernels/reference_norm.py, the code models/glm5_next/layers.py runs on CPU), through Triton's interpreter.

Tolerances, and why they are not zero:
  - rms_norm: the kernel adds the squares in a tree of its own and multiplies by fp32(1 / D) where torch's
    CPU mean divides, so the statistic may differ by a few fp32 ulps. At bf16 that can move an element
    lying next to a rounding boundary by one bf16 ulp (at most 1 ulp, bit for bit on 99% of values); at
    fp32 it passes straight through (rtol 1e-5).
  - clamped_swiglu: the interpreter's exp is numpy's, torch's CPU silu uses its own vectorised exp, each
    within an ulp of exact: the same bf16 checks; at fp32 rtol 1e-5 (silu's exp and the division).
"""

import pytest
import torch

from tiermoe.kernels.reference_norm import clamped_swiglu_ref, rms_norm_ref
from tiermoe.kernels.triton.norm import MAX_DIM, clamped_swiglu, rms_norm

EPS = 1e-6
DTYPES = [torch.bfloat16, torch.float32]
# saturated silu: exp(-x) overflows to inf for very negative gates, as it does in torch (and silu(-inf) is
# -inf / inf = NaN there too)
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")]


def check_rounded(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16: at most 1 ulp apart, bit for bit on 99% of the values; fp32: rtol 1e-5."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.bfloat16:
        bits = [x.cpu().contiguous().view(torch.int16).to(torch.int32) for x in (got, want)]
        ordered = [torch.where(i < 0, -(i + (1 << 15)), i) for i in bits]  # sign-magnitude -> ordered ints
        ulps = (ordered[0] - ordered[1]).abs()
        assert int(ulps.max()) <= 1, f"{int(ulps.max())} ulps apart"
        assert float((ulps == 0).float().mean()) >= 0.99
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-12)


def _rows(t: int, d: int, dtype: torch.dtype, device, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    """[T, D] with rows of magnitude 1, 1e3 and 1e-3 in turn, times scale."""
    gen = torch.Generator().manual_seed(seed + d + t)
    mag = torch.tensor([1.0, 1e3, 1e-3]).repeat(t)[:t, None] * scale  # [T, 1]
    return (torch.randn(t, d, generator=gen) * mag).to(dtype).to(device)


def _weight(d: int, dtype: torch.dtype, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(d)
    return (1 + 0.5 * torch.randn(d, generator=gen)).to(dtype).to(device)


@pytest.mark.parametrize("weight_dtype", ["same", torch.float32])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, d", [(1, 64), (3, 80), (3, 512), (1, 4096), (3, 4096)])
def test_rms_norm_matches_twin(t, d, dtype, weight_dtype, device):
    """The weight in the input's dtype (as loaded) or in fp32 (the result is then fp32, as in torch)."""
    x = _rows(t, d, dtype, device)
    weight = _weight(d, dtype if weight_dtype == "same" else weight_dtype, device)
    got = rms_norm(x, weight, EPS)
    assert got.shape == (t, d)
    check_rounded(got, rms_norm_ref(x, weight, EPS))


def test_rms_norm_reads_strided_rows_and_any_leading_shape(device):
    """kv_a_layernorm normalises a column slice of a wider projection in place; other callers pass [B, T, D]."""
    wide = _rows(3, 80 + 16, torch.bfloat16, device)
    weight = _weight(80, torch.bfloat16, device)
    check_rounded(rms_norm(wide[:, :80], weight, EPS), rms_norm_ref(wide[:, :80], weight, EPS))
    x = _rows(6, 80, torch.bfloat16, device).view(2, 3, 80)
    got = rms_norm(x, weight, EPS)
    assert got.shape == (2, 3, 80)
    check_rounded(got, rms_norm_ref(x, weight, EPS))


def test_rms_norm_each_row_alone_gives_the_same_bits(device):
    x = _rows(3, 80, torch.bfloat16, device)
    weight = _weight(80, torch.bfloat16, device)
    batch = rms_norm(x, weight, EPS)
    for i in range(3):
        assert torch.equal(batch[i:i + 1], rms_norm(x[i:i + 1], weight, EPS))


@pytest.mark.parametrize("limit", [7.0, 1.0, 7.3])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, inter", [(1, 64), (3, 80), (3, 2048)])
def test_clamped_swiglu_matches_twin(t, inter, dtype, limit, device):
    """Gates and ups of magnitude up to ~4e3 so both clamps bite; 7.3 is no bf16 value (torch rounds the
    bound to the input dtype, so must the kernel)."""
    gate = _rows(t, inter, dtype, device, seed=1, scale=4.0)
    up = _rows(t, inter, dtype, device, seed=2, scale=4.0)
    got = clamped_swiglu(gate, up, limit)
    assert got.shape == (t, inter) and got.dtype == dtype
    check_rounded(got, clamped_swiglu_ref(gate, up, limit))


@pytest.mark.parametrize("t", [1, 3])
def test_clamped_swiglu_reads_the_halves_of_a_merged_projection_in_place(t, device):
    """gate and up as the two column halves of one [T, 2I] GEMM output (rows strided 2I): the rows the twin
    gives for contiguous copies, in a contiguous [T, I] result."""
    merged = _rows(t, 2 * 80, torch.bfloat16, device, seed=3, scale=4.0)
    gate, up = merged.chunk(2, dim=-1)
    got = clamped_swiglu(gate, up, 7.0)
    assert got.is_contiguous() and got.shape == (t, 80)
    assert torch.equal(got.cpu(), clamped_swiglu(gate.contiguous(), up.contiguous(), 7.0).cpu())
    check_rounded(got, clamped_swiglu_ref(gate, up, 7.0))


def test_clamped_swiglu_keeps_nan_and_inf_as_torch_does(device):
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 100.0, -100.0])
    gate = special.repeat_interleave(7).to(torch.bfloat16).to(device)  # [49]: every (gate, up) pair
    up = special.repeat(7).to(torch.bfloat16).to(device)
    got, want = clamped_swiglu(gate, up, 7.0).cpu(), clamped_swiglu_ref(gate.cpu(), up.cpu(), 7.0)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()], want[~want.isnan()])


def test_no_rows(device):
    x = _rows(1, 64, torch.bfloat16, device)[:0]
    assert rms_norm(x, _weight(64, torch.bfloat16, device), EPS).shape == (0, 64)
    assert clamped_swiglu(x, x, 7.0).shape == (0, 64)


def test_rejects_what_it_cannot_compute(device):
    x = _rows(2, 64, torch.bfloat16, device)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, _weight(63, torch.bfloat16, device), EPS)
    with pytest.raises(ValueError, match="rows"):
        rms_norm(torch.zeros(1, MAX_DIM + 1, device=device), torch.ones(MAX_DIM + 1, device=device), EPS)
    with pytest.raises(ValueError, match="x"):
        rms_norm(x.double(), _weight(64, torch.float64, device), EPS)
    with pytest.raises(ValueError, match="match"):
        clamped_swiglu(x, x.float(), 7.0)
