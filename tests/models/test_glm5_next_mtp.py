"""glm5_next MTP speculative decoding inside the engine (fp32, CPU): greedy output identical
to drafting off through mixed batches, chunked prefill and preemption; acceptance, rollback
and stop handling when several tokens arrive in one step; everything else decodes normally."""

from __future__ import annotations

import random

import pytest
from testkit.torch_threads import one_torch_thread  # noqa: F401  (autouse fixture)

from tiermoe.engine.build import build_engine_core
from tiermoe.engine.llm_engine import generate_ids
from tiermoe.protocol import SamplingParams

LENGTHS = (5, 23, 40, 71)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny glm5_next whose trunk is predictable enough to draft (branch_scale 0.25) with a
    briefly distilled MTP layer, so real drafts are sometimes right and sometimes wrong."""
    from tiermoe.models.glm5_next.distill import distill_mtp
    from tiermoe.models.glm5_next.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path_factory.mktemp("glm5_mtp") / "tiny", branch_scale=0.25)
    distill_mtp(path, steps=60, num_prompts=16, gen_len=24, held_out=2)
    return path


def _engine(path, k=0, num_seqs=4, max_model_len=None, **options):
    return build_engine_core(str(path), device="cpu", dtype="float32", max_num_seqs=num_seqs,
                             max_model_len=max_model_len, options={**options, "num_speculative_tokens": k})


def _prompts(vocab: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in LENGTHS]


def _run(engine, prompts, params_list):
    """Run requests to completion; returns ({id: tokens}, {id: finish_reason}, max tokens in one output)."""
    toks, reasons, most = {}, {}, 0
    for i, (p, params) in enumerate(zip(prompts, params_list)):
        engine.add_request(str(i), p, params)
        toks[str(i)] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.finish_reason != "error", out.error
            toks[out.request_id].extend(out.new_token_ids)
            most = max(most, len(out.new_token_ids))
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return toks, reasons, most


@pytest.fixture(scope="module")
def reference(ckpt):
    """Drafting off, roomy: tokens of each prompt decoded alone and the engine's KV size."""
    engine = _engine(ckpt)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = _prompts(engine.vocab_size)
    alone = [generate_ids(engine, [p], params)[0] for p in prompts]
    from tiermoe.runner.model_runner import kv_bytes_per_token

    # per cached token with drafting on: the MTP layer's cache rows count against --kv-cache-gb
    # and the slots' KDA state is paid from it first
    per_token = kv_bytes_per_token(engine.model, engine.model.dtype, num_speculative_tokens=1)
    return prompts, alone, per_token, engine.runner.slot_state_bytes()


@pytest.mark.parametrize("k", [1, 2])
def test_mixed_batch_chunked_prefill_and_preemption_equal_drafting_off(ckpt, reference, k):
    prompts, alone, per_token, state = reference
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    # 12-token step budget: prompts arrive in chunks mixed with verify steps; 11 pages of 16
    # tokens cannot hold all four sequences, so some are preempted and recomputed.
    engine = _engine(ckpt, k, max_model_len=128, max_num_batched_tokens=12, kv_cache_gb=(state + 11 * 16 * per_token) / 2**30)
    assert engine.kv.num_pages == 11
    assert generate_ids(engine, prompts, params) == alone
    stats = engine.stats()
    spec = stats["speculative"]
    assert stats["preemptions"] > 0
    assert spec["num_speculative_tokens"] == k and spec["drafted"] > 0
    assert 0 < spec["accepted"] < spec["drafted"]  # the distilled head is sometimes right
    assert spec["acceptance_rate"] == round(spec["accepted"] / spec["drafted"], 4)
    assert stats["generation_tokens"] == 4 * 20  # each token counted once, however it arrived
    assert engine.kv.num_free == engine.kv.num_pages and not engine.runner.spec.tracks


def test_batch_with_roomy_cache_takes_fewer_steps(ckpt, reference):
    prompts, alone, _, _ = reference
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    off, on = _engine(ckpt), _engine(ckpt, 2)
    assert generate_ids(on, prompts, params) == generate_ids(off, prompts, params) == alone
    assert on.stats()["steps"] < off.stats()["steps"]


def _oracle(engine, truth: dict[str, list[int]], pattern):
    """Replace the MTP head's drafts with scripted ones: right, or made wrong at position j
    when pattern(verify_index, j) says so. Returns a dict counting the accepts to expect."""
    spec = engine.runner.spec
    real = spec.prepare
    tally = {"verify": 0, "accepted": 0, "drafted": 0}
    vocab = engine.vocab_size

    def prepare(items):
        drafts = real(items)  # the real catch-up and drafting still run
        for i, d in drafts.items():
            req = items[i][0]
            t, o, v = truth[req.request_id], len(req.output_ids), tally["verify"]
            new = [t[o + j] if not pattern(v, j) else (t[o + j] + 1) % vocab for j in range(len(d))]
            drafts[i] = new
            a = 0
            while a < len(new) and not pattern(v, a):
                a += 1
            tally["verify"] += 1
            tally["accepted"] += a
            tally["drafted"] += len(new)
        return drafts

    spec.prepare = prepare
    return tally


def test_accept_reject_and_rollback_with_scripted_drafts(ckpt, reference):
    """All right, second wrong, first wrong, in turn: the output is the plain greedy one and
    the counters are exactly the scripted accepts (so rollback left the state exact)."""
    prompts, alone, _, _ = reference
    engine = _engine(ckpt, 2, num_seqs=2)
    tally = _oracle(engine, {"0": alone[1], "1": alone[3]},
                    lambda v, j: (v % 3 == 1 and j == 1) or (v % 3 == 2 and j == 0))
    toks, _, most = _run(engine, [prompts[1], prompts[3]], [SamplingParams(max_tokens=20, ignore_eos=True)] * 2)
    assert [toks["0"], toks["1"]] == [alone[1], alone[3]]
    spec = engine.stats()["speculative"]
    assert spec["accepted"] == tally["accepted"] > 0 and spec["drafted"] == tally["drafted"]
    assert spec["verify_steps"] == tally["verify"] and spec["emitted"] == tally["accepted"] + tally["verify"]
    assert most == 3


def _first_new(tokens: list[int], start: int) -> int:
    """Index >= start of a token that does not occur earlier in `tokens`."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_stops_when_several_tokens_arrive_in_one_step(ckpt, reference):
    """With always-right drafts every step brings 3 tokens; max_tokens, stop tokens, EOS and
    min_tokens still end each request exactly where drafting off does."""
    prompts, _, _, _ = reference
    prompt = prompts[2]
    long = generate_ids(_engine(ckpt, num_seqs=1), [prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    stop_at, eos_at = _first_new(long, 5), _first_new(long, 7)
    cases = [  # (params, expected tokens or None, finish reason)
        (SamplingParams(max_tokens=8, ignore_eos=True), long[:8], "length"),  # drafts trimmed at the end
        (SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[long[stop_at]]), long[:stop_at + 1], "stop"),
        (SamplingParams(max_tokens=20), long[:eos_at + 1], "stop"),  # EOS (patched below) inside a run
        (SamplingParams(max_tokens=20, ignore_eos=True, min_tokens=stop_at + 3, stop_token_ids=[long[stop_at]]),
         None, None),  # the stop token is masked until min_tokens: drafting waits until then
    ]
    for params, expected, reason in cases:
        off, on = _engine(ckpt, num_seqs=1), _engine(ckpt, 2, num_seqs=1)
        for e in (off, on):
            e.eos_token_ids = [long[eos_at]]
        want, want_reason, _ = _run(off, [prompt], [params])
        if expected is not None:
            assert want["0"] == expected and want_reason["0"] == reason
        _oracle(on, {"0": want["0"] + [0] * 20}, lambda v, j: False)
        got, got_reason, most = _run(on, [prompt], [params])
        assert got == want and got_reason == want_reason
        assert most == 3


def test_sampled_and_logprob_requests_decode_normally(ckpt, reference):
    prompts, alone, _, _ = reference
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)
    with_lp = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    mix = [greedy, sampled, with_lp, greedy]
    want, _, _ = _run(_engine(ckpt), prompts, mix)
    on = _engine(ckpt, 1)
    drafted_for = []
    real = on.runner.spec.prepare

    def prepare(items):
        drafts = real(items)
        drafted_for.extend(items[i][0].request_id for i in drafts)
        return drafts

    on.runner.spec.prepare = prepare
    got, _, _ = _run(on, prompts, mix)
    assert got == want and got["0"] == alone[0][:12]
    assert set(drafted_for) == {"0", "3"}


def test_other_families_and_mtp_less_checkpoints_ignore_the_option(tiny_dir, tmp_path):
    import json
    import shutil

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    qwen = _engine(tiny_dir("qwen3_moe"), 2)
    assert qwen.runner.spec is None and qwen.scheduler.lookahead is None
    assert "speculative" not in qwen.stats()
    assert generate_ids(qwen, [[5, 6, 7]], params) == generate_ids(_engine(tiny_dir("qwen3_moe")), [[5, 6, 7]], params)
    plain = tmp_path / "no_mtp"
    shutil.copytree(tiny_dir("glm5_next"), plain)
    raw = json.loads((plain / "config.json").read_text())
    raw["text_config"]["num_nextn_predict_layers"] = 0
    (plain / "config.json").write_text(json.dumps(raw))
    assert _engine(plain, 1).runner.spec is None


def test_drafts_never_preempt_and_respect_the_budget():
    """Scheduler: drafts come from the step budget and the free pages left after every running
    request got its token; they shrink to fit and never cause a preemption."""
    from tiermoe.scheduler.kv_pages import KVPages
    from tiermoe.scheduler.request import Request
    from tiermoe.scheduler.scheduler import Scheduler

    def decoding(sched, kv, rid, prompt_len):
        req = Request(rid, list(range(3, 3 + prompt_len)), SamplingParams(), 10)
        req.output_ids, req.num_computed = [1], prompt_len  # one token sampled, not yet computed
        assert kv.allocate(req.pages, prompt_len)
        req.slot = sched.free_slots.pop()
        sched.running.append(req)
        return req

    kv = KVPages(num_pages=10, page_size=4)
    sched = Scheduler(kv, max_num_seqs=2, max_batched_tokens=4, lookahead=lambda req: 2)
    decoding(sched, kv, "a", 3), decoding(sched, kv, "b", 3)
    assert [n for _, n in sched.schedule().items] == [3, 1]  # budget 4: 1 + 1, then 2 drafts for "a"

    kv = KVPages(num_pages=2, page_size=4)
    sched = Scheduler(kv, max_num_seqs=2, max_batched_tokens=64, lookahead=lambda req: 2)
    decoding(sched, kv, "a", 2), decoding(sched, kv, "b", 2)
    batch = sched.schedule()  # each page holds 4 tokens: 2 computed + 1 + 1 draft, no page left
    assert [n for _, n in batch.items] == [2, 2]
    assert not batch.preempted and sched.num_preemptions == 0 and kv.num_free == 0


def test_cli_flags():
    from tiermoe.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--num-speculative-tokens", "2"]).num_speculative_tokens == 2
    generate = parser.parse_args(["generate", "--num-speculative-tokens", "1", "--prompt", "hi"])
    assert generate.num_speculative_tokens == 1
    assert parser.parse_args(["serve"]).num_speculative_tokens == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--num-speculative-tokens", "3"])


def test_prompt_logprobs_arrive_with_the_first_token(ckpt, reference):
    """A prompt whose last chunk is a single token is not drafted from: its first token (and
    the prompt logprobs that travel with it) comes from the ordinary prefill step."""
    prompts, alone, _, _ = reference
    engine = _engine(ckpt, 2, num_seqs=1, max_num_batched_tokens=11)  # 23 = 11 + 11 + 1
    engine.add_request("p", prompts[1], SamplingParams(max_tokens=20, ignore_eos=True, prompt_logprobs=0))
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert [t for o in outs for t in o.new_token_ids] == alone[1]
    assert len(outs[0].new_token_ids) == 1 and len(outs[0].prompt_logprobs) == len(prompts[1])
    assert engine.stats()["speculative"]["verify_steps"] > 0


def test_packed_store_drafts_with_the_stores_mtp_experts(ckpt, tmp_path):
    """Through the tiered store (bf16, a host tier far smaller than the experts) the MTP layer's
    routed experts come from the store too, and tokens still equal drafting off."""
    from tiermoe.store.pack import pack

    store = tmp_path / "store"
    pack(str(ckpt), str(store), quant="bf16", direct_io=False, progress=False, log=lambda s: None)
    opts = {"host_expert_gb": 0.0002, "no_direct_io": True}
    prompts = [p[:30] for p in _prompts(512, seed=3)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    off = build_engine_core(str(store), device="cpu", dtype="bfloat16", max_num_seqs=4, options=opts)
    on = build_engine_core(str(store), device="cpu", dtype="bfloat16", max_num_seqs=4,
                           options={**opts, "num_speculative_tokens": 2})
    assert generate_ids(on, prompts, params) == generate_ids(off, prompts, params)
    assert on.stats()["speculative"]["accepted"] > 0 and on.stats()["experts"]["disk"]["reads"] > 0
