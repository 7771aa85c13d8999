"""Decode attention on CUDA avoids cuDNN's SDPA (a plan build per context length and per thread),
and the decode call gives the same values inside and outside that backend choice."""

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tiermoe.models.blocks import attention


def test_decode_backends_leave_out_cudnn_only():
    assert SDPBackend.CUDNN_ATTENTION not in attention.DECODE_SDPA_BACKENDS
    assert set(attention.DECODE_SDPA_BACKENDS) == {SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                                   SDPBackend.MATH}


def test_one_token_query_is_the_same_under_the_decode_backends():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 16, generator=gen)  # [q, Hq, D]
    k, v = torch.randn(9, 2, 16, generator=gen), torch.randn(9, 2, 16, generator=gen)  # [ctx, Hk, D]
    plain = attention._attend(q, k, v, 0.25)
    with sdpa_kernel(attention.DECODE_SDPA_BACKENDS):
        scoped = attention._attend(q, k, v, 0.25)
    kr, vr = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)  # [ctx, Hq, D]
    p = torch.softmax(torch.einsum("hd,nhd->hn", q[0], kr) * 0.25, -1)  # [Hq, ctx]
    ref = torch.einsum("hn,nhd->hd", p, vr)  # [Hq, D]
    assert torch.equal(plain, scoped) and plain.shape == (1, 8, 16)
    torch.testing.assert_close(plain[0], ref, rtol=1e-5, atol=1e-5)
