"""The real engine behind the real server (tiny random model, CPU), driven by the openai client:
response_format through constrained decoding, logit_bias, prompt logprobs under echo with
token ids, and exact teacher forcing by `bench panel make` + `panel score --mode token-ids`."""

from __future__ import annotations

import asyncio
import json
import math

import jsonschema
import openai
import pytest
import torch
from testkit.schemas import closed_object_schema

pytest.importorskip("llguidance")

SCHEMA = closed_object_schema(city={"type": "string", "maxLength": 8},
                              days={"type": "integer", "minimum": 1, "maximum": 14},
                              rain={"type": "boolean"})
MSG = [{"role": "user", "content": "Plan a trip. Answer in JSON."}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # else a think block may come first


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    """(server, openai client, engine core, checkpoint path) for a tiny qwen3_moe checkpoint."""
    from server_harness import ServerThread
    from tiermoe.engine.async_engine import AsyncEngine
    from tiermoe.engine.build import build_engine_core
    from tiermoe.server.app import create_app

    path = str(tiny_dir("qwen3_moe"))
    core = build_engine_core(path, device="cpu", dtype="float32", max_model_len=512, max_num_seqs=4)
    app = create_app(AsyncEngine(core), served_model_name="tiny", max_model_len=512)
    with ServerThread(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        yield server, client, core, path


def test_chat_json_schema_greedy_and_sampled(tiny):
    _, client, _, _ = tiny
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}
    greedy = client.chat.completions.create(model="tiny", messages=MSG, response_format=fmt, max_tokens=80,
                                            temperature=0, extra_body=NO_THINKING)
    sampled = client.chat.completions.create(model="tiny", messages=MSG, response_format=fmt, max_tokens=80,
                                             temperature=1.0, seed=3, n=2, extra_body=NO_THINKING)
    for choice in greedy.choices + sampled.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    stream = client.chat.completions.create(model="tiny", messages=MSG, response_format=fmt, max_tokens=80,
                                            temperature=0, stream=True, extra_body=NO_THINKING)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == greedy.choices[0].message.content


def test_completions_regex_and_bad_grammar(tiny):
    _, client, _, _ = tiny
    r = client.completions.create(model="tiny", prompt="Code:", max_tokens=30, temperature=0.8, seed=2,
                                  extra_body={"response_format": {"type": "json_object"}, "ignore_eos": True})
    text = r.choices[0].text
    assert text.lstrip().startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}}})


def test_logit_bias_forces_and_bans_tokens(tiny):
    _, client, core, _ = tiny
    tok = core.tokenizer
    forced = tok.encode(" Paris", add_special_tokens=False)[0]
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, temperature=0, logprobs=True,
                                       logit_bias={str(forced): 100}, extra_body={"return_tokens_as_token_ids": True})
    assert [t.token for t in r.choices[0].logprobs.content] == [f"token_id:{forced}"] * 4
    assert r.choices[0].message.content.strip() == tok.decode([forced] * 4).strip()
    plain = client.completions.create(model="tiny", prompt="The sky is", max_tokens=1, temperature=0,
                                      extra_body={"return_tokens_as_token_ids": True}, logprobs=1)
    first = int(plain.choices[0].logprobs.tokens[0].split(":")[1])
    banned = client.completions.create(model="tiny", prompt="The sky is", max_tokens=1, temperature=0,
                                       extra_body={"return_tokens_as_token_ids": True}, logprobs=1,
                                       logit_bias={str(first): -100})
    assert int(banned.choices[0].logprobs.tokens[0].split(":")[1]) != first
    # logprobs stay the model's own, whatever the bias did to the choice
    assert banned.choices[0].logprobs.top_logprobs[0] == plain.choices[0].logprobs.top_logprobs[0]


def test_echo_prompt_logprobs_match_a_direct_forward(tiny):
    from tiermoe.eval.parity import reference_logits

    _, client, core, path = tiny
    ids = core.tokenizer.encode("The capital of France is Paris, and the capital of Italy is Rome.")
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0, echo=True, logprobs=3,
                                  extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    n = len(ids)
    assert lp.tokens[:n] == [f"token_id:{t}" for t in ids] and len(lp.tokens) == n + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = torch.log_softmax(reference_logits(path, [ids], "cpu", torch.float32)[0], -1)  # [n, V] transformers
    for p in range(1, n):
        assert math.isclose(lp.token_logprobs[p], ref[p - 1, ids[p]].item(), abs_tol=1e-4)
        top = lp.top_logprobs[p]
        want = ref[p - 1].topk(3)
        assert [int(k.split(":")[1]) for k in top] == want.indices.tolist()
    # echo + max_tokens 0 scores the prompt alone
    s = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert s.usage.completion_tokens == 0 and len(s.choices[0].logprobs.token_logprobs) == n
    assert s.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:n], abs=1e-5)


def test_panel_token_ids_teacher_forcing_is_exact(tiny, tmp_path):
    """`bench panel make` then `panel score --mode token-ids` against the same server: every
    position is forced by ids, so top-1 agrees everywhere and the KL is ~0."""
    from tiermoe.bench.panel import PanelMakeConfig, make_panel
    from tiermoe.bench.panel_score import PanelScoreConfig, score_panel

    server, _, _, _ = tiny
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["The weather today is", "Experts live in", "One two three"]))
    panel = asyncio.run(make_panel(PanelMakeConfig(url=server.url, prompts_file=str(prompts), max_tokens=5)))
    assert panel["has_token_ids"]
    r = asyncio.run(score_panel(PanelScoreConfig(url=server.url, panel=panel, mode="token-ids")))
    assert r["teacher_forcing"] == ["token-ids"]
    assert r["positions"] == sum(len(it["token_ids"]) for it in panel["items"]) == 15
    assert r["positions_misaligned"] == 0
    assert r["top1_agreement"] == 1.0 and r["mean_kl"] < 1e-6
    assert r["greedy_exact_fraction"] == 1.0


def test_json_answer_after_reasoning(tiny):
    """Thinking on: the model may think first, and the JSON comes after </think> (a bias on
    </think> keeps the random model's reasoning short)."""
    _, client, core, _ = tiny
    close = core.tokenizer.convert_tokens_to_ids("</think>")
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}
    r = client.chat.completions.create(model="tiny", messages=MSG, response_format=fmt, max_tokens=120, n=3,
                                       temperature=1.0, seed=11, logit_bias={str(close): 8})
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert any(getattr(c.message, "reasoning_content", None) for c in r.choices)


def test_a_pattern_the_grammar_engine_gives_up_on_midway_is_a_400(tiny):
    """A pattern such as (a{1000}){1000} compiles, but the grammar engine's lexer gives up on it
    once it has to expand it during decoding ("too many expressions"). The schema is the
    request's own doing: a 400 naming the response format (an in-band error of that type in a
    stream), never a 500 carrying the grammar engine's internal state; later requests are served."""
    server, client, _, _ = tiny
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
              "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=64, response_format=fmt,
                                       extra_body=NO_THINKING)
    err = e.value.body
    assert err["code"] == "unsupported_schema" and "<state>" not in err["message"] and "\n" not in err["message"]
    with pytest.raises(openai.APIError) as e:  # the client raises on the stream's in-band error event
        list(client.chat.completions.create(model="tiny", messages=MSG, max_tokens=64, response_format=fmt,
                                            stream=True, extra_body=NO_THINKING))
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["code"] == "unsupported_schema"
    ok = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, extra_body=NO_THINKING)
    assert ok.choices[0].finish_reason in ("stop", "length")
