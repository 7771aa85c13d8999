"""Anthropic SSE event sequences, read raw: an `error` event ends the stream, and the usage in
message_start and the final message_delta mean the same thing (input_tokens: the prompt tokens
not read from cache; cache_read_input_tokens: those that were)."""

import json

import anthropic
import httpx
import pytest


def events(server, body: dict) -> list[tuple[str, dict]]:
    out, name = [], None
    with httpx.stream("POST", server.url + "/v1/messages", json={"model": "scripted", "stream": True, **body},
                      timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[len("data: "):])))
    return out


def test_error_event_ends_the_stream(server):
    seq = events(server, {"max_tokens": 50, "messages": [{"role": "user", "content": "TRIGGER_FAULT"}]})
    names = [n for n, _ in seq]
    assert names[0] == "message_start" and names[-1] == "error", names
    assert "message_delta" not in names and "message_stop" not in names
    assert seq[-1][1]["error"]["type"] == "api_error" and "scripted fault" in seq[-1][1]["error"]["message"]


def test_sdk_raises_on_the_error_event(anthropic_client):
    with pytest.raises(anthropic.APIStatusError, match="scripted fault"):
        with anthropic_client.messages.stream(model="scripted", max_tokens=50,
                                              messages=[{"role": "user", "content": "TRIGGER_FAULT"}]) as s:
            s.get_final_message()


def test_usage_agrees_between_message_start_and_message_delta(server, anthropic_client):
    long = "Please remember this sentence about the weather and the sea. " * 8
    body = {"max_tokens": 20, "messages": [{"role": "user", "content": long + "Name three primary colors"}]}
    events(server, body)  # warm the prefix cache
    seq = events(server, body)
    start = next(d for n, d in seq if n == "message_start")["message"]["usage"]
    final = next(d for n, d in seq if n == "message_delta")["usage"]
    assert final["cache_read_input_tokens"] > 0  # the second request did read from cache
    for key in ("input_tokens", "cache_read_input_tokens"):
        assert start[key] == final[key], (start, final)
    total = anthropic_client.messages.count_tokens(model="scripted", messages=body["messages"]).input_tokens
    assert start["input_tokens"] + start["cache_read_input_tokens"] == total
