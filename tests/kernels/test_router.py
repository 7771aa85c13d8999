"""The sigmoid noaux_tc routing kernel (kernels/triton/router.py) against its plain-torch twin
(kernels.reference_router.sigmoid_topk_route_ref, the code models/blocks/router.py runs on CPU), through
Triton's interpreter on CPU.

Ids are compared as sets per token: the kernel returns them in descending biased-score order, the twin in
torch.topk(sorted=False)'s unspecified order. The inputs keep the biased scores of a token well apart (a
Gaussian bias of 0.1 on top of sigmoids), so both pick the same set although their exps differ in the last
bit. Weights are compared per id, not bit for bit: the interpreter's exp is numpy's and torch's CPU sigmoid
uses its own vectorised exp (each within an ulp or two of exact, not the same rounding), and the kernel sums
the k weights in pick order where torch's CPU sum takes its own. A sigmoid, a k-term sum, a division and a
scaling carry a few float32 ulps (at most ~2e-7 relative seen), so rtol 1e-6 leaves room without hiding a
wrong operation (a missing bias, renormalisation or scale moves a weight by percents); no atol: every weight
here is a normal float, where a relative bound holds.
"""

import pytest
import torch
import torch.nn.functional as F

from tiermoe.kernels.reference_router import sigmoid_topk_route_ref
from tiermoe.kernels.triton.router import sigmoid_topk_route
from tiermoe.models.blocks.router import Router
from tiermoe.models.spec import MoESpec

RTOL, ATOL = 1e-6, 0.0
SCALE = 2.5  # glm5_next's routed_scaling_factor
# (experts, top-k, groups, groups kept): glm5_next at full width; a grouped, DeepSeek-V3-style layer
CONFIGS = [(288, 8, 1, 1), (64, 6, 8, 4)]
# logits of -1e4 saturate the sigmoid: exp(1e4) overflows to inf (as in torch), the score is exactly 0
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _inputs(t: int, e: int, device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits fp32 [T, E] with rows of magnitude 2, 30 (saturated sigmoids: the bias decides) and 0.5 in turn;
    bias fp32 [E] of magnitude 0.1 (enough to change picks)."""
    gen = torch.Generator().manual_seed(seed + 131 * e + t)
    mag = torch.tensor([2.0, 30.0, 0.5]).repeat(t)[:t, None]  # [T, 1]
    logits = torch.randn(t, e, generator=gen) * mag
    bias = torch.randn(e, generator=gen) * 0.1
    return logits.to(device), bias.to(device)


def _by_id(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k], weights [T, k] -> both sorted by id within each token (the set, and each id's weight)."""
    sorted_ids, order = ids.sort(dim=1)
    return sorted_ids, weights.gather(1, order)


def _check(got, want, t: int, k: int) -> None:
    (ids, w), (ref_ids, ref_w) = got, want
    assert ids.shape == (t, k) and ids.dtype == torch.int64 and w.shape == (t, k) and w.dtype == torch.float32
    ids, w = _by_id(ids.cpu(), w.cpu())
    ref_ids, ref_w = _by_id(ref_ids.cpu(), ref_w.cpu())
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("e,k,groups,keep", CONFIGS)
@pytest.mark.parametrize("t", [1, 5])
def test_kernel_matches_twin(t, e, k, groups, keep, norm, device):
    logits, bias = _inputs(t, e, device)
    got = sigmoid_topk_route(logits, bias, k, groups, keep, norm, SCALE)
    _check(got, sigmoid_topk_route_ref(logits, bias, k, groups, keep, norm, SCALE), t, k)
    ids = got[0].cpu()
    choice = (logits.sigmoid() + bias).cpu().gather(1, ids)  # [T, k]
    assert (choice[:, :-1] >= choice[:, 1:]).all(), "ids not in descending biased-score order"


def test_group_selection_changes_the_picks(device):
    """The grouped inputs above do exercise the group masking: without it some token would pick otherwise."""
    logits, bias = _inputs(5, 64, device)
    grouped = sigmoid_topk_route(logits, bias, 6, 8, 4, True, SCALE)[0].sort(dim=1)[0]
    flat = sigmoid_topk_route(logits, bias, 6, 1, 1, True, SCALE)[0].sort(dim=1)[0]
    assert not torch.equal(grouped, flat)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("e,k,groups,keep", CONFIGS)
@pytest.mark.parametrize("t", [1, 5])
def test_replayed_ids(t, e, k, groups, keep, norm, device):
    """Routing replay: the given ids come back in their order, with the twin's weights for them."""
    logits, bias = _inputs(t, e, device, seed=1)
    gen = torch.Generator().manual_seed(t + e)
    replay = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(device)  # [T, k] long
    ids, w = sigmoid_topk_route(logits, bias, k, groups, keep, norm, SCALE, replay)
    ref_ids, ref_w = sigmoid_topk_route_ref(logits, bias, k, groups, keep, norm, SCALE, replay)
    assert torch.equal(ids, replay) and torch.equal(ref_ids, replay)
    torch.testing.assert_close(w, ref_w, rtol=RTOL, atol=ATOL)


def test_ties_go_to_the_lower_expert_id(device):
    """Equal biased scores: the lower expert id wins (the choice torch's CUDA topk makes; its CPU topk, the
    twin's, takes others, so the expectation is written out). Then a tie across the k-th place only."""
    e, k = 288, 8
    ids, w = sigmoid_topk_route(torch.zeros(2, e, device=device), torch.zeros(e, device=device), k, 1, 1, True, 1.0)
    assert ids.cpu().tolist() == [list(range(k))] * 2
    torch.testing.assert_close(w, torch.full((2, k), 1.0 / k, device=device), rtol=RTOL, atol=ATOL)
    logits = torch.zeros(1, e, device=device)
    logits[0, [250, 7, 100]] = 1.0  # three clear winners, then five of the 285 tied experts
    ids, _ = sigmoid_topk_route(logits, torch.zeros(e, device=device), k, 1, 1, False, 1.0)
    assert ids.cpu().tolist() == [[7, 100, 250, 0, 1, 2, 3, 4]]


def test_group_ties_go_to_the_lower_group(device):
    """8 groups of 8 with equal group scores: the 4 lowest groups stay; a group's tied best counts twice."""
    e = 64
    logits = torch.zeros(1, e, device=device)
    ids, _ = sigmoid_topk_route(logits, torch.zeros(e, device=device), 6, 8, 4, True, 1.0)
    assert ids.cpu().tolist() == [[0, 1, 2, 3, 4, 5]]
    # scores 0 (the bias decides). Group 5: two tied at 1.5, 3.0 (a tied best counts twice); group 6: 2.0 and
    # 0.5, 2.5; groups 1 and 2: 1.0 twice, 2.0; the others 0. Groups 1, 2, 5 and 6 stay.
    logits = torch.full((1, e), -1e4, device=device)
    bias = torch.zeros(e, device=device)
    bias[48], bias[49] = 2.0, 0.5
    bias[40], bias[45] = 1.5, 1.5
    bias[[8, 9, 16, 17]] = 1.0
    ids, w = sigmoid_topk_route(logits, bias, 7, 8, 4, True, 1.0)
    assert ids.cpu().tolist() == [[48, 40, 45, 8, 9, 16, 17]]
    assert torch.equal(w, torch.zeros_like(w))  # 0 / (0 + 1e-20): the bias steers, never weighs
    _check((ids, w), sigmoid_topk_route_ref(logits, bias, 7, 8, 4, True, 1.0), 1, 7)


def test_padded_experts_never_win(device):
    """288 experts sit in a block of 512: with every biased score negative the padding must still lose."""
    e = 288
    logits = torch.full((3, e), -1e4, device=device)
    bias = -1.0 - torch.rand(e, generator=torch.Generator().manual_seed(3)).to(device)  # [E] in (-2, -1]
    got = sigmoid_topk_route(logits, bias, 8, 1, 1, True, SCALE)
    assert int(got[0].max()) < e
    _check(got, sigmoid_topk_route_ref(logits, bias, 8, 1, 1, True, SCALE), 3, 8)


def test_no_tokens(device):
    logits, bias = _inputs(1, 64, device)
    ids, w = sigmoid_topk_route(logits[:0], bias, 6, 8, 4, True, SCALE)
    assert ids.shape == (0, 6) and w.shape == (0, 6)


def test_rejects_what_it_cannot_compute(device):
    logits, bias = _inputs(2, 64, device)
    with pytest.raises(ValueError, match="logits"):
        sigmoid_topk_route(logits.double(), bias, 6, 8, 4, True, SCALE)
    with pytest.raises(ValueError, match="bias"):
        sigmoid_topk_route(logits, bias[:-1], 6, 8, 4, True, SCALE)
    with pytest.raises(ValueError, match="top_k"):
        sigmoid_topk_route(logits, bias, 65, 1, 1, True, SCALE)
    with pytest.raises(ValueError, match="groups"):
        sigmoid_topk_route(logits, bias, 6, 5, 4, True, SCALE)  # 64 experts in 5 groups
    with pytest.raises(ValueError, match="groups"):
        sigmoid_topk_route(logits, bias, 6, 8, 9, True, SCALE)
    with pytest.raises(ValueError, match="replay_ids"):
        sigmoid_topk_route(logits, bias, 6, 8, 4, True, SCALE, torch.zeros(2, 5, dtype=torch.long, device=device))


@pytest.mark.parametrize("groups,keep", [(1, 1), (8, 4)])
def test_router_on_cpu_is_the_twin(groups, keep):
    """The CPU path of models/blocks/router.py is the twin, bit for bit (CI compares it with transformers)."""
    spec = MoESpec(num_experts=64, top_k=6, intermediate_size=8, scoring="sigmoid_noaux", norm_topk_prob=True,
                   routed_scaling_factor=SCALE, n_group=groups, topk_group=keep)
    router = Router(spec, 32)
    gen = torch.Generator().manual_seed(5)
    router.weight = torch.nn.Parameter(torch.randn(64, 32, generator=gen), requires_grad=False)
    router.e_score_correction_bias = torch.nn.Parameter(torch.randn(64, generator=gen) * 0.1, requires_grad=False)
    with torch.no_grad():
        x = torch.randn(5, 32, generator=gen)
        replay = torch.arange(30).reshape(5, 6) % 64
        for ids in (None, replay):
            got = router(x, ids)
            want = sigmoid_topk_route_ref(F.linear(x, router.weight), router.e_score_correction_bias, 6, groups,
                                          keep, True, SCALE, ids)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
