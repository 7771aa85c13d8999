"""Content parts a client replays from an earlier turn: a refusal the model gave is an assistant
content part of type "refusal" (chat) or a "refusal" part of an assistant message item
(Responses), and both APIs accept it back in the conversation. The server refused it as "not
supported (text only)", so a client could not continue any conversation the model had refused in.
It is read as the assistant's text. Only an assistant may hold one, as in the OpenAI API.
"""

from __future__ import annotations

import httpx
import pytest

USER = {"role": "user", "content": "hi"}


def test_chat_assistant_refusal_part_is_accepted(client):
    messages = [USER, {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
                {"role": "user", "content": "then say hi"}]
    r = client.chat.completions.create(model="scripted", messages=messages, max_tokens=4)
    assert r.choices[0].message.content


def test_chat_refusal_part_renders_as_the_assistant_text(server):
    refusal = [{"type": "refusal", "refusal": "No thanks."}]
    text = [{"type": "text", "text": "No thanks."}]
    counts = [httpx.post(server.url + "/tokenize", timeout=30, json={
        "messages": [USER, {"role": "assistant", "content": c}, USER]}).json()["tokens"] for c in (refusal, text)]
    assert counts[0] == counts[1]


def test_responses_assistant_refusal_part_is_accepted(client):
    r = client.responses.create(model="scripted", max_output_tokens=4, input=[
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
        {"role": "user", "content": "again"}])
    assert r.output_text


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}]},
     "messages[0].content[0].type"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": [{"type": "refusal"}]}, USER]},
     "messages[0].content[0].refusal"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
     "input[0].content[0].text"),
])
def test_malformed_parts_name_the_field(server, path, body, param):
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "not supported" not in err["message"], err
