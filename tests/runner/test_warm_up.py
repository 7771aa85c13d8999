"""Start-up warm-up (ModelRunner.warm_up): every step shape runs once before serving, and the
tokens served afterwards are those of an engine that never warmed up (CPU, fp32)."""

from __future__ import annotations

import pytest

from tiermoe.engine.build import build_engine_core
from tiermoe.engine.llm_engine import generate_ids
from tiermoe.protocol import SamplingParams


def test_warm_up_runs_every_shape_and_changes_no_token(tiny_dir):
    def engine():
        return build_engine_core(str(tiny_dir("glm4_moe")), device="cpu", dtype="float32", max_num_seqs=3,
                                 max_model_len=96, options={"max_num_batched_tokens": 64})

    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = [[7, 8, 9, 10, 11], list(range(20, 61)), [3]]
    fresh = generate_ids(engine(), prompts, params)
    warmed = engine()
    calls = []
    forward = warmed.model.forward
    warmed.model.forward = lambda batch, caches, **kw: calls.append(
        (batch.num_tokens, [s.q_len for s in batch.seqs])) or forward(batch, caches, **kw)
    steps = warmed.warm_up()
    warmed.model.forward = forward
    # prefill chunks of 1, 2, 4, ..., 64 tokens, then decode batches of 1, 2, 3 sequences twice each
    assert steps == 7 + 3 * 2 == len(calls)
    assert [t for t, _ in calls[:7]] == [1, 2, 4, 8, 16, 32, 64]
    assert [q for _, q in calls[7:]] == [[1], [1], [1, 1], [1, 1], [1, 1, 1], [1, 1, 1]]
    stats = warmed.stats()
    assert stats["steps"] == 0 and stats["requests"] == 0  # not counted as served work
    assert stats["warm_up"]["steps"] == steps and stats["warm_up"]["seconds"] >= 0
    assert stats["decode_attention"] == "sdpa" and "decode_graphs" not in stats  # CPU: no graphs
    assert generate_ids(warmed, prompts, params) == fresh


def test_glm5_next_warm_up_changes_no_token(tiny_dir):
    """A hybrid whose first layers are KDA (no paged rows): the warm-up finds the page pool in a
    later layer, and its dummy sequences' KDA slot state does not leak into served requests."""
    try:
        model = tiny_dir("glm5_next")
    except Exception as exc:  # transformers 5.17 (the GPU image's) predates glm5_next's layer types
        if "layer_types" not in str(exc):
            raise
        pytest.skip(f"this transformers cannot build glm5_next's config: {str(exc).splitlines()[0][:120]}")

    def engine():
        return build_engine_core(str(model), device="cpu", dtype="float32", max_num_seqs=2,
                                 max_model_len=160, options={"max_num_batched_tokens": 128})

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [[7, 8, 9, 10, 11], list(range(20, 90))]
    fresh = generate_ids(engine(), prompts, params)
    warmed = engine()
    assert warmed.warm_up() == 8 + 2 * 2  # prefill chunks of 1..128 tokens, decode batches of 1 and 2
    assert generate_ids(warmed, prompts, params) == fresh
