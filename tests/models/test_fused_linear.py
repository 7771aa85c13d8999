"""Merged projections (models/blocks/fused_linear.py): one weight buffer, parameters as its views.

The merged GEMM runs only on a CUDA device; here its arithmetic is checked on the CPU by asking for it
explicitly (the groups' `active` is forced), against the separate projections the CPU path runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from testkit.torch_threads import one_torch_thread  # noqa: F401  (autouse fixture)

from tiermoe.models.batch import build_forward_batch
from tiermoe.models.blocks.fused_linear import ProjectionGroup
from tiermoe.models.glm5_next import build_model
from tiermoe.models.glm5_next.tiny import write_tiny_checkpoint


def _linears(*outs: int, width: int = 16) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(width, n, bias=False) for n in outs]


def test_fuse_makes_views_of_one_buffer_and_the_product_is_the_separate_ones():
    lins = _linears(5, 3, 7)
    x = torch.randn(4, 16)
    want = torch.cat([lin(x) for lin in lins], dim=-1)
    group = ProjectionGroup([(lin, "weight") for lin in lins])
    assert group.fuse() and group.sizes == [5, 3, 7]
    for lin, base in zip(lins, (0, 5, 8)):
        assert lin.weight.data_ptr() == group.weight[base:].data_ptr()  # a view: no second copy
        assert isinstance(lin.weight, nn.Parameter)
    torch.testing.assert_close(group(x), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(torch.cat([lin(x) for lin in lins], dim=-1), want)  # the modules compute as before
    assert not group.active(x)  # the CPU keeps the separate projections
    assert group.fuse() and group.weight.data_ptr() == lins[0].weight.data_ptr()  # fusing twice copies nothing


def test_a_reassigned_weight_leaves_the_merged_buffer_unused():
    lins = _linears(4, 4)
    group = ProjectionGroup([(lin, "weight") for lin in lins])
    assert group.fuse()
    assert group._fused_in_place()
    lins[1].weight = nn.Parameter(torch.zeros(4, 16))
    assert not group._fused_in_place()


def test_weights_that_cannot_share_a_buffer_stay_apart():
    a, b = _linears(4, 4)
    b.weight = nn.Parameter(b.weight.detach().double())
    group = ProjectionGroup([(a, "weight"), (b, "weight")])
    assert not group.fuse() and group.weight is None
    assert a.weight.dtype == torch.float32 and b.weight.dtype == torch.float64


def test_batched_projects_each_input_with_its_own_weight():
    lins = _linears(6, 6, width=8)
    group = ProjectionGroup([(lin, "weight") for lin in lins])
    assert group.fuse()
    x = torch.randn(2, 3, 8)  # [G, T, in]
    got = group.batched(x)
    for i, lin in enumerate(lins):
        torch.testing.assert_close(got[i], lin(x[i]), rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("fused_linear") / "tiny")


def test_glm5_next_with_merged_projections_gives_the_separate_ones_logits(ckpt, monkeypatch):
    """fp32 tiny glm5_next, a prefill and two decode steps: the merged GEMMs (forced on the CPU) give the
    logits of the separate projections to fp32 rounding, and fusing moved no parameter's values."""
    def run(merged: bool) -> torch.Tensor:
        em = build_model(ckpt, device="cpu", dtype=torch.float32)
        before = {n: p.detach().clone() for n, p in em.model.named_parameters()}
        if merged:
            em.model.fuse_projections()
            for n, p in em.model.named_parameters():
                assert torch.equal(p, before[n]), n
        em.reserve_slots(1)
        kv = [{n: torch.zeros(8, 16, *s) for n, s in shapes.items()} for shapes in em.cache_shapes()]
        pages = list(range(8))
        prompt = list(range(5, 40))
        out = [em.logits(em(build_forward_batch([(prompt, 0, pages, 0)], 16, "cpu"), kv)[-1:])]
        for i, tok in enumerate((7, 11)):
            out.append(em.logits(em(build_forward_batch([([tok], len(prompt) + i, pages, 0)], 16, "cpu"), kv)))
        return torch.cat(out)

    want = run(False)
    monkeypatch.setattr(ProjectionGroup, "active", lambda self, x: self.weight is not None and self._fused_in_place())
    calls = []
    merged_call = ProjectionGroup.__call__
    monkeypatch.setattr(ProjectionGroup, "__call__", lambda self, x: calls.append(x.shape[0]) or merged_call(self, x))
    got = run(True)
    assert len(calls) >= 3 * 8  # three forwards, each layer's mixer and MLP through merged GEMMs
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
