"""Requests the OpenAI API (and vLLM) refuse are refused here too, naming the field, and a body that
starts with a UTF-8 byte order mark is read as JSON, as RFC 8259 lets a parser do."""

import json

import httpx
import openai
import pytest

MSG = [{"role": "user", "content": "hi"}]


def test_stream_options_without_stream_is_a_400(client):
    for create, kwargs in ((client.chat.completions.create, {"messages": MSG}),
                           (client.completions.create, {"prompt": "hi"})):
        with pytest.raises(openai.BadRequestError) as e:
            create(model="scripted", max_tokens=2, stream_options={"include_usage": True}, **kwargs)
        assert e.value.body["param"] == "stream_options" and "stream" in e.value.body["message"]
        stream = create(model="scripted", max_tokens=2, stream=True, stream_options={"include_usage": True}, **kwargs)
        assert [c for c in stream if c.usage is not None]  # with stream: served, usage at the end


def test_min_tokens_above_max_tokens_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="scripted", messages=MSG, max_tokens=3, extra_body={"min_tokens": 5})
    assert e.value.body["param"] == "min_tokens" and "max_tokens" in e.value.body["message"]
    r = client.chat.completions.create(model="scripted", messages=MSG, max_tokens=5, extra_body={"min_tokens": 5})
    assert r.usage.completion_tokens == 5


def test_min_tokens_across_a_forced_end_of_thinking(client):
    """A thinking budget ends the think block and resubmits the rest: min_tokens counts the tokens
    already generated, as max_tokens does, so the second part is not refused."""
    r = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "THINK_LONG"}],
                                       max_tokens=30, extra_body={"min_tokens": 30, "thinking_budget": 6})
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 30


def test_background_responses_are_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="scripted", input="hi", background=True)
    assert e.value.body["param"] == "background" and "not supported" in e.value.body["message"]
    assert client.responses.create(model="scripted", input="hi", background=False).status == "completed"


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": "scripted", "messages": MSG, "max_tokens": 2}),
    ("/v1/messages", {"model": "scripted", "messages": MSG, "max_tokens": 2}),
])
def test_a_body_with_a_byte_order_mark_is_read(server, path, body):
    r = httpx.post(server.url + path, content=b"\xef\xbb\xbf" + json.dumps(body).encode(),
                   headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


def test_deprecated_functions_are_refused_not_ignored(client):
    """Ignored, the request would be answered as if the model had no functions at all."""
    fn = {"name": "f", "parameters": {"type": "object"}}
    for extra, param in (({"functions": [fn]}, "functions"), ({"function_call": "auto"}, "function_call")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="scripted", messages=MSG, max_tokens=2, extra_body=extra)
        assert e.value.body["param"] == param and "tools" in e.value.body["message"]
    r = client.chat.completions.create(model="scripted", messages=MSG, max_tokens=2, extra_body={"functions": []})
    assert r.choices[0].message.role == "assistant"  # an empty list asks for nothing
