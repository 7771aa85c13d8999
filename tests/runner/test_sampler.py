"""Sampler semantics on hand-made logits."""

from __future__ import annotations

import pytest
import torch

from tiermoe.protocol import InvalidRequest, SamplingParams
from tiermoe.runner.sampler import SampleRow, sample


def _row(**kw) -> SampleRow:
    seed = kw.pop("gen_seed", None)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SampleRow(SamplingParams(**kw), [1, 2], kw.get("outs", []), gen)


def test_greedy_is_argmax():
    logits = torch.randn(3, 50)
    res = sample(logits.clone(), [_row(), _row(), _row()])
    assert res.tokens.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_filters_that_leave_one_token_equal_greedy(kw):
    logits = torch.randn(4, 50)
    rows = [_row(temperature=1.0, gen_seed=i, **kw) for i in range(4)]
    assert sample(logits.clone(), rows).tokens.tolist() == logits.argmax(-1).tolist()


def test_seeded_rows_are_reproducible_and_follow_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    draws = [sample(logits.clone(), [_row(temperature=1.0, gen_seed=s)]).tokens.item() for s in range(2000)]
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / len(draws)
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)
    again = [sample(logits.clone(), [_row(temperature=1.0, gen_seed=s)]).tokens.item() for s in range(50)]
    assert again == draws[:50]


def test_repetition_and_frequency_penalties_move_away_from_seen_tokens():
    logits = torch.zeros(1, 5)
    logits[0, 1] = 1.0  # token 1 is in the prompt
    logits[0, 3] = 0.9
    assert sample(logits.clone(), [_row(repetition_penalty=2.0)]).tokens.item() == 3
    logits = torch.zeros(1, 5)
    logits[0, 4], logits[0, 0] = 1.0, 0.5
    row = SampleRow(SamplingParams(frequency_penalty=0.3), [], [4, 4], None)
    assert sample(logits.clone(), [row]).tokens.item() == 0


def test_logprobs_are_raw_model_logprobs():
    logits = torch.randn(2, 30)
    res = sample(logits.clone(), [_row(logprobs=5), _row()])
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(res.logprobs, ref.gather(1, res.tokens[:, None])[:, 0])
    assert res.top_ids.shape == (2, 5)
    assert torch.allclose(res.top_logprobs[0], ref[0].topk(5).values)


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=2.0),
                                dict(top_k=-5), dict(repetition_penalty=0.0), dict(presence_penalty=3.0),
                                dict(max_tokens=0), dict(temperature=float("nan")), dict(logprobs=21)])
def test_invalid_params_are_rejected(kw):
    with pytest.raises(InvalidRequest):
        SamplingParams(**kw).validate()
