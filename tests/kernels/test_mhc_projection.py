"""The mHC mixing coefficients from the streams in two launches (kernels/triton/mhc_fused.py: hc_mix_coefficients,
split-K projection partials, then mhc.py's mixing kernel) against their plain-torch twin
(kernels.reference_mhc.hc_mix_coefficients_ref: flat RMS norm, F.linear in fp32, mhc_mix_ref), through
Triton's interpreter on CPU.

Not bit for bit, by design: the twin multiplies every value by the norm's rsqrt and then sums the products
with fn's rows in its own order; the kernel sums the raw products slice by slice, adds the slices and
multiplies the sum once. The mix differs by a few fp32 ulps of the sum of |products|; the sigmoids, the
softmax and the Sinkhorn divisions (2 * iters of them, test_mhc.py: ~2e-6 relative from the mixing alone)
carry that on. rtol 3e-5 (a few hundred fp32 ulps, a wrong operation or a lost slice is far beyond it) with
atol 1e-7 for comb entries near zero. Batch invariance is checked exactly.
"""

import pytest
import torch

from tiermoe.kernels import reference_mhc
from tiermoe.kernels.triton import mhc_fused
from tiermoe.kernels.triton.mhc_fused import hc_mix_coefficients

NORM_EPS, HC_EPS = 1e-6, 1e-6  # glm5_next's rms_norm_eps and hc_eps
RTOL, ATOL = 3e-5, 1e-7
# D = 80 and 100 leave the last slice of a token's N*D values partly empty (slices of 64 values here)
SHAPES = [(1, 4, 64), (2, 4, 80), (3, 2, 100), (5, 4, 64), (3, 3, 80)]  # (T, N, D)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _inputs(t: int, n: int, d: int, dtype: torch.dtype, device, seed: int = 0, mix: float = 3.0):
    """streams [T, N, D] with tokens of magnitude 1, 1e3 and 1e-3 in turn (the flat norm must not care; at
    1e-3 eps weighs in); fn fp32 [(2+N)*N, N*D] scaled so that mix is of magnitude `mix`; base [(2+N)*N];
    scale [3]."""
    gen = torch.Generator().manual_seed(seed + 1000 * n + d + t)
    mag = torch.tensor([1.0, 1e3, 1e-3]).repeat(t)[:t, None, None]  # [T, 1, 1]
    streams = (torch.randn(t, n, d, generator=gen) * mag).to(dtype)
    width = (2 + n) * n
    fn = torch.randn(width, n * d, generator=gen) * (mix / (n * d) ** 0.5)
    base = torch.randn(width, generator=gen)
    scale = torch.rand(3, generator=gen) * 2
    return tuple(x.to(device) for x in (streams, fn, base, scale))


def _both(streams, fn, base, scale, n: int, iters: int):
    got = hc_mix_coefficients(streams, fn, NORM_EPS, base, scale, n, iters, HC_EPS)
    want = reference_mhc.hc_mix_coefficients_ref(streams.cpu(), fn.cpu(), NORM_EPS, base.cpu(), scale.cpu(), n,
                                                 iters, HC_EPS)
    return got, want


def _check(got, want, t: int, n: int) -> None:
    for name, g, w, shape in zip(("pre", "post", "comb"), got, want, ((t, n), (t, n), (t, n, n))):
        assert g.shape == shape and g.dtype == torch.float32, name
        torch.testing.assert_close(g.cpu(), w, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t, n, d", SHAPES)
def test_kernels_match_twin(t, n, d, dtype, device):
    """4 Sinkhorn iterations: the projection is what is new here, the loop has test_mhc.py."""
    streams, fn, base, scale = _inputs(t, n, d, dtype, device)
    _check(*_both(streams, fn, base, scale, n, 4), t, n)


def test_slices_of_several_steps(device, monkeypatch):
    """Slices longer than a program's step (glm5_next: 256 values in steps of 128), the last one ragged."""
    monkeypatch.setattr(mhc_fused, "PROJ_BLOCK", 16)
    t, n, d = 2, 3, 80  # 240 values: slices of 64 in 4 steps of 16, the last slice 48 values
    streams, fn, base, scale = _inputs(t, n, d, torch.bfloat16, device)
    _check(*_both(streams, fn, base, scale, n, 4), t, n)


def test_twenty_iterations_stay_doubly_stochastic(device):
    """glm5_next's 20 Sinkhorn iterations end close to the twin, and comb keeps the property the loop exists
    for: rows and columns sum to ~1 (the loop ends on the columns). Logits of magnitude ~1: a near one-hot
    softmax converges far more slowly."""
    t, n, d = 2, 4, 64
    streams, fn, base, scale = _inputs(t, n, d, torch.bfloat16, device, mix=0.5)
    got, want = _both(streams, fn, base, scale, n, 20)
    _check(got, want, t, n)
    comb = got[2].cpu()  # [T, N, N]
    assert (comb > 0).all()
    torch.testing.assert_close(comb.sum(-1), torch.ones(t, n), rtol=0, atol=1e-3)
    torch.testing.assert_close(comb.sum(-2), torch.ones(t, n), rtol=0, atol=1e-5)


def test_a_token_gets_the_same_bits_alone_and_in_a_batch(device):
    """Batch invariance: each token of a batch of 4 has the bits it gets computed alone (T = 1)."""
    t, n, d = 4, 4, 80
    streams, fn, base, scale = _inputs(t, n, d, torch.bfloat16, device)
    batch = hc_mix_coefficients(streams, fn, NORM_EPS, base, scale, n, 4, HC_EPS)
    for i in range(t):
        alone = hc_mix_coefficients(streams[i:i + 1], fn, NORM_EPS, base, scale, n, 4, HC_EPS)
        for b, a in zip(batch, alone):
            assert torch.equal(b[i:i + 1], a), i


def test_bf16_weight_reads_as_its_fp32_cast(device):
    """fn in bf16 is read as its exact fp32 values: the same bits as the model's cached fp32 copy."""
    t, n, d = 2, 2, 64
    streams, fn, base, scale = _inputs(t, n, d, torch.bfloat16, device)
    fn16 = fn.to(torch.bfloat16)
    got = hc_mix_coefficients(streams, fn16, NORM_EPS, base, scale, n, 4, HC_EPS)
    want = hc_mix_coefficients(streams, fn16.float(), NORM_EPS, base, scale, n, 4, HC_EPS)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_no_tokens(device):
    streams, fn, base, scale = _inputs(1, 4, 64, torch.bfloat16, device)
    pre, post, comb = hc_mix_coefficients(streams[:0], fn, NORM_EPS, base, scale, 4, 20, HC_EPS)
    assert pre.shape == (0, 4) and post.shape == (0, 4) and comb.shape == (0, 4, 4)


def test_rejects_what_it_cannot_compute(device):
    streams, fn, base, scale = _inputs(2, 4, 64, torch.bfloat16, device)
    with pytest.raises(ValueError, match="streams"):
        hc_mix_coefficients(streams[:, 0], fn, NORM_EPS, base, scale, 4, 20, HC_EPS)
    with pytest.raises(ValueError, match="streams"):
        hc_mix_coefficients(streams[:, :3], fn, NORM_EPS, base, scale, 4, 20, HC_EPS)
    with pytest.raises(ValueError, match="fn"):
        hc_mix_coefficients(streams, fn[:, :-1], NORM_EPS, base, scale, 4, 20, HC_EPS)
    with pytest.raises(ValueError, match="fn"):
        hc_mix_coefficients(streams, fn.double(), NORM_EPS, base, scale, 4, 20, HC_EPS)
    with pytest.raises(ValueError, match="base"):
        hc_mix_coefficients(streams, fn, NORM_EPS, base[:-1], scale, 4, 20, HC_EPS)
