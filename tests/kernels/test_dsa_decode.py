"""The DSA decode selection kernels (kernels/triton/dsa_decode.py) against their plain-torch twins
(kernels.reference_dsa: DSAIndexer.select_decode's torch code, the CPU path), through Triton's interpreter on CPU.

Pool scores are compared with tolerances: the kernel sums the head dot products and the pool's channels in its
own order and its exp is numpy's (torch's CPU softmax has its own), so an fp32 score moves by a few ulps; in
bf16 a probability or product that rounds the other way moves a pool key by one bf16 ulp (2**-8 relative),
which moves a score by a few 1e-3 at these magnitudes (scores of order 1): rtol/atol 1e-2 leaves room without
hiding a wrong operation (a missing ape, softmax over the wrong axis, a missing scale or relu moves scores by
tens of percents). Incomplete pools must hold float32's lowest value exactly on both sides. The selection is
integers and must equal the twin's bit for bit, ties included.
"""

import pytest
import torch

from tiermoe.kernels.reference_dsa import dsa_pool_scores_ref, dsa_select_ref
from tiermoe.kernels.triton.dsa_decode import dsa_pool_scores, dsa_select
from tiermoe.models.blocks.attention import DSAIndexer

MIN = torch.finfo(torch.float32).min
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _score_inputs(lens: list[int], nh: int, d: int, p: int, lmax: int, dtype: torch.dtype, device, seed: int = 0):
    """(q [B, nh, d], w [B, nh] fp32, idx_rows [S, 2d], table_rows [B, Lmax], seq_lens [B], ape [P, d]).

    The row cache holds three tables' worth of rows and each sequence's positions sit at shuffled rows (pages
    anywhere); positions past a sequence's length point at row 0, as the engine's padding points at page 0.
    Gates of magnitude 2 make the pool softmax far from uniform."""
    gen = torch.Generator().manual_seed(seed + 7 * len(lens) + p)
    b, s = len(lens), 3 * lmax
    q = torch.randn(b, nh, d, generator=gen).to(dtype)
    w = torch.randn(b, nh, generator=gen)
    idx_rows = torch.cat([torch.randn(s, d, generator=gen), 2 * torch.randn(s, d, generator=gen)], 1).to(dtype)
    table = torch.stack([torch.randperm(s, generator=gen)[:lmax] for _ in range(b)])  # [B, Lmax]
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    table = table.masked_fill(torch.arange(lmax)[None, :] >= seq_lens[:, None], 0)
    ape = torch.randn(p, d, generator=gen).to(dtype)
    return tuple(t.to(device) for t in (q, w, idx_rows, table, seq_lens, ape))


# (heads, head dim, pool, table length, sequence lengths): glm5_next-like powers of two, then a padded shape
# (3 heads, 24 channels, 3-token pools). Lengths: exactly at a pool end, one short of it, shorter than one
# pool, the full table, a single token.
SHAPES = [(4, 16, 4, 16, [8, 7, 3, 16, 1]), (3, 24, 3, 15, [6, 5, 2, 15, 1])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("nh,d,p,lmax,lens", SHAPES)
@pytest.mark.parametrize("batch", [1, 5])
def test_pool_scores_match_twin(batch, nh, d, p, lmax, lens, dtype, device):
    lens = lens[:batch] if batch > 1 else [lmax]
    args = _score_inputs(lens, nh, d, p, lmax, dtype, device)
    got = dsa_pool_scores(*args, p)
    want = dsa_pool_scores_ref(*args, p)
    assert got.shape == (batch, lmax // p) and got.dtype == torch.float32
    complete = torch.arange(lmax // p)[None, :] < torch.tensor(lens)[:, None] // p  # [B, np]
    assert torch.equal(got.cpu() == MIN, ~complete) and torch.equal(want.cpu() == MIN, ~complete)
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])
    assert got.cpu()[complete].abs().max() > 0.1  # real scores, not a degenerate all-zero case


def test_pool_scores_read_only_complete_pools(device):
    """Rows of positions past the last complete pool are never read: NaN there changes nothing (the twin's
    scores of those pools are NaN before its mask)."""
    lens, p, lmax = [6, 9], 4, 16
    q, w, idx_rows, _, seq_lens, ape = _score_inputs(lens, 4, 16, p, lmax, torch.float32, device, seed=1)
    gen = torch.Generator().manual_seed(5)
    table = torch.randperm(idx_rows.shape[0], generator=gen)[: 2 * lmax].view(2, lmax).to(device)  # no row shared
    want = dsa_pool_scores(q, w, idx_rows, table, seq_lens, ape, p)
    poisoned = idx_rows.clone()
    for b, n in enumerate(lens):
        poisoned[table[b, n // p * p:]] = float("nan")  # the incomplete pool and the padding
    got = dsa_pool_scores(q, w, poisoned, table, seq_lens, ape, p)
    assert not got.isnan().any() and torch.equal(got, want)
    assert torch.equal(dsa_pool_scores_ref(q, w, poisoned, table, seq_lens, ape, p).isnan(), torch.zeros_like(got,
                       dtype=torch.bool))


def _selection_scores(p: int, npools: int, lens: list[int]) -> torch.Tensor:
    """[B, np] scores, one pattern a sequence, incomplete pools at float32's lowest as dsa_pool_scores leaves
    them: exact zeros of both signs with a few positives (relu), few distinct values (ties), all equal, random
    with negatives and -inf, and an unmasked random row (the rule comes from seq_lens, not the scores)."""
    gen = torch.Generator().manual_seed(npools + p)
    zeros = torch.where(torch.rand(npools, generator=gen) < 0.7, 0.0, torch.rand(npools, generator=gen))
    zeros[::3] = -0.0
    ties = torch.randint(0, 3, (npools,), generator=gen).float()
    random = torch.randn(npools, generator=gen)
    random[1] = float("-inf")
    rows = [zeros, ties, torch.ones(npools), random, torch.randn(npools, generator=gen)]
    scores = torch.stack([rows[i % len(rows)] for i in range(len(lens))])  # [B, np]
    incomplete = torch.arange(npools)[None, :] >= torch.tensor(lens)[:, None] // p
    incomplete[-1] = False
    return scores.masked_fill(incomplete, MIN)


# (k, pool size, tail): each k (below the pool count, equal to it, above it: clamped) with and without the tail,
# glm5_next-like 4-token pools, single-token pools (no tail columns) and 3-token ones (odd pool edges)
SELECTIONS = [("few", 4, True), ("few", 4, False), ("all", 4, True), ("more", 4, False), ("few", 1, True),
              ("all", 1, False), ("few", 3, True), ("more", 3, True)]


@pytest.mark.parametrize("k,p,tail", SELECTIONS)
def test_selection_equals_twin(k, p, tail, device):
    """Bit for bit, ties included; k below the pool count, equal to it and above it (clamped), lengths with
    fewer complete pools than k, at a pool end, one past it, and the full table."""
    npools = 8
    lens = [1, p, p + 1, 2 * p - 1, 5 * p, npools * p - 1, npools * p]
    topk = {"few": 3, "all": npools, "more": npools + 3}[k]
    width = topk * p + (p - 1 if tail else 0)
    scores = _selection_scores(p, npools, lens).to(device)
    seq_lens = torch.tensor(lens, device=device)
    got = dsa_select(scores, seq_lens, topk, p, tail, width)
    want = dsa_select_ref(scores, seq_lens, topk, p, tail, width)
    assert got.dtype == torch.long and got.shape == (len(lens), width)
    assert torch.equal(got, want)
    assert (got >= 0).sum() > len(lens)  # picks and tails, not an all -1 list


def test_selection_ties_go_to_the_lower_pool(device):
    """All-zero scores (-0 and +0 alike): the lowest pools win, in pool order; then three clear winners."""
    p, npools = 4, 10
    scores = torch.zeros(1, npools)
    scores[0, 1::2] = -0.0
    seq_lens = torch.tensor([npools * p + 2], device=device)
    got = dsa_select(scores.to(device), seq_lens, 3, p, True, 3 * p + p - 1)
    assert got.cpu().tolist() == [list(range(3 * p)) + [40, 41, -1]]
    scores[0, [7, 2, 9]] = torch.tensor([1.0, 3.0, 2.0])
    got = dsa_select(scores.to(device), seq_lens, 4, p, False, 4 * p)
    assert got.cpu().view(4, p)[:, 0].tolist() == [2 * p, 9 * p, 7 * p, 0]


def test_no_complete_pool_in_the_table(device):
    """A table shorter than one pool: no pool slots, only the tail (the twin's empty case)."""
    args = _score_inputs([2, 3], 4, 16, 4, 3, torch.float32, device)
    scores = dsa_pool_scores(*args, 4)
    assert scores.shape == (2, 0)
    got = dsa_select(scores, args[4], 2, 4, True, 11)
    assert torch.equal(got, dsa_select_ref(dsa_pool_scores_ref(*args, 4), args[4], 2, 4, True, 11))
    assert got.cpu()[:, :3].tolist() == [[0, 1, -1], [0, 1, 2]]


def test_select_decode_kernel_path_equals_twin_path(device):
    """The whole decode selection: the two kernels (what select_decode runs on CUDA) give the twins' lists, and
    both give each sequence `select`'s list over its own rows. The scores are checked to be well apart (the
    premise: float32 rounding cannot reorder them)."""
    torch.manual_seed(0)
    indexer = DSAIndexer(32, 16, 4, 16, topk=8, kpool=4, always_select_tail=True)
    with torch.no_grad():
        indexer.index_kpool_compress_ape.normal_()
    lens, lmax = [1, 3, 4, 5, 8, 13, 24], 24
    q, w, idx_rows, table, seq_lens, _ = _score_inputs(lens, 4, 16, 4, lmax, torch.float32, "cpu", seed=2)
    ape = indexer.index_kpool_compress_ape.detach()
    with torch.no_grad():
        want = indexer.select_decode(q, w, idx_rows, table, seq_lens)  # CPU: the twins
        for b, n in enumerate(lens):
            own = indexer.select(q[b:b + 1], w[b:b + 1], idx_rows[table[b, :n]], n - 1)
            assert torch.equal(want[b:b + 1], own), n
        ref_scores = dsa_pool_scores_ref(q, w, idx_rows, table, seq_lens, ape, 4)
        for row in ref_scores:
            real = row[row > MIN].sort().values
            assert (real[1:] - real[:-1]).min() > 1e-4 if real.numel() > 1 else True
        on = [t.to(device) for t in (q, w, idx_rows, table, seq_lens)]
        scores = dsa_pool_scores(*on, ape.to(device), 4)
        got = dsa_select(scores, on[4], indexer.topk // indexer.kpool, indexer.kpool, indexer.tail, indexer.width)
        assert torch.equal(got.cpu(), want)
        if on[0].is_cuda:  # on a GPU run select_decode takes the kernels itself
            assert torch.equal(indexer.to(device).select_decode(*on).cpu(), want)
