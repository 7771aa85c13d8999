"""Prompt logprobs equal log_softmax of a direct transformers forward at every prompt position,
whatever the engine does meanwhile: chunked prefill across steps, other requests in the batch,
a prefix-cache hit on the same prompt (bypassed), preemption and recompute."""

from __future__ import annotations

import random

import pytest
import torch

from tiermoe.engine.build import build_engine_core
from tiermoe.protocol import SamplingParams
from tiermoe.eval.parity import reference_logits

K = 4


def _run(engine, prompts: dict[str, list[int]], params: dict[str, SamplingParams]) -> dict[str, list]:
    """Run to completion; request id -> [first output's prompt_logprobs, cached_tokens, tokens]."""
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params[rid])
    got: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.finish_reason != "error", out.error
            if out.request_id not in got:
                got[out.request_id] = [out.prompt_logprobs, out.cached_tokens, []]
            else:
                assert out.prompt_logprobs is None  # only in the first output
            got[out.request_id][2] += out.new_token_ids
    return got


def _check(plp, ids: list[int], ref: torch.Tensor) -> None:
    """plp from the engine against ref logits [len(ids), V] of the same ids."""
    lp = torch.log_softmax(ref.double(), -1)
    assert len(plp) == len(ids) and plp[0] is None
    for p in range(1, len(ids)):
        e = plp[p]
        assert e.token_id == ids[p]
        assert abs(e.logprob - lp[p - 1, ids[p]].item()) < 1e-4, p
        want = lp[p - 1].topk(K)
        assert [t for t, _ in e.top] == want.indices.tolist()
        assert torch.allclose(torch.tensor([v for _, v in e.top], dtype=torch.double), want.values, atol=1e-4)


@pytest.fixture(scope="module")
def setup(tiny_dir):
    path = str(tiny_dir("glm4_moe"))
    rng = random.Random(3)
    prompts = [[rng.randrange(500) for _ in range(n)] for n in (37, 9, 58, 70)]
    refs = reference_logits(path, prompts, "cpu", torch.float32)
    return path, prompts, refs


def test_chunked_prefill_and_prefix_cache_hit(setup):
    path, prompts, refs = setup
    engine = build_engine_core(path, device="cpu", dtype="float32", max_num_seqs=4,
                               options={"max_num_batched_tokens": 8})
    warm = _run(engine, {"warm": prompts[0]}, {"warm": SamplingParams(max_tokens=2)})
    assert warm["warm"][0] is None
    want = SamplingParams(max_tokens=3, prompt_logprobs=K)
    plain = SamplingParams(max_tokens=3)
    got = _run(engine, {"same": prompts[0], "other": prompts[1], "third": prompts[2]},
               {"same": want, "other": plain, "third": want})
    assert got["same"][1] == 0  # the cached prefix was not taken: every position has logits
    _check(got["same"][0], prompts[0], refs[0])
    _check(got["third"][0], prompts[2], refs[2])
    assert got["other"][0] is None
    assert got["same"][2] == warm["warm"][2] + got["same"][2][2:]  # same greedy tokens as the cached run
    again = _run(engine, {"again": prompts[0]}, {"again": plain})
    assert again["again"][1] > 0  # the prefix cache still serves requests that do not ask
    assert not engine.runner.prompt_logprobs


@pytest.mark.slow
def test_preemption_recompute_keeps_prompt_logprobs(setup):
    path, prompts, refs = setup
    probe = build_engine_core(path, device="cpu", dtype="float32", max_num_seqs=1)
    from tiermoe.runner.model_runner import kv_bytes_per_token

    per_token = kv_bytes_per_token(probe.model, probe.model.dtype)
    engine = build_engine_core(path, device="cpu", dtype="float32", max_num_seqs=4, max_model_len=128,
                               options={"max_num_batched_tokens": 16, "kv_cache_gb": 12 * 16 * per_token / 2**30})
    params = SamplingParams(max_tokens=20, ignore_eos=True, prompt_logprobs=K)
    got = _run(engine, {str(i): p for i, p in enumerate(prompts)}, {str(i): params for i in range(len(prompts))})
    assert engine.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts):
        _check(got[str(i)][0], p, refs[i])
    assert engine.kv.num_free == engine.kv.num_pages
