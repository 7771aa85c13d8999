"""Anthropic Messages endpoints through the official `anthropic` client."""

import json

import anthropic
import pytest

WEATHER = [{"name": "get_weather", "description": "Current weather",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def test_message_with_thinking(anthropic_client):
    m = anthropic_client.messages.create(model="scripted", max_tokens=200,
                                         messages=[{"role": "user", "content": "What is 17 * 23?"}])
    kinds = [b.type for b in m.content]
    assert kinds == ["thinking", "text"] and m.content[1].text == "391"
    assert m.stop_reason == "end_turn" and m.usage.output_tokens > 0


def test_thinking_disabled_and_system(anthropic_client):
    m = anthropic_client.messages.create(model="scripted", max_tokens=50, system="Be brief.",
                                         thinking={"type": "disabled"},
                                         messages=[{"role": "user", "content": "What is 17 * 23?"}])
    assert [b.type for b in m.content] == ["text"]


@pytest.mark.parametrize("kind", ["adaptive", "between_tools"])
def test_thinking_the_model_decides(anthropic_client, kind):
    """The SDK's "adaptive" and "between_tools" configs are accepted and think as "enabled" does."""
    m = anthropic_client.messages.create(model="scripted", max_tokens=200, thinking={"type": kind},
                                         messages=[{"role": "user", "content": "What is 17 * 23?"}])
    assert [b.type for b in m.content] == ["thinking", "text"] and m.content[1].text == "391"


def test_stream_accumulates(anthropic_client):
    messages = [{"role": "user", "content": "Name three primary colors"}]
    with anthropic_client.messages.stream(model="scripted", max_tokens=200, messages=messages) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Red, yellow, blue"
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0


def test_max_tokens_and_stop_sequence(anthropic_client):
    m = anthropic_client.messages.create(model="scripted", max_tokens=3,
                                         messages=[{"role": "user", "content": "Tell me a story"}])
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    s = anthropic_client.messages.create(model="scripted", max_tokens=50, stop_sequences=["<|END|>"],
                                         messages=[{"role": "user", "content": "STOP_TEST"}])
    assert s.stop_reason == "stop_sequence" and s.stop_sequence == "<|END|>" and s.content[-1].text == "alpha beta "


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_round_trip(anthropic_client, stream):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    if stream:
        with anthropic_client.messages.stream(model="scripted", max_tokens=200, tools=WEATHER, messages=msgs) as s:
            m = s.get_final_message()
    else:
        m = anthropic_client.messages.create(model="scripted", max_tokens=200, tools=WEATHER, messages=msgs)
    use = next(b for b in m.content if b.type == "tool_use")
    assert m.stop_reason == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    follow = msgs + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user",
         "content": [{"type": "tool_result", "tool_use_id": use.id, "content": json.dumps({"temp_c": 17})}]},
    ]
    m2 = anthropic_client.messages.create(model="scripted", max_tokens=200, tools=WEATHER, messages=follow)
    assert "17" in m2.content[-1].text and m2.stop_reason == "end_turn"


def test_tool_choice_any(anthropic_client):
    m = anthropic_client.messages.create(model="scripted", max_tokens=200, tools=WEATHER, tool_choice={"type": "any"},
                                         messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    assert m.content[-1].type == "tool_use"


def test_count_tokens(anthropic_client, client):
    messages = [{"role": "user", "content": "What is 17 * 23?"}]
    n = anthropic_client.messages.count_tokens(model="scripted", messages=messages)
    r = client.chat.completions.create(model="scripted", messages=messages, max_tokens=1)
    assert n.input_tokens == r.usage.prompt_tokens


def test_errors_use_anthropic_shape(anthropic_client):
    with pytest.raises(anthropic.NotFoundError) as e:
        anthropic_client.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model="scripted", max_tokens=5, messages=[])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError):
        anthropic_client.messages.create(model="scripted", max_tokens=10**6,
                                         messages=[{"role": "user", "content": "hi"}])


def test_thinking_budget_tokens(anthropic_client):
    m = anthropic_client.messages.create(model="scripted", max_tokens=300,
                                         thinking={"type": "enabled", "budget_tokens": 6},
                                         messages=[{"role": "user", "content": "THINK_LONG"}])
    thinking = next(b for b in m.content if b.type == "thinking")
    assert len(thinking.thinking) < 40 and m.content[-1].text == "Done thinking."
