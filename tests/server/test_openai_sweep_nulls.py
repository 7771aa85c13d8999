"""An explicit null for an optional OpenAI field means "the default", as in the OpenAI API and vLLM.

The OpenAI reference marks n, stream, logprobs, echo (and the rest below) "or null"; the
official client sends null when a caller passes None, and frameworks that build requests from
a settings object send every field, unset ones as null. Refusing them ("Input should be a valid
integer") turned valid requests into 400s.
"""

from __future__ import annotations

import httpx
import pytest

MSG = [{"role": "user", "content": "hi"}]


def test_chat_nulls_with_the_official_client(client):
    r = client.chat.completions.create(model="scripted", messages=MSG, max_tokens=3, n=None, stream=None,
                                       logprobs=None, top_logprobs=None, stream_options=None)
    assert len(r.choices) == 1 and r.choices[0].message.content
    assert r.choices[0].logprobs is None


def test_completions_nulls_with_the_official_client(client):
    r = client.completions.create(model="scripted", prompt="hi", max_tokens=3, n=None, stream=None, echo=None,
                                  logprobs=None, best_of=None, suffix=None)
    assert len(r.choices) == 1 and r.choices[0].text and not r.choices[0].text.startswith("hi")


def test_responses_stream_null_with_the_official_client(client):
    r = client.responses.create(model="scripted", input="hi", max_output_tokens=8, stream=None)
    assert r.object == "response" and r.output_text


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": MSG, "ignore_eos": None, "min_tokens": None,
                              "add_generation_prompt": None, "return_tokens_as_token_ids": None}),
    ("/v1/completions", {"prompt": "hi", "ignore_eos": None, "min_tokens": None, "return_tokens_as_token_ids": None}),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": None}),
    ("/tokenize", {"messages": MSG, "add_generation_prompt": None}),
])
def test_vllm_extension_nulls_take_the_default(server, path, body):
    r = httpx.post(server.url + path, json={**body, "max_tokens": 3} if path != "/tokenize" else body, timeout=30)
    assert r.status_code == 200, r.text


def test_a_null_stays_a_type_error_where_null_is_not_allowed(server):
    """messages is required and has no default: null is refused, naming it."""
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": None}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
