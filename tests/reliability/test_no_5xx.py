"""The general rule: nothing in a request's content becomes a 5xx, on any route.

Every field of every route's request model (read from the pydantic models, so a new field is
covered without touching this file) and the nested places where clients put structured values
(message content, tool definitions and schemas, response formats, input items, content
blocks) is set, one at a time, to each hostile value of hostile_values.SWEEP_VALUES: wrong
types, edge numbers and strings, deep JSON, and the schemas that once crashed or froze the
server. Each answer must be a 2xx or a 4xx in the API's error shape from an explicit check (not
the last-resort 400 of handling.run_endpoint, which would mean a value went unchecked), and the
server must answer a normal request at once afterwards.
"""

from __future__ import annotations

import copy
import json
import re
import time

import httpx
import pytest

from hostile_values import SWEEP_VALUES
from reliability_util import assert_error_body, healthy, scripted_server
from tiermoe.server import protocol

MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                     "properties": {"a": {"type": "string"}}}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}

# route -> (request model, a valid body with every structure present, nested paths to probe)
ROUTES = {
    "/v1/chat/completions": (protocol.ChatCompletionRequest, {
        "model": "scripted", "messages": MSG, "max_tokens": 4, "tools": [TOOL], "tool_choice": "auto",
        "response_format": FORMAT, "stream": True, "stream_options": {"include_usage": True}, "logit_bias": {"5": 1},
        "chat_template_kwargs": {"enable_thinking": False}}, [
        "messages[0]", "messages[0].content", "messages[0].role", "messages[0].name", "messages[0].tool_calls",
        "tools[0]", "tools[0].function", "tools[0].function.name", "tools[0].function.parameters",
        "tools[0].function.parameters.properties", "tools[0].function.parameters.properties.a",
        "response_format.type", "response_format.json_schema", "response_format.json_schema.schema",
        "stream_options.include_usage", "logit_bias.5", "chat_template_kwargs.thinking_budget",
        "chat_template_kwargs.enable_thinking"]),
    "/v1/completions": (protocol.CompletionRequest, {
        "model": "scripted", "prompt": ["hi"], "max_tokens": 4, "response_format": FORMAT}, [
        "prompt[0]", "response_format.json_schema.schema"]),
    "/v1/responses": (protocol.ResponsesRequest, {
        "model": "scripted", "max_output_tokens": 4, "input": [
            {"type": "message", "role": "user", "content": "hi"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"}],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        "reasoning": {"effort": "low"}}, [
        "input[0]", "input[0].content", "input[0].role", "input[0].type", "input[1].arguments", "input[1].call_id",
        "input[1].name", "input[2].output", "input[2].call_id", "tools[0]", "tools[0].parameters", "text.format",
        "text.format.schema", "reasoning.effort"]),
    "/v1/messages": (protocol.AnthropicMessagesRequest, {
        "model": "scripted", "max_tokens": 4, "system": "be brief", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "auto"},
        "thinking": {"type": "enabled", "budget_tokens": 8}}, [
        "messages[0].content", "messages[0].content[0]", "messages[0].content[0].text", "messages[1].content[0].id",
        "messages[1].content[0].input", "messages[1].content[0].name", "messages[2].content[0].tool_use_id",
        "messages[2].content[0].content", "tools[0].input_schema", "tools[0].name", "tool_choice.name",
        "thinking.budget_tokens"]),
    "/v1/messages/count_tokens": (protocol.AnthropicCountTokensRequest, {
        "model": "scripted", "messages": MSG, "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, [
        "messages[0].content", "tools[0].input_schema"]),
    "/tokenize": (protocol.TokenizeRequest, {"model": "scripted", "messages": MSG, "tools": [TOOL],
                                             "chat_template_kwargs": {"x": 1}}, [
        "messages[0].content", "tools[0].function.parameters", "chat_template_kwargs.x"]),
    "/detokenize": (protocol.DetokenizeRequest, {"model": "scripted", "tokens": [1, 2]}, ["tokens[0]"]),
}


def fields(model) -> list[str]:
    return [info.alias or name for name, info in model.model_fields.items()]


def put(body: dict, path: str, value) -> dict:
    """A copy of `body` with the value at `path` (a.b[0].c) replaced by `value`."""
    out = copy.deepcopy(body)
    parts = [int(p[1:-1]) if p.startswith("[") else p for p in re.findall(r"\[\d+\]|[^.\[\]]+", path)]
    node = out
    for part in parts[:-1]:
        node = node[part]
    node[parts[-1]] = value
    return out


def check(client: httpx.Client, path: str, body: dict, where: str) -> int:
    data = json.dumps(body, allow_nan=True).encode()
    with client.stream("POST", path, content=data, headers={"content-type": "application/json"}) as r:
        text = r.read().decode("utf-8", "replace")
    assert r.status_code < 500, (path, where, r.status_code, text[:300])
    assert "Traceback" not in text, (path, where)
    if r.status_code >= 400:
        assert_error_body(path, r)  # also: refused by an explicit check, not the last-resort net
    return r.status_code


@pytest.fixture(scope="module")
def server():
    with scripted_server(max_model_len=4096, max_num_seqs=16, max_body_bytes=2**20) as s:
        yield s


@pytest.mark.parametrize("path", list(ROUTES))
def test_every_field_with_every_hostile_value(server, path):
    model, base, nested_paths = ROUTES[path]
    with httpx.Client(base_url=server.url, timeout=60) as client:
        assert check(client, path, base, "base") == 200  # the base body itself is served
        statuses = [check(client, path, put(base, where, value), f"{where}={str(value)[:60]}")
                    for where in fields(model) + nested_paths for value in SWEEP_VALUES]
    assert 200 in statuses and 400 in statuses
    t0 = time.monotonic()
    assert healthy(server.url) and time.monotonic() - t0 < 1.0
