"""--kv-cache-gb with MTP drafting on (tiny glm5_next, fp32, CPU): the MTP layer's latent rows are
paged with the trunk's page count, so they count in the bytes per token and every allocated
cache tensor (trunk + MTP) fits the budget; greedy output still equals drafting off. The KDA
state of every slot is paid from the same budget before any page."""

from __future__ import annotations

import random

import pytest
import torch
from testkit.torch_threads import one_torch_thread  # noqa: F401  (autouse fixture)

from tiermoe.engine.build import PAGE_SIZE, build_engine_core
from tiermoe.engine.llm_engine import generate_ids
from tiermoe.protocol import SamplingParams
from tiermoe.errors import UserError
from tiermoe.runner.model_runner import kv_bytes_per_token

# tiny glm5_next (models/glm5_next/tiny.py): kv_lora_rank 32, index_head_dim 16; MLA layers 2 (own
# indexer), 3 (shares its top-k: latent only), 7 (own indexer); the MTP layer 8 has its own indexer
TRUNK_FP32 = 4 * ((32 + 2 * 16) + 32 + (32 + 2 * 16))
MTP_FP32 = 4 * (32 + 2 * 16)


def _engine(path, k=0, **options):
    return build_engine_core(str(path), device="cpu", dtype="float32", max_num_seqs=4, max_model_len=128,
                             options={**options, "num_speculative_tokens": k})


def _allocated(engine) -> int:
    """Bytes of the cache tensors the engine really holds: trunk and MTP pages, and the KDA state of every slot."""
    runner = engine.runner
    tensors = [t for layer in runner.kv_caches for t in layer.values()]
    if runner.spec is not None:
        tensors += list(runner.spec.kv.values())
    return sum(t.numel() * t.element_size() for t in tensors) + engine.model.kda.allocated_bytes()


@pytest.fixture(scope="module")
def state(tiny_dir) -> int:
    """Bytes of KDA state the 4 slots reserve (conv windows and fp32 delta states of every KDA layer)."""
    return _engine(tiny_dir("glm5_next")).runner.slot_state_bytes()


def test_bytes_per_token_count_the_mtp_layer_only_when_drafting(tiny_dir):
    engine = _engine(tiny_dir("glm5_next"))
    model = engine.model
    assert kv_bytes_per_token(model, torch.float32) == TRUNK_FP32
    assert kv_bytes_per_token(model, torch.float32, 0) == TRUNK_FP32
    for k in (1, 2):
        assert kv_bytes_per_token(model, torch.float32, k) == TRUNK_FP32 + MTP_FP32
    assert kv_bytes_per_token(model, torch.bfloat16, 2) == (TRUNK_FP32 + MTP_FP32) // 2
    qwen = _engine(tiny_dir("qwen3_moe")).model  # no MTP head: drafting will not happen
    assert kv_bytes_per_token(qwen, torch.float32, 2) == kv_bytes_per_token(qwen, torch.float32)


def test_slot_state_is_what_the_slots_hold(tiny_dir, state):
    engine = _engine(tiny_dir("glm5_next"))
    assert state > 0 and engine.model.kda.allocated_bytes() == state and engine.stats()["slot_state_bytes"] == state
    assert _engine(tiny_dir("qwen3_moe")).runner.slot_state_bytes() == 0


def test_allocated_cache_stays_within_the_budget(tiny_dir, state):
    path = tiny_dir("glm5_next")
    per_on = TRUNK_FP32 + MTP_FP32
    budget = state + 10.5 * PAGE_SIZE * per_on  # bytes: the slots' state, then room for 10 whole pages
    on = _engine(path, 2, kv_cache_gb=budget / 2**30)
    off = _engine(path, 0, kv_cache_gb=budget / 2**30)
    assert on.runner.spec is not None and off.runner.spec is None
    assert on.kv.num_pages == 10
    assert off.kv.num_pages == int((budget - state) / (PAGE_SIZE * TRUNK_FP32))  # 14: the trunk alone is cheaper
    for engine in (on, off):
        assert engine.runner.kv_cache_bytes() + engine.runner.slot_state_bytes() == _allocated(engine)
        assert budget - PAGE_SIZE * kv_bytes_per_token(engine.model, torch.float32, 2 if engine is on else 0) \
            < _allocated(engine) <= budget
    assert sum(t.numel() * t.element_size() for t in on.runner.spec.kv.values()) == 10 * PAGE_SIZE * MTP_FP32


def test_budget_for_one_trunk_sequence_is_too_small_with_drafting(tiny_dir, state):
    path = tiny_dir("glm5_next")
    one_seq = (128 // PAGE_SIZE + 1) * PAGE_SIZE  # tokens of the pages one 128-token sequence needs
    budget_gb = (state + one_seq * TRUNK_FP32) / 2**30
    assert _engine(path, 0, kv_cache_gb=budget_gb).kv.num_pages == 128 // PAGE_SIZE + 1
    with pytest.raises(UserError, match="--kv-cache-gb: too small"):
        _engine(path, 1, kv_cache_gb=budget_gb)
    # the pages of one sequence without room for the slots' state: refused, and the message says why
    with pytest.raises(UserError, match="per-sequence state for 4 sequences"):
        _engine(path, 0, kv_cache_gb=one_seq * TRUNK_FP32 / 2**30)


def test_greedy_output_under_a_tight_budget_equals_drafting_off(tiny_dir, state):
    """10 pages with drafting on cannot hold the four sequences: chunked prefill, verify steps
    and preemption mix, and every token is still the drafting-off one."""
    path = tiny_dir("glm5_next")
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 23, 40, 71)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = generate_ids(_engine(path), prompts, params)
    budget_gb = (state + 10.5 * PAGE_SIZE * (TRUNK_FP32 + MTP_FP32)) / 2**30
    on = _engine(path, 2, kv_cache_gb=budget_gb, max_num_batched_tokens=12)
    assert on.kv.num_pages == 10
    assert generate_ids(on, prompts, params) == want
    stats = on.stats()
    assert stats["speculative"]["verify_steps"] > 0 and stats["preemptions"] > 0
    assert on.kv.num_free == on.kv.num_pages
