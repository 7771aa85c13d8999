"""Requests current clients send that are valid, and were refused or served wrongly."""

import httpx
import openai
import pytest

GET_PATHS = ["/health", "/v1/models", "/stats", "/metrics", "/ping", "/", "/v1/models/scripted"]


@pytest.mark.parametrize("path", GET_PATHS)
def test_head_is_answered_like_get_without_a_body(server, path):
    """Uptime monitors and load balancers probe with HEAD; it was 405 (allow: GET)."""
    get = httpx.get(server.url + path)
    head = httpx.head(server.url + path)
    assert get.status_code == head.status_code == 200, (path, head.status_code)
    assert head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]


def test_head_on_a_post_route_is_still_405(server):
    r = httpx.head(server.url + "/v1/chat/completions")
    assert r.status_code == 405


def test_models_retrieve(client):
    listed = client.models.list().data[0]
    model = client.models.retrieve("scripted")
    assert model.id == "scripted" and model.object == "model" and model.model_dump() == listed.model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    err = e.value.body
    assert err["code"] == "model_not_found" and err["type"] == "not_found_error" and err["param"] == "model"
    assert "gpt-4o" in err["message"] and "scripted" in err["message"]
    with pytest.raises(openai.NotFoundError):  # ids with a slash are ids too
        client.models.retrieve("org/other")


def test_completions_max_tokens_null_is_the_default(client, server):
    """An explicit null is what leaving the field out is (16), not the whole context."""
    body = {"model": "scripted", "prompt": "Tell me a story", "max_tokens": None}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()
    left_out = client.completions.create(model="scripted", prompt="Tell me a story")
    assert r["usage"]["completion_tokens"] == left_out.usage.completion_tokens == 16
    assert r["choices"][0]["finish_reason"] == "length"
    with_null = client.completions.create(model="scripted", prompt="Tell me a story", extra_body={"max_tokens": None})
    assert with_null.usage.completion_tokens == 16


@pytest.mark.parametrize("role", ["system", "developer"])
def test_a_conversation_of_only_a_system_message_is_answered(client, role):
    r = client.chat.completions.create(model="scripted", messages=[{"role": role, "content": "Say hello."}],
                                       max_tokens=8)
    assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens > 0


def test_a_template_that_refuses_the_conversation_is_still_a_clear_400(client, server, monkeypatch):
    tok = server.app.state.ctx.tokenizer

    def refuse(*args, **kwargs):
        raise ValueError("Conversation roles must alternate user/assistant")

    monkeypatch.setattr(tok, "apply_chat_template", refuse)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="scripted", messages=[{"role": "system", "content": "x"}])
    assert e.value.body["param"] == "messages" and "roles must alternate" in e.value.body["message"]
