"""The fused mHC kernels around a sub-block (kernels/triton/mhc_fused.py: hc_collapse_norm, hc_post) against their
plain-torch twins (kernels/reference_mhc.py, the code models/blocks/hyperconnection.py runs on CPU), through
Triton's interpreter on CPU; hc_mix_coefficients has test_mhc_projection.py.

Tolerances, and why they are not zero:
  - hc_collapse_norm (out in the model dtype): the collapse adds the same fp32 products in the same
    stream order as torch, so it is exact; only the RMS statistic differs: the kernel adds the squares
    in a tree of its own, torch's CPU sum in another, and multiplies the sum by fp32(1 / count) where
    torch's CPU mean divides, a few float32 ulps. At bf16 an element whose normalised value lies within
    a few fp32 ulps of a rounding boundary can land one bf16 ulp away: checked as at most 1 ulp anywhere
    and bit for bit on 99% of the values. At fp32 the statistic's few ulps pass straight through: rtol 1e-5.
  - hc_post: bf16 products of bf16 values are exact in fp32 and the mix adds them in stream order, as
    torch's K = N matmul does, so bf16 results could differ by 1 ulp only through a summation order
    (the bf16 check above). At fp32 torch's CPU matmul contracts into FMAs and the kernel does not (it
    follows eager GPU torch), a few fp32 ulps of the larger term: rtol 1e-5 with atol 1e-6 for values
    of magnitude 1 where the spread and the mix nearly cancel.
Batch invariance is checked exactly: a token's result must not depend on the tokens beside it.
"""

import pytest
import torch
import triton
import triton.language as tl

from tiermoe.kernels.reference_mhc import hc_collapse_norm_ref, hc_post_ref
from tiermoe.kernels.triton.mhc_fused import hc_collapse_norm, hc_post
from tiermoe.kernels.triton.norm import PRECISE, round_to

EPS = 1e-6  # glm5_next's rms_norm_eps
DTYPES = [torch.bfloat16, torch.float32]
SHAPES = [(1, 4, 64), (3, 4, 64), (3, 4, 80), (3, 3, 80), (1, 4, 4096), (3, 4, 4096)]  # (T, N, D)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place between bf16 tensors (0 for -0 vs +0)."""
    def ordered(x):
        i = x.cpu().contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i + (1 << 15)), i)

    return (ordered(a) - ordered(b)).abs()


def check_rounded(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16: at most 1 ulp apart, nearly all bit for bit (a rare boundary case may move); fp32: rtol 1e-5."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.bfloat16:
        d = ulps(got, want)
        assert int(d.max()) <= 1, f"{int(d.max())} ulps apart"
        assert float((d == 0).float().mean()) >= 0.99
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-12)


def _streams(t: int, n: int, d: int, dtype: torch.dtype, device, seed: int = 0) -> torch.Tensor:
    """[T, N, D] with tokens of magnitude 1, 1e3 and 1e-3 in turn (the norms must not care)."""
    gen = torch.Generator().manual_seed(seed + 1000 * n + d + t)
    mag = torch.tensor([1.0, 1e3, 1e-3]).repeat(t)[:t, None, None]  # [T, 1, 1]
    return (torch.randn(t, n, d, generator=gen) * mag).to(dtype).to(device)


def _coefficients(t: int, n: int, device, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pre [T, N] (sigmoid + eps range), post [T, N] (2 * sigmoid range), comb [T, N, N] (about doubly
    stochastic), all fp32, as mhc_mix hands them on."""
    gen = torch.Generator().manual_seed(seed + 10 * n + t)
    pre = torch.rand(t, n, generator=gen) + 1e-6
    post = 2 * torch.rand(t, n, generator=gen)
    comb = torch.softmax(torch.randn(t, n, n, generator=gen), dim=-1)
    return pre.to(device), post.to(device), comb.to(device)


@pytest.mark.parametrize("weight_dtype", ["same", torch.float32])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, n, d", SHAPES)
def test_collapse_norm_matches_twin(t, n, d, dtype, weight_dtype, device):
    """The weight in the streams' dtype (as loaded) or in fp32 (the result is then fp32, as in torch)."""
    streams = _streams(t, n, d, dtype, device)
    pre, _, _ = _coefficients(t, n, device)
    gen = torch.Generator().manual_seed(d)
    weight = (1 + 0.5 * torch.randn(d, generator=gen)).to(dtype if weight_dtype == "same" else weight_dtype)
    weight = weight.to(device)
    got = hc_collapse_norm(streams, pre, weight, EPS)
    want = hc_collapse_norm_ref(streams, pre, weight, EPS)
    assert got.shape == (t, d)
    check_rounded(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, n, d", SHAPES)
def test_post_matches_twin(t, n, d, dtype, device):
    residual = _streams(t, n, d, dtype, device)
    out = _streams(t, 1, d, dtype, device, seed=7)[:, 0]  # [T, D]
    _, post, comb = _coefficients(t, n, device)
    got = hc_post(out, residual, post, comb)
    want = hc_post_ref(out, residual, post, comb)
    assert got.shape == (t, n, d)
    if dtype == torch.bfloat16:
        check_rounded(got, want)
    else:
        scale = want.abs().amax(dim=(1, 2), keepdim=True)  # [T, 1, 1]: tokens differ in magnitude
        torch.testing.assert_close(got / scale, want / scale, rtol=1e-5, atol=1e-6)


def test_each_token_alone_gives_the_same_bits(device):
    """Batch invariance: every kernel's result for a token is the same bits in a batch of 3 and on its own."""
    t, n, d = 3, 4, 80
    streams = _streams(t, n, d, torch.bfloat16, device)
    out = _streams(t, 1, d, torch.bfloat16, device, seed=7)[:, 0]
    pre, post, comb = _coefficients(t, n, device)
    weight = torch.linspace(0.5, 1.5, d).to(torch.bfloat16).to(device)
    batch = (hc_collapse_norm(streams, pre, weight, EPS), hc_post(out, streams, post, comb))
    for i in range(t):
        s = slice(i, i + 1)
        alone = (hc_collapse_norm(streams[s], pre[s], weight, EPS), hc_post(out[s], streams[s], post[s], comb[s]))
        for b, a in zip(batch, alone):
            assert torch.equal(b[s], a)


def test_no_tokens(device):
    streams = _streams(1, 4, 64, torch.bfloat16, device)[:0]
    pre, post, comb = (x[:0] for x in _coefficients(1, 4, device))
    weight = torch.ones(64, dtype=torch.bfloat16, device=device)
    assert hc_collapse_norm(streams, pre, weight, EPS).shape == (0, 64)
    assert hc_post(streams[:, 0], streams, post, comb).shape == (0, 4, 64)


def test_rejects_what_it_cannot_compute(device):
    streams = _streams(2, 4, 64, torch.bfloat16, device)
    pre, post, comb = _coefficients(2, 4, device)
    weight = torch.ones(64, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="streams"):
        hc_collapse_norm(streams[:, 0], pre, weight, EPS)
    with pytest.raises(ValueError, match="streams"):
        hc_collapse_norm(streams.to(torch.int32), pre, weight, EPS)
    with pytest.raises(ValueError, match="pre"):
        hc_collapse_norm(streams, pre.double(), weight, EPS)
    with pytest.raises(ValueError, match="weight"):
        hc_collapse_norm(streams, pre, weight[:-1], EPS)
    with pytest.raises(ValueError, match="out"):
        hc_post(streams[:, 0].float(), streams, post, comb)
    with pytest.raises(ValueError, match="comb"):
        hc_post(streams[:, 0], streams, post, comb[:, :-1])


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, PRECISE: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, round_to(x, out_ptr.dtype.element_ty, PRECISE), mask=offs < n)


def test_round_to_bf16_is_torchs_rounding(device):
    """round_to (every bf16 cast in these kernels) rounds to nearest even, as torch's .to(bfloat16) does:
    ties both ways, carries into the exponent, overflow to inf, subnormals, signed zeros, inf and NaN."""
    ties = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x3F80C000, 0x3F807FFF, 0x3FFF8000,
                         0x7F7F8000, 0x7F7FFFFF, 0x00008000, 0x00018000, 0x80000000, 0x7F800000, 0xFF800000],
                        dtype=torch.int64).to(torch.int32).view(torch.float32)
    gen = torch.Generator().manual_seed(3)
    x = torch.cat([ties, torch.randn(200, generator=gen) * 10.0 ** torch.randint(-30, 30, (200,), generator=gen),
                   torch.tensor([float("nan")])])
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=device)
    _round_kernel[(1,)](x.to(device), out, x.numel(), BLOCK=triton.next_power_of_2(x.numel()), PRECISE=PRECISE)
    want = x.to(torch.bfloat16)
    assert torch.equal(out[:-1].cpu().view(torch.int16), want[:-1].view(torch.int16))
    assert out[-1].isnan()
