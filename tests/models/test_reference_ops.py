"""Prefill steps compute with the blocks' plain-torch twins (transformers' own ops), decode and verify steps with the
Triton kernels (models/blocks/common.reference_ops, glm5_next's layers_forward).

Why: on a GPU the kernels round in their own order, and at near-ties that flips a top-1 against transformers; with
the twins a bf16 prefill gives transformers' logits bit for bit (docs/results.md). These tests check the switch
itself on a CPU: which steps take it, that it nests and is undone, and that the logits do not change on a CPU
(where the twins run anyway).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from testkit.torch_threads import one_torch_thread  # noqa: F401  (autouse fixture)

from tiermoe.models.blocks import common
from tiermoe.models.glm5_next import SeqBatch, build_model
from tiermoe.models.glm5_next import model as glm5_model
from tiermoe.models.glm5_next.model import prefill_shaped
from tiermoe.models.glm5_next.tiny import write_tiny_checkpoint


def test_reference_ops_turns_the_kernels_off_and_back():
    assert not common._REFERENCE_OPS.on
    with common.reference_ops():
        assert common._REFERENCE_OPS.on
        with common.reference_ops(False):  # a decode step inside stays on the kernels
            assert not common._REFERENCE_OPS.on
        assert common._REFERENCE_OPS.on
    assert not common._REFERENCE_OPS.on
    with pytest.raises(RuntimeError), common.reference_ops():
        raise RuntimeError("a failing step")
    assert not common._REFERENCE_OPS.on  # undone on the way out of a failure too


def test_which_steps_are_prefill_shaped():
    assert prefill_shaped(SeqBatch([0], [0], [7]))  # a prompt chunk
    assert prefill_shaped(SeqBatch([0, 1], [0, 30], [64, 5]))  # two prompts' pieces
    assert not prefill_shaped(SeqBatch([0, 1], [9, 0], [1, 5]))  # a chunk beside a decode row: the row's kernels
    assert not prefill_shaped(SeqBatch([0, 1, 2], [4, 9, 3], [1, 1, 1]))  # decode
    assert not prefill_shaped(SeqBatch([0, 1], [4, 9], [3, 1], keep_states=True))  # a speculative verify
    assert not prefill_shaped(SeqBatch([0, 1], [4, 0], [3, 6], keep_states=[True, False]))  # verify beside a prompt


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_model(write_tiny_checkpoint(tmp_path_factory.mktemp("reference_ops") / "tiny"), device="cpu",
                       dtype=torch.bfloat16).model


def spy_on_reference_ops(module, monkeypatch) -> list[bool]:
    """Replace `module.reference_ops` with a wrapper that records each step's switch; returns the record."""
    seen: list[bool] = []
    real = module.reference_ops

    @contextlib.contextmanager
    def spy(on: bool = True):
        seen.append(on)
        with real(on):
            yield

    monkeypatch.setattr(module, "reference_ops", spy)
    return seen


def test_layers_forward_takes_the_twins_for_prefill_only(tiny, monkeypatch):
    cache = tiny.new_cache(2, 64)
    ids = torch.arange(3, 12)
    plain = tiny(ids, SeqBatch([0], [0], [9]), cache)  # before the spy: the same step's logits
    seen = spy_on_reference_ops(glm5_model, monkeypatch)
    cache = tiny.new_cache(2, 64)
    hidden = tiny(ids, SeqBatch([0], [0], [9]), cache)  # prefill
    tiny(torch.tensor([5]), SeqBatch([0], [9], [1]), cache)  # decode
    assert seen == [True, False]
    assert torch.equal(hidden, plain)  # on a CPU the twins run either way


def test_the_decoder_families_take_the_twins_for_prefill_only(tiny_dir, monkeypatch):
    """glm4_moe and the other decoder families (models/decoder.py) switch the same way: their norms and sigmoid
    router have Triton kernels on CUDA, and a step of prompt pieces must still give transformers' bits."""
    from tiermoe.engine.build import build_engine_core
    from tiermoe.eval.parity import engine_logits
    from tiermoe.models import decoder

    eng = build_engine_core(str(tiny_dir("glm4_moe", "bfloat16")), device="cpu", dtype="bfloat16", max_num_seqs=1)
    ids = list(range(3, 12))
    plain = engine_logits(eng, ids, chunk=4, decode_from=6)  # before the spy: the same steps' logits
    seen = spy_on_reference_ops(decoder, monkeypatch)
    got = engine_logits(eng, ids, chunk=4, decode_from=6)  # prompt pieces of 4, 2, then 3 decode steps
    assert seen == [True, True, False, False, False]
    assert torch.equal(got, plain)  # on a CPU the twins run either way
