"""Anthropic Messages: assistant prefill and structured outputs (output_config.format), with the
official client against a scripted server that records the prompts and sampling params it gets."""

import anthropic
import pytest
from server_harness import start_server

SCHEMA = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"],
          "additionalProperties": False}
COLORS = [{"role": "user", "content": "Name three primary colors"}]


@pytest.fixture(scope="module")
def recorded(tokenizer):
    """(server, list of (prompt text, SamplingParams) the engine was given)."""
    seen = []
    with start_server(tokenizer, core_kwargs={"max_model_len": 4096, "step_delay_s": 0.001},
                      max_model_len=4096) as s:
        add = s.core.add_request

        def spy(request_id, prompt_ids, params):
            seen.append((tokenizer.decode(prompt_ids, skip_special_tokens=False), params))
            return add(request_id, prompt_ids, params)

        s.core.add_request = spy
        yield s, seen


@pytest.fixture(scope="module")
def ac(recorded):
    return anthropic.Anthropic(base_url=recorded[0].url, api_key="unused", max_retries=0, timeout=30)


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_is_continued_not_repeated(recorded, ac, stream):
    _, seen = recorded
    messages = COLORS + [{"role": "assistant", "content": "Red, yellow"}]
    if stream:
        with ac.messages.stream(model="scripted", max_tokens=50, messages=messages) as s:
            m = s.get_final_message()
    else:
        m = ac.messages.create(model="scripted", max_tokens=50, messages=messages)
    prompt = seen[-1][0]
    assert prompt.endswith("<|im_start|>assistant\nRed, yellow"), prompt  # the turn is left open
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == ", blue" and m.stop_reason == "end_turn"


def test_prefill_as_blocks_and_count_tokens_agree(recorded, ac):
    messages = COLORS + [{"role": "assistant", "content": [{"type": "text", "text": "Red, yellow"}]}]
    m = ac.messages.create(model="scripted", max_tokens=50, messages=messages)
    assert m.content[0].text == ", blue"
    assert recorded[1][-1][0].endswith("assistant\nRed, yellow")
    n = ac.messages.count_tokens(model="scripted", messages=messages)
    assert n.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)


def test_empty_final_assistant_message_is_a_new_turn(recorded, ac):
    m = ac.messages.create(model="scripted", max_tokens=50, messages=COLORS + [{"role": "assistant", "content": ""}])
    assert recorded[1][-1][0].endswith("<|im_start|>assistant\n")
    assert m.content[-1].text == "Red, yellow, blue"


@pytest.mark.parametrize("prefill", ["Red, yellow ", "Red,\n", " "])
def test_prefill_ending_in_whitespace_is_refused(ac, prefill):
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.create(model="scripted", max_tokens=5,
                           messages=COLORS + [{"role": "assistant", "content": prefill}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "trailing whitespace" in e.value.body["error"]["message"]


def test_prefill_with_a_forced_tool_is_refused(ac):
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    with pytest.raises(anthropic.BadRequestError, match="prefill"):
        ac.messages.create(model="scripted", max_tokens=5, tools=tools, tool_choice={"type": "any"},
                           messages=COLORS + [{"role": "assistant", "content": "Red"}])


@pytest.mark.parametrize("stream", [False, True])
def test_output_config_format_is_enforced(recorded, ac, stream):
    _, seen = recorded
    kwargs = dict(model="scripted", max_tokens=30, output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
                  messages=[{"role": "user", "content": "Give me a person as json"}])
    if stream:
        with ac.messages.stream(**kwargs) as s:
            s.get_final_message()
    else:
        ac.messages.create(**kwargs)
    structured = seen[-1][1].structured
    assert structured["type"] == "json_schema" and structured["schema"] == SCHEMA


def test_beta_output_format_is_enforced(recorded, ac):
    ac.messages.create(model="scripted", max_tokens=30, messages=[{"role": "user", "content": "a person"}],
                       extra_body={"output_format": {"type": "json_schema", "schema": SCHEMA}})
    assert recorded[1][-1][1].structured["schema"] == SCHEMA


def test_harmless_unknown_fields_still_accepted(recorded, ac):
    m = ac.messages.create(model="scripted", max_tokens=100, messages=COLORS, metadata={"user_id": "u"},
                           service_tier="auto", output_config={"effort": "low"})
    assert m.content[-1].text == "Red, yellow, blue" and recorded[1][-1][1].structured is None


@pytest.mark.parametrize("fmt, needle", [
    ({"type": "xml", "schema": SCHEMA}, "json_schema"),
    ({"type": "json_schema"}, "schema"),
    ({"type": "json_schema", "schema": {"type": "string", "pattern": "(a)\\1"}}, "cannot be enforced"),
    ({"type": "json_schema", "schema": {"type": 5}}, "invalid JSON schema"),
])
def test_bad_output_formats_are_400(ac, fmt, needle):
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.create(model="scripted", max_tokens=5, output_config={"format": fmt},
                           messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and needle in e.value.body["error"]["message"]


def test_output_format_conflicts_are_400(ac):
    fmt = {"format": {"type": "json_schema", "schema": SCHEMA}}
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
        ac.messages.create(model="scripted", max_tokens=5, output_config=fmt, tools=tools,
                           tool_choice={"type": "any"}, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError, match="prefill"):
        ac.messages.create(model="scripted", max_tokens=5, output_config=fmt,
                           messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "{"}])
