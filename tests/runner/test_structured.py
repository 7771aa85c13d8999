"""Grammar-constrained decoding, logit_bias and masks: sampler rows, matcher sync, the engine
under chunked prefill and preemption (tiny random model, CPU)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from testkit.schemas import closed_object_schema

from tiermoe.engine.build import build_engine_core
from tiermoe.engine.llm_engine import generate_ids
from tiermoe.protocol import InvalidRequest, SamplingParams
from tiermoe.runner.sampler import SampleRow, sample
from tiermoe.runner.structured import unpack_bitmask

pytest.importorskip("llguidance")

SCHEMA = closed_object_schema(name={"type": "string", "maxLength": 6},
                              age={"type": "integer", "minimum": 0, "maximum": 120},
                              ok={"type": "boolean"})


def _row(**kw) -> SampleRow:
    return SampleRow(SamplingParams(**kw), [1], [], None)


def test_logit_bias_and_mask_in_sampler():
    logits = torch.randn(3, 40)
    allowed = torch.zeros(40, dtype=torch.bool)
    allowed[[5, 9]] = True
    rows = [_row(logit_bias={7: 100.0}), _row(), _row(temperature=1.0)]
    rows[2].allowed = allowed
    res = sample(logits.clone(), rows, torch.Generator().manual_seed(0))
    assert res.tokens[0].item() == 7
    assert res.tokens[1].item() == logits[1].argmax().item()  # rows without bias or grammar untouched
    assert res.tokens[2].item() in (5, 9)
    banned = _row(logit_bias={int(logits[1].argmax()): -100.0})
    assert sample(logits[1:2].clone(), [banned]).tokens.item() != logits[1].argmax().item()


def test_unpack_bitmask_bit_order():
    bits = torch.zeros(1, 2, dtype=torch.int32)
    bits[0, 0] = (1 << 3) | -(1 << 31)  # tokens 3 and 31 (the sign bit)
    bits[0, 1] = 1  # token 32
    got = unpack_bitmask(bits, 40)
    assert got.shape == (1, 40)
    assert torch.nonzero(got[0]).flatten().tolist() == [3, 31, 32]


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return build_engine_core(str(tiny_dir("qwen3_moe")), device="cpu", dtype="float32", max_num_seqs=4,
                             max_model_len=256)


def _text(engine, ids: list[int]) -> str:
    return engine.tokenizer.decode([t for t in ids if t not in engine.eos_token_ids])


PROMPTS = ("Describe a person as JSON.", "Another person, as JSON please:", "x" * 30, "JSON for someone old:")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(engine, temperature):
    prompts = [engine.tokenizer.encode(t) for t in PROMPTS[:3]]
    params = SamplingParams(max_tokens=80, temperature=temperature, seed=5,
                            structured={"type": "json_schema", "schema": SCHEMA})
    for out in generate_ids(engine, prompts, params):
        jsonschema.validate(json.loads(_text(engine, out)), SCHEMA)


def test_json_object_outputs_that_finish_are_objects(engine):
    """A random model writes unbounded strings, so some runs hit max_tokens; every run that
    ends by itself (the grammar completed) must be a JSON object."""
    prompts = [engine.tokenizer.encode(t) for t in PROMPTS]
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=0, structured={"type": "json_object"})
    outs = generate_ids(engine, prompts, params)
    finished = [o for o in outs if len(o) < 40]
    assert finished, "no run completed its object"
    for out in finished:
        assert isinstance(json.loads(_text(engine, out)), dict)
    for out in outs:
        assert _text(engine, out).lstrip().startswith("{")


def test_regex_and_complete_grammar_stops(engine):
    prompt = engine.tokenizer.encode("code:")
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=1, ignore_eos=True,
                            structured={"type": "regex", "pattern": "[a-z]{2,5}-[0-9]{2}"})
    out = generate_ids(engine, [prompt], params)[0]
    text = _text(engine, out)
    assert len(text) <= 8 and text.split("-")[1].isdigit() and len(text.split("-")[1]) == 2


def test_bad_grammar_is_invalid_request(engine):
    with pytest.raises(InvalidRequest):
        engine.add_request("bad", [1, 2, 3], SamplingParams(structured={"type": "regex", "pattern": "a(b"}))
    with pytest.raises(InvalidRequest):
        engine.add_request("bad2", [1, 2, 3], SamplingParams(logit_bias={10**6: 1.0}))
    assert not engine.has_unfinished_requests()


@pytest.mark.slow
def test_grammar_survives_chunked_prefill_and_preemption(tiny_dir, engine):
    """Several constrained requests on an engine that must chunk and preempt give the tokens
    they give on a roomy engine: the matcher always reflects exactly the request's output_ids."""
    from tiermoe.runner.model_runner import kv_bytes_per_token

    prompts = [engine.tokenizer.encode(t) for t in PROMPTS]
    params = SamplingParams(max_tokens=60, structured={"type": "json_schema", "schema": SCHEMA})
    alone = generate_ids(engine, prompts, params)  # batched equals alone (tests/engine)
    per_token = kv_bytes_per_token(engine.model, engine.model.dtype)
    tight = build_engine_core(str(tiny_dir("qwen3_moe")), device="cpu", dtype="float32", max_num_seqs=4,
                              max_model_len=128, options={"max_num_batched_tokens": 8,
                                                          "kv_cache_gb": 9 * 16 * per_token / 2**30})
    assert generate_ids(tight, prompts, params) == alone
    assert tight.scheduler.num_preemptions > 0
    for out in alone:
        jsonschema.validate(json.loads(_text(engine, out)), SCHEMA)
    assert not tight.runner.grammars and tight.kv.num_free == tight.kv.num_pages


def test_matcher_resyncs_after_rollback(engine):
    """RequestGrammar.sync rolls back tokens the output list no longer holds."""
    g = engine.runner.build_grammar({"type": "json_object"})
    ids = engine.tokenizer.encode('{"a": 1, "b": 2}')
    g.sync(ids)
    assert g.stopped
    g.sync(ids[:2])
    assert not g.stopped and g.tokens == ids[:2] and g.error is None
    g.sync(ids)
    assert g.stopped


def test_reasoning_then_constrained_answer(engine):
    """"open": free reasoning text up to </think>, then the schema; "optional" also lets the
    model skip thinking. A bias on </think> keeps the random model's reasoning short."""
    tok = engine.tokenizer
    close = tok.convert_tokens_to_ids("</think>")
    prompt = tok.encode("Think, then answer in JSON. <think>")
    for mode in ("open", "optional"):
        params = SamplingParams(max_tokens=100, temperature=1.0, seed=4, logit_bias={close: 6.0},
                                structured={"type": "json_schema", "schema": SCHEMA, "reasoning": mode})
        text = tok.decode(generate_ids(engine, [prompt], params)[0], skip_special_tokens=False)
        head, sep, answer = text.partition("</think>")
        assert sep or mode == "optional"
        if mode == "optional" and sep:
            assert head.startswith("<think>")
        jsonschema.validate(json.loads((answer if sep else head).replace("<|im_end|>", "")), SCHEMA)


def test_lark_spec_and_best_effort(engine):
    prompt = engine.tokenizer.encode("yes or no?")
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=0,
                            structured={"type": "lark", "grammar": 'start: "yes" | "no" | "maybe so"'})
    assert _text(engine, generate_ids(engine, [prompt], params)[0]) in ("yes", "no", "maybe so")
    broken = {"type": "lark", "grammar": "start: (", "best_effort": True}
    out = generate_ids(engine, [prompt], SamplingParams(max_tokens=3, ignore_eos=True, structured=broken))[0]
    assert len(out) == 3  # served unconstrained
    with pytest.raises(InvalidRequest):
        engine.add_request("strict", prompt, SamplingParams(structured={"type": "lark", "grammar": "start: ("}))
