"""The mHC mixing kernel (kernels/triton/mhc.py) against its plain-torch twin (kernels.reference_mhc.mhc_mix_ref,
the code models/blocks/hyperconnection.py runs on CPU), through Triton's interpreter on CPU.

Not bit for bit: the interpreter's exp is numpy's and torch's CPU sigmoid and softmax use their own
vectorised exp, each within an ulp or two of exact but not the same rounding, and the kernel's sums
run in a fixed order that torch's vectorised CPU reductions do not always take. The Sinkhorn loop's
2 * iters divisions carry those differences on: at 20 iterations they reach ~2e-6 relative (a few
tens of float32 ulps). rtol 1e-5 stays well below any difference that matters to the model's
residual mix while catching a wrong operation or order; atol 1e-12 only covers the tails of
saturated sigmoids (subnormal values where each ulp is a large relative step).
"""

import pytest
import torch

from tiermoe.kernels.reference_mhc import mhc_mix_ref
from tiermoe.kernels.triton.mhc import MAX_STREAMS, mhc_mix, mhc_mix_partials

EPS = 1e-6  # glm5_next's hc_eps
RTOL, ATOL = 1e-5, 1e-12
# large logits saturate the sigmoids (exp(-x) overflows to inf, as it does in torch) and make the softmax one-hot
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _inputs(t: int, n: int, device, seed: int = 0):
    """mix [T, (2+N)*N] with rows of magnitude 1, 1e4 and 30 in turn; base [(2+N)*N]; scale [3]."""
    gen = torch.Generator().manual_seed(seed + 97 * n + t)
    width = (2 + n) * n
    mag = torch.tensor([1.0, 1e4, 30.0]).repeat(t)[:t, None]  # [T, 1]
    mix = torch.randn(t, width, generator=gen) * mag
    base = torch.randn(width, generator=gen)
    scale = torch.rand(3, generator=gen) * 2
    return mix.to(device), base.to(device), scale.to(device)


def _check(t: int, n: int, iters: int, device) -> None:
    mix, base, scale = _inputs(t, n, device)
    got = mhc_mix(mix, base, scale, n, iters, EPS)
    want = mhc_mix_ref(mix, base, scale, n, iters, EPS)
    for name, g, w, shape in zip(("pre", "post", "comb"), got, want, ((t, n), (t, n), (t, n, n))):
        assert g.shape == shape and g.dtype == torch.float32, name
        torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("iters", [1, 20])
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("t", [1, 3, 7])
def test_kernel_matches_twin(t, n, iters, device):
    _check(t, n, iters, device)


@pytest.mark.parametrize("n", [1, 3, 5])
def test_stream_counts_not_a_power_of_two(n, device):
    """Padded lanes (N < the block) must not leak into the softmax or the Sinkhorn sums."""
    _check(3, n, 20, device)


def test_comb_is_doubly_stochastic_after_sinkhorn(device):
    """The property the Sinkhorn loop exists for, on the kernel's output: rows and columns sum to ~1
    (logits of magnitude 1: a one-hot softmax converges far more slowly)."""
    mix, base, scale = _inputs(1, 4, device)
    _, _, comb = mhc_mix(mix, base, scale, 4, 20, EPS)  # [1, 4, 4]
    ones = torch.ones(1, 4, device=device)
    torch.testing.assert_close(comb.sum(-1), ones, rtol=0, atol=1e-3)
    torch.testing.assert_close(comb.sum(-2), ones, rtol=0, atol=1e-5)  # the loop ends on the columns


@pytest.mark.parametrize("n, splits", [(4, 5), (3, 1)])
def test_partials_are_summed_then_scaled_by_the_norm(n, splits, device):
    """mhc_mix_partials = mhc_mix_ref of the partials' dots summed over the splits, times rsqrt(their sum of
    squares * inv_l + eps). The partials are multiples of 1/64, so their sum is exact in any order and only
    the rsqrt and the mixing round (splits: not a power of two, and one; n = 3: padded lanes)."""
    t, width, length = 3, (2 + n) * n, 256
    gen = torch.Generator().manual_seed(5 * n + splits)
    dots = torch.randint(-64, 65, (t, splits, width), generator=gen) / 64  # [T, S, W]
    sumsq = torch.rand(t, splits, 1, generator=gen) * length  # [T, S, 1]
    partials = torch.cat([dots, sumsq], dim=-1)  # [T, S, W + 1]
    _, base, scale = _inputs(t, n, "cpu")
    norm_eps, inv_l = 1e-6, 1 / length
    mix = dots.sum(1) * torch.rsqrt(sumsq.sum(1) * inv_l + norm_eps)  # [T, W]
    want = mhc_mix_ref(mix, base, scale, n, 20, EPS)
    got = mhc_mix_partials(partials.to(device), base.to(device), scale.to(device), n, 20, EPS, inv_l, norm_eps)
    for name, g, w in zip(("pre", "post", "comb"), got, want):
        torch.testing.assert_close(g.cpu(), w, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")


def test_no_tokens(device):
    mix, base, scale = _inputs(1, 4, device)
    pre, post, comb = mhc_mix(mix[:0], base, scale, 4, 20, EPS)
    assert pre.shape == (0, 4) and post.shape == (0, 4) and comb.shape == (0, 4, 4)


def test_rejects_what_it_cannot_compute(device):
    mix, base, scale = _inputs(1, 4, device)
    with pytest.raises(ValueError, match="streams"):
        mhc_mix(torch.zeros(1, (2 + MAX_STREAMS + 1) * (MAX_STREAMS + 1), device=device),
                torch.zeros((2 + MAX_STREAMS + 1) * (MAX_STREAMS + 1), device=device), scale, MAX_STREAMS + 1, 20, EPS)
    with pytest.raises(ValueError, match="mix"):
        mhc_mix(mix[:, :-1], base, scale, 4, 20, EPS)
    with pytest.raises(ValueError, match="mix"):
        mhc_mix(mix.double(), base, scale, 4, 20, EPS)
    with pytest.raises(ValueError, match="partials"):
        mhc_mix_partials(mix[:, None], base, scale, 4, 20, EPS, 1.0, EPS)  # no sum of squares column
    with pytest.raises(ValueError, match="partials"):
        mhc_mix_partials(torch.zeros(1, 0, 25, device=device), base, scale, 4, 20, EPS, 1.0, EPS)
