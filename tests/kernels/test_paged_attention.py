"""Paged decode attention kernel vs its plain-torch twin (CPU through Triton's interpreter;
TIERMOE_KERNEL_TESTS_ON_GPU=1 compiles it on CUDA instead)."""

import pytest
import torch

from tiermoe.kernels.reference import paged_decode_attention_ref
from tiermoe.kernels.triton.paged_attention import num_splits, paged_decode_attention


def _case(device, dtype, lens, hq=8, hk=2, dim=64, page=16, max_blocks=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_pages = len(lens) * max_blocks + 3
    k = torch.randn(num_pages * page, hk, dim, generator=gen).to(dtype)
    v = torch.randn(num_pages * page, hk, dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), hq, dim, generator=gen).to(dtype)
    # every sequence's pages scattered over the cache, padded with page 0 beyond its length
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    for b, n in enumerate(lens):
        used = -(-n // page)
        table[b, :used] = perm[b * max_blocks : b * max_blocks + used].to(torch.int32)
    to = lambda t: t.to(device)  # noqa: E731
    return to(q), to(k), to(v), to(table), to(torch.tensor(lens, dtype=torch.int32))


@pytest.mark.parametrize("lens", [[1], [17], [5, 160, 33], [191, 2]])
def test_matches_twin_fp32(device, lens):
    q, k, v, table, seq_lens = _case(device, torch.float32, lens)
    out = paged_decode_attention(q, k, v, table, seq_lens, 0.125, 16)
    ref = paged_decode_attention_ref(q, k, v, table, seq_lens, 0.125, 16)
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_matches_twin_bf16_with_uneven_heads_and_dim(device):
    # 12 query heads over 4 KV heads (G = 3, padded), head dim 80 (padded to 128)
    q, k, v, table, seq_lens = _case(device, torch.bfloat16, [40, 7, 129], hq=12, hk=4, dim=80, seed=3)
    out = paged_decode_attention(q, k, v, table, seq_lens, 80**-0.5, 16)
    ref = paged_decode_attention_ref(q, k, v, table, seq_lens, 80**-0.5, 16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_each_sequence_is_independent_of_the_batch(device):
    """A sequence gives the same bits alone and in a batch (the split count ignores the batch)."""
    q, k, v, table, seq_lens = _case(device, torch.float32, [70, 3, 150])
    both = paged_decode_attention(q, k, v, table, seq_lens, 0.125, 16)
    for b in range(3):
        alone = paged_decode_attention(q[b : b + 1], k, v, table[b : b + 1], seq_lens[b : b + 1], 0.125, 16)
        assert torch.equal(alone, both[b : b + 1])


def test_rejects_shapes_it_cannot_serve(device):
    q, k, v, table, seq_lens = _case(device, torch.float32, [5])
    with pytest.raises(ValueError, match="page size"):
        paged_decode_attention(q, k, v, table, seq_lens, 0.125, 8)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(q[:, :7], k, v, table, seq_lens, 0.125, 16)


def test_split_count_fills_the_gpu_at_batch_one():
    assert num_splits(4, 1300) == 32  # Qwen3-235B: 4 KV heads -> 128 programs per sequence
    assert num_splits(16, 1300) == 16
    assert num_splits(4, 3) == 3  # never more splits than blocks
    assert num_splits(512, 1300) == 1


def test_an_empty_context_gives_zeros_not_nan(device):
    q, k, v, table, seq_lens = _case(device, torch.float32, [0, 5])
    out = paged_decode_attention(q, k, v, table, seq_lens, 0.125, 16)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out[1:], paged_decode_attention_ref(q[1:], k, v, table[1:], seq_lens[1:], 0.125, 16),
                               rtol=1e-5, atol=1e-5)
