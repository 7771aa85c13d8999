"""Batched decode, chunked prefill, preemption and prefix caching give the tokens each
prompt gives alone (greedy, fp32, CPU)."""

from __future__ import annotations

import random

import pytest

from tiermoe.engine.build import build_engine_core
from tiermoe.engine.llm_engine import generate_ids
from tiermoe.protocol import SamplingParams

LENGTHS = (5, 23, 40, 71)


def _prompts(vocab: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in LENGTHS]


def _engine(path, max_model_len=None, **options):
    return build_engine_core(str(path), device="cpu", dtype="float32", max_num_seqs=4, max_model_len=max_model_len,
                             options=options)


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe", "deepseek_v3", "glm5_next"])
def test_batched_equals_alone(arch, tiny_dir):
    engine = _engine(tiny_dir(arch))
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = _prompts(engine.vocab_size)
    alone = [generate_ids(engine, [p], params)[0] for p in prompts]
    together = generate_ids(engine, prompts, params)
    assert together == alone
    assert all(len(t) == 20 for t in together)


def test_chunked_prefill_and_preemption_keep_tokens(tiny_dir):
    path = tiny_dir("glm4_moe")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    reference = _engine(path)
    prompts = _prompts(reference.vocab_size, seed=11)
    alone = [generate_ids(reference, [p], params)[0] for p in prompts]
    # 8-token step budget forces chunked prefill mixed with decode; a KV cache of 12 pages
    # (192 tokens) cannot hold all four sequences, so some are preempted and recomputed.
    tight = _engine(path, max_model_len=128, max_num_batched_tokens=8,
                    kv_cache_gb=12 * 16 * _kv_bytes(reference) / 2**30)
    assert tight.kv.num_pages == 12
    assert generate_ids(tight, prompts, params) == alone
    assert tight.scheduler.num_preemptions > 0
    assert tight.kv.num_free == tight.kv.num_pages


def _kv_bytes(engine) -> int:
    from tiermoe.runner.model_runner import kv_bytes_per_token

    return kv_bytes_per_token(engine.model, engine.model.dtype)


def test_prefix_cache_reuses_pages_and_keeps_tokens(tiny_dir):
    engine = _engine(tiny_dir("qwen3_moe"))
    prompt = _prompts(engine.vocab_size)[3]  # 71 tokens: 4 full pages
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    first = generate_ids(engine, [prompt], params)[0]
    hits_before = engine.kv.hits
    engine.add_request("again", prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert engine.kv.hits - hits_before == 64
    assert outs[0].cached_tokens == 64
    assert [t for o in outs for t in o.new_token_ids] == first


def test_seeded_sampling_is_batch_independent(tiny_dir):
    engine = _engine(tiny_dir("qwen3_moe"))
    prompts = _prompts(engine.vocab_size)
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = generate_ids(engine, [prompts[1]], params)[0]
    together = generate_ids(engine, prompts, params)
    assert together[1] == alone


def test_abort_frees_pages(tiny_dir):
    engine = _engine(tiny_dir("qwen3_moe"))
    engine.add_request("a", _prompts(engine.vocab_size)[2], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.kv.num_free < engine.kv.num_pages
    engine.abort_request("a")
    outs = engine.step()
    assert outs and outs[0].finished and outs[0].finish_reason == "abort"
    assert engine.kv.num_free == engine.kv.num_pages
    assert not engine.has_unfinished_requests()


def test_glm5_next_bf16_cut_prompts_keep_tokens(tiny_dir):
    """bf16 KDA prefill rounds per 64-token block: the scheduler cuts prompts on block edges, so a
    tight step budget shared with other sequences gives the tokens of an uncut prompt."""
    path = tiny_dir("glm5_next")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    roomy = build_engine_core(str(path), device="cpu", dtype="bfloat16", max_num_seqs=4)
    rng = random.Random(3)
    prompts = [[rng.randrange(roomy.vocab_size) for _ in range(n)] for n in (150, 37, 97, 200)]
    alone = [generate_ids(roomy, [p], params)[0] for p in prompts]
    tight = build_engine_core(str(path), device="cpu", dtype="bfloat16", max_num_seqs=4,
                              options={"max_num_batched_tokens": 100})
    assert tight.scheduler.chunk_multiple == 64
    assert generate_ids(tight, prompts, params) == alone


def test_device_wait_hook_runs_once_a_step_after_the_forward(tiny_dir):
    """LLMEngine calls device_wait_hook once per step that ran a forward, after the forward was
    queued (its KV rows are written) and before the step's tokens are appended; AsyncEngine
    hands the previous step's outputs to the event loop there."""
    engine = _engine(tiny_dir("glm4_moe"))
    seen = []
    engine.device_wait_hook = lambda: seen.append((engine.counters["steps"], engine.counters["generation_tokens"]))
    out = generate_ids(engine, _prompts(engine.vocab_size)[:2], SamplingParams(max_tokens=5, ignore_eos=True))
    assert [len(t) for t in out] == [5, 5]
    steps = engine.counters["steps"]
    assert [s for s, _ in seen] == list(range(1, steps + 1))  # once a step, inside it
    assert [g for _, g in seen] == [2 * min(i, 5) for i in range(steps)]  # before that step's tokens
