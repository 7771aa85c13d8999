"""The paged decode attention kernel inside the engine (CPU, fp32, Triton's interpreter):
greedy tokens equal to the SDPA engine's, batched equal to alone, and clear refusals."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports Triton (CPU tensors, the interpreter)

import random  # noqa: E402

import pytest  # noqa: E402

from tiermoe.engine.build import build_engine_core  # noqa: E402
from tiermoe.engine.llm_engine import generate_ids  # noqa: E402
from tiermoe.protocol import SamplingParams  # noqa: E402
from tiermoe.errors import UserError  # noqa: E402


def _engine(path, **options):
    return build_engine_core(str(path), device="cpu", dtype="float32", max_num_seqs=4, max_model_len=64,
                             options=options)


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(vocab) for _ in range(n)] for n in (3, 29, 17)]


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe", "glm5_next"])  # glm5_next: MLA's static decode path
def test_paged_decode_gives_the_sdpa_tokens_and_is_batch_invariant(arch, tiny_dir):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    sdpa, paged = _engine(tiny_dir(arch)), _engine(tiny_dir(arch), decode_attention="paged")
    assert paged.runner.table_blocks == 64 // paged.runner.page_size and sdpa.runner.table_blocks == 0
    prompts = _prompts(paged.vocab_size)
    together = generate_ids(paged, prompts, params)
    assert together == generate_ids(sdpa, prompts, params)
    assert together == [generate_ids(paged, [p], params)[0] for p in prompts]  # batched equals alone


def test_paged_decode_logprobs_match_sdpa_closely(tiny_dir):
    path = tiny_dir("qwen3_moe")
    params = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=3)
    runs = []
    for engine in (_engine(path), _engine(path, decode_attention="paged")):
        engine.add_request("a", list(range(5, 50)), params)
        outs = []
        while engine.has_unfinished_requests():
            outs.extend(engine.step())
        runs.append([lp for o in outs for lp in (o.logprobs or [])])
    assert len(runs[0]) == len(runs[1]) == 5
    for a, b in zip(*runs):  # the first token comes from the prefill (SDPA in both), then decode
        assert a.token_id == b.token_id
        assert abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a.top, b.top))


def test_paged_decode_refuses_latent_attention(tiny_dir):
    with pytest.raises(UserError, match="grouped-query"):
        _engine(tiny_dir("deepseek_v3"), decode_attention="paged")
