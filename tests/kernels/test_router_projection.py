"""The sigmoid noaux_tc routing from the hidden states in two launches (kernels/triton/router.py:
sigmoid_topk_route_from_hidden, split-K projection partials, then the routing kernel summing them) against its
plain-torch twin (kernels.reference_router.sigmoid_topk_route_from_hidden_ref: F.linear in fp32, then
sigmoid_topk_route_ref), through Triton's interpreter on CPU.

Not bit for bit, by design: the kernel adds a token's products slice by slice and then the slices, the twin's
F.linear in its own order, so the logits differ by a few fp32 ulps of the sum of |products|. Picks agree where
biased scores are further apart than that: the inputs take rows of magnitude 2, 30 (sigmoids saturated to
exactly 0 or 1: a Gaussian bias of 0.1 decides) and 0.5 in turn, so neighbouring scores at the k-th place lie
orders of magnitude further apart than the logits' rounding. Ids are compared as sets per token, weights per id
with rtol 2e-6: a sigmoid of a logit off by a few ulps (its slope is at most 1/4), then test_router.py's few
ulps of the sum, division and scaling; a lost slice, block or expert moves a weight by percents. Replayed ids
may be ones the router would never pick, with logits down to about -30: there the sigmoid is ~exp(logit) and a
weight's relative error is the logit's absolute one, a few ulps of 16..32 (~2e-6 each), so rtol 2e-5 for them.
Batch invariance is checked exactly.
"""

import pytest
import torch
import torch.nn.functional as F

from tiermoe.kernels import reference_router
from tiermoe.kernels.triton import router
from tiermoe.kernels.triton.router import sigmoid_topk_route_from_hidden
from tiermoe.models.blocks.router import Router
from tiermoe.models.spec import MoESpec

RTOL, ATOL = 2e-6, 0.0
RTOL_REPLAY = 2e-5  # weights of replayed ids with logits far below 0
SCALE = 2.5  # glm5_next's routed_scaling_factor
# (experts, hidden, top-k, groups, groups kept). H = 200 and 100 leave the last slice of a token's values partly
# empty (slices of 64 values here); E = 72 and 40 leave the last block of 32 experts partly empty; GLM-5.3's
# 288 experts have test_glm53_size (the interpreter takes seconds for them).
CONFIGS = [(72, 200, 8, 1, 1), (64, 100, 6, 8, 4), (40, 64, 4, 1, 1)]
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _inputs(t: int, e: int, h: int, dtype: torch.dtype, device, seed: int = 0):
    """x [T, H] in dtype, rows of magnitude 2, 30 and 0.5 in turn; weight fp32 [E, H] scaled so that the logits
    have the rows' magnitude; bias fp32 [E] of magnitude 0.1 (enough to change picks)."""
    gen = torch.Generator().manual_seed(seed + 131 * e + 7 * h + t)
    mag = torch.tensor([2.0, 30.0, 0.5]).repeat(t)[:t, None]  # [T, 1]
    x = (torch.randn(t, h, generator=gen) * mag).to(dtype)  # [T, H]
    weight = torch.randn(e, h, generator=gen) / h**0.5  # [E, H]
    bias = torch.randn(e, generator=gen) * 0.1  # [E]
    return x.to(device), weight.to(device), bias.to(device)


def _by_id(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k], weights [T, k] -> both sorted by id within each token (the set, and each id's weight)."""
    sorted_ids, order = ids.sort(dim=1)
    return sorted_ids, weights.gather(1, order)


def _both(x, weight, bias, k: int, groups: int, keep: int, norm: bool, replay=None):
    got = sigmoid_topk_route_from_hidden(x, weight, bias, k, groups, keep, norm, SCALE, replay)
    want = reference_router.sigmoid_topk_route_from_hidden_ref(x.cpu(), weight.cpu(), bias.cpu(), k, groups, keep,
                                                                norm, SCALE, None if replay is None else replay.cpu())
    return got, want


def _check(got, want, t: int, k: int) -> None:
    (ids, w), (ref_ids, ref_w) = got, want
    assert ids.shape == (t, k) and ids.dtype == torch.int64 and w.shape == (t, k) and w.dtype == torch.float32
    ids, w = _by_id(ids.cpu(), w.cpu())
    ref_ids, ref_w = _by_id(ref_ids, ref_w)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("e,h,k,groups,keep", CONFIGS)
@pytest.mark.parametrize("t", [1, 2, 3, 5])
def test_kernels_match_twin(t, e, h, k, groups, keep, device):
    x, weight, bias = _inputs(t, e, h, torch.bfloat16, device)
    got, want = _both(x, weight, bias, k, groups, keep, True)
    _check(got, want, t, k)
    logits = x.cpu().float() @ weight.cpu().T  # [T, E]
    choice = (logits.sigmoid() + bias.cpu()).gather(1, got[0].cpu())  # [T, k]
    assert (choice[:, :-1] >= choice[:, 1:]).all(), "ids not in descending biased-score order"


@pytest.mark.parametrize("e,h,k,groups,keep", CONFIGS)
def test_without_renormalisation(e, h, k, groups, keep, device):
    x, weight, bias = _inputs(3, e, h, torch.bfloat16, device, seed=2)
    _check(*_both(x, weight, bias, k, groups, keep, False), 3, k)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_activation_dtypes(dtype, device):
    """x in fp16 or fp32 is read as its exact fp32 values, as x.float() gives them."""
    x, weight, bias = _inputs(3, 64, 100, dtype, device, seed=3)
    _check(*_both(x, weight, bias, 6, 8, 4, True), 3, 6)


def test_slices_of_several_steps(device, monkeypatch):
    """Slices longer than a program's step (GLM-5.3: 256 values in steps of 128), the last one ragged."""
    monkeypatch.setattr(router, "PROJ_BLOCK", 16)
    x, weight, bias = _inputs(2, 64, 200, torch.bfloat16, device, seed=4)  # slices of 64 in 4 steps, the last 8
    _check(*_both(x, weight, bias, 6, 8, 4, True), 2, 6)


def test_glm53_size(device):
    """GLM-5.3's gate at full size (288 experts, H = 4096: 9 blocks x 16 slices of 256 values, two steps each)."""
    x, weight, bias = _inputs(1, 288, 4096, torch.bfloat16, device, seed=5)
    _check(*_both(x, weight, bias, 8, 1, 1, True), 1, 8)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("e,h,k,groups,keep", CONFIGS)
def test_replayed_ids(e, h, k, groups, keep, norm, device):
    """Routing replay: the given ids come back in their order, with the twin's weights for them."""
    t = 3
    x, weight, bias = _inputs(t, e, h, torch.bfloat16, device, seed=1)
    gen = torch.Generator().manual_seed(t + e)
    replay = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(device)  # [T, k] long
    (ids, w), (ref_ids, ref_w) = _both(x, weight, bias, k, groups, keep, norm, replay)
    assert torch.equal(ids, replay) and torch.equal(ref_ids, replay.cpu())
    torch.testing.assert_close(w.cpu(), ref_w, rtol=RTOL_REPLAY, atol=ATOL)


@pytest.mark.parametrize("e,h,k,groups,keep", CONFIGS[:2])
def test_a_token_gets_the_same_bits_alone_and_in_a_batch(e, h, k, groups, keep, device):
    """Batch invariance: each token of a batch of 4 has the ids and weight bits it gets routed alone (T = 1)."""
    x, weight, bias = _inputs(4, e, h, torch.bfloat16, device, seed=6)
    batch = sigmoid_topk_route_from_hidden(x, weight, bias, k, groups, keep, True, SCALE)
    for i in range(4):
        alone = sigmoid_topk_route_from_hidden(x[i:i + 1], weight, bias, k, groups, keep, True, SCALE)
        for b, a in zip(batch, alone):
            assert torch.equal(b[i:i + 1], a), i


def test_bf16_weight_reads_as_its_fp32_cast(device):
    """A bf16 gate weight is read as its exact fp32 values: the same bits as its fp32 copy."""
    x, weight, bias = _inputs(2, 64, 100, torch.bfloat16, device, seed=7)
    w16 = weight.to(torch.bfloat16)
    got = sigmoid_topk_route_from_hidden(x, w16, bias, 6, 8, 4, True, SCALE)
    want = sigmoid_topk_route_from_hidden(x, w16.float(), bias, 6, 8, 4, True, SCALE)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_no_tokens(device):
    x, weight, bias = _inputs(1, 64, 100, torch.bfloat16, device)
    ids, w = sigmoid_topk_route_from_hidden(x[:0], weight, bias, 6, 8, 4, True, SCALE)
    assert ids.shape == (0, 6) and w.shape == (0, 6)


def test_rejects_what_it_cannot_compute(device):
    x, weight, bias = _inputs(2, 64, 100, torch.bfloat16, device)
    with pytest.raises(ValueError, match="x"):
        sigmoid_topk_route_from_hidden(x.double(), weight, bias, 6, 8, 4, True, SCALE)
    with pytest.raises(ValueError, match="weight"):
        sigmoid_topk_route_from_hidden(x, weight.double(), bias, 6, 8, 4, True, SCALE)
    with pytest.raises(ValueError, match="share H"):
        sigmoid_topk_route_from_hidden(x, weight[:, :-1], bias, 6, 8, 4, True, SCALE)
    with pytest.raises(ValueError, match="bias"):
        sigmoid_topk_route_from_hidden(x, weight, bias[:-1], 6, 8, 4, True, SCALE)
    with pytest.raises(ValueError, match="groups"):
        sigmoid_topk_route_from_hidden(x, weight, bias, 6, 5, 4, True, SCALE)
    with pytest.raises(ValueError, match="replay_ids"):
        sigmoid_topk_route_from_hidden(x, weight, bias, 6, 8, 4, True, SCALE,
                                       torch.zeros(2, 5, dtype=torch.long, device=device))


@pytest.mark.parametrize("grad", [False, True])
def test_router_on_cpu_is_the_old_torch_code(grad):
    """models/blocks/router.py on CPU (and wherever a gradient is needed) computes what it computed before the
    kernels took the projection: F.linear(x.float(), weight.float()), then sigmoid_topk_route_ref, bit for bit;
    bf16 x and a bf16 gate weight (older transformers' glm4_moe / deepseek_v3) take the casts."""
    spec = MoESpec(num_experts=64, top_k=6, intermediate_size=8, scoring="sigmoid_noaux", norm_topk_prob=True,
                   routed_scaling_factor=SCALE, n_group=8, topk_group=4)
    layer = Router(spec, 32)
    gen = torch.Generator().manual_seed(8)
    layer.weight = torch.nn.Parameter(torch.randn(64, 32, generator=gen).to(torch.bfloat16), requires_grad=grad)
    layer.e_score_correction_bias = torch.nn.Parameter(torch.randn(64, generator=gen) * 0.1, requires_grad=False)
    x = torch.randn(5, 32, generator=gen).to(torch.bfloat16)
    with torch.set_grad_enabled(grad):
        ids, w = layer(x)
        want = reference_router.sigmoid_topk_route_ref(F.linear(x.float(), layer.weight.float()),
                                                       layer.e_score_correction_bias.float(), 6, 8, 4, True, SCALE)
    assert torch.equal(ids, want[0]) and torch.equal(w, want[1])
    assert w.requires_grad == grad
