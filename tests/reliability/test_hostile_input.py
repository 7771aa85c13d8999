"""Request content that once crashed (500) or froze the server, on every route that reads it.

Schemas nested past the limit or too large, grammar options of the wrong type, patterns a
linear-time engine cannot take, a backtracking pattern whose old re-check ran for ever on the
event loop, and token budgets of 0 or below. Each must be a 400 naming the field and the limit
in the API's own error shape, and the server must answer a normal request at once afterwards.
"""

from __future__ import annotations

import threading
import time

import anthropic
import httpx
import openai
import pytest

from tiermoe.engine.scripted import default_script

from hostile_values import BACKTRACKING_PATTERN, BAD_SCHEMAS, UNENFORCEABLE_SCHEMAS, deep_schema, object_schema
from reliability_util import assert_error_body, healthy, scripted_server

MSG = [{"role": "user", "content": "hi"}]


def regex_script(prompt: str):
    """The scripted model, plus a JSON string that a backtracking matcher takes exponential time
    to refuse under BACKTRACKING_PATTERN (60 a's then '!') for prompts that ask for it."""
    return '"' + "a" * 60 + '!"' if "BACKTRACK" in prompt else default_script(prompt)


@pytest.fixture(scope="module")
def server():
    with scripted_server(max_model_len=8192, max_num_seqs=8, script=regex_script) as s:
        yield s


def tool(schema: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": schema}}


# every place a client's JSON Schema enters the server: (path, body builder, param of the schema)
SCHEMA_SITES = {
    "chat response_format": ("/v1/chat/completions", lambda s: {
        "messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}},
        "response_format.json_schema.schema"),
    "chat tools": ("/v1/chat/completions", lambda s: {"messages": MSG, "tools": [tool(s)], "tool_choice": "required"},
                   "tools[0].parameters"),
    "completions response_format": ("/v1/completions", lambda s: {
        "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": s}}},
        "response_format.json_schema.schema"),
    "responses tools": ("/v1/responses", lambda s: {
        "input": "x", "tools": [{"type": "function", "name": "f", "parameters": s}], "tool_choice": "required"},
        "tools[0].parameters"),
    "responses text.format": ("/v1/responses", lambda s: {
        "input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": s}}}, "text.format.schema"),
    "messages input_schema": ("/v1/messages", lambda s: {
        "model": "scripted", "max_tokens": 8, "messages": MSG, "tools": [{"name": "f", "input_schema": s}],
        "tool_choice": {"type": "any"}}, "tools[0].parameters"),
    "count_tokens input_schema": ("/v1/messages/count_tokens", lambda s: {
        "model": "scripted", "messages": MSG, "tools": [{"name": "f", "input_schema": s}]}, "tools[0].parameters"),
    "tokenize tools": ("/tokenize", lambda s: {"messages": MSG, "tools": [tool(s)]}, "tools[0].parameters"),
}
FORMAT_SITES = [k for k in SCHEMA_SITES if "format" in k]
# schemas compiled into a grammar: response formats, and the tools of a forced call (tool_choice required / any)
ENFORCED_SITES = [*FORMAT_SITES, "chat tools", "responses tools", "messages input_schema"]


def answered_at_once(url: str) -> None:
    t0 = time.monotonic()
    assert healthy(url) and time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("site", list(SCHEMA_SITES))
def test_schemas_past_the_limits_are_400_everywhere(server, site):
    path, body, param = SCHEMA_SITES[site]
    for name, (schema, code) in BAD_SCHEMAS.items():
        r = httpx.post(server.url + path, json=body(schema), timeout=30)
        assert r.status_code == 400, (site, name, r.status_code, r.text[:300])
        err = assert_error_body(path, r)
        if code == "schema_too_deep":
            assert "more than 64 deep" in err["message"], (name, err)
        elif code == "schema_too_large":
            assert "more than 10000 values" in err["message"], (name, err)
        elif code == "pattern_too_long":
            assert "the limit is 1000" in err["message"], (name, err)
        else:
            assert "x-guidance must be an object" in err["message"], (name, err)
        if not path.startswith("/v1/messages"):
            assert err["param"].startswith(param), (name, err)
            assert code is None or err["code"] == code, (name, err)
    answered_at_once(server.url)


@pytest.mark.parametrize("site", list(SCHEMA_SITES))
def test_schemas_just_inside_the_limits_are_served(server, site):
    """The recursive libraries (metaschema check, grammar compiler, chat template) take what the
    limits let through: the deepest schema of each kind is answered, not crashed on."""
    path, body, _ = SCHEMA_SITES[site]
    kinds = [("items", 61), ("anyOf", 30), ("properties", 30), ("additionalProperties", 61)]
    if site not in ENFORCED_SITES:  # the grammar engine has no `not`: an enforced schema may not use it
        kinds.append(("not", 61))
    for kind, levels in kinds:
        r = httpx.post(server.url + path, json=body(object_schema(deep_schema(kind, levels))), timeout=30)
        assert r.status_code == 200, (site, kind, r.text[:300])


def test_schema_size_limit_counts_every_schema_of_a_request(server):
    """Many small tools cost what one large one does: 200 tools of 55 values each are refused,
    though each alone is far inside the limit."""
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": {
        "type": "object", "properties": {"n": {"enum": list(range(50))}}}}} for i in range(200)]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MSG, "tools": tools})
    err = assert_error_body("/v1/chat/completions", r)
    assert r.status_code == 400 and err["code"] == "schema_too_large" and err["param"].startswith("tools[")
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MSG, "tools": tools[:10]})
    assert r.status_code == 200, r.text[:300]
    answered_at_once(server.url)


def test_grammar_options_of_the_wrong_type_are_400(server):
    """A string where the grammar options object belongs, with the call forced (it is merged into
    the forced call's grammar), on each API; and in a response format."""
    bad = {"type": "object", "properties": {"a": {"type": "string"}}, "x-guidance": "x"}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="scripted", messages=MSG, tools=[tool(bad)], tool_choice="required")
    assert e.value.status_code == 400 and e.value.body["param"] == "tools[0].parameters.x-guidance"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="scripted", messages=MSG, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": bad}})
    assert e.value.body["param"] == "response_format.json_schema.schema.x-guidance"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="scripted", input="x", tool_choice="required",
                                tools=[{"type": "function", "name": "f", "parameters": bad, "strict": False}])
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="scripted", max_tokens=8, messages=MSG, tool_choice={"type": "any"},
                               tools=[{"name": "f", "input_schema": bad}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and "x-guidance" in e.value.body["error"]["message"]
    answered_at_once(server.url)


@pytest.mark.parametrize("site", FORMAT_SITES)
def test_patterns_the_grammar_engine_cannot_take_are_400(server, site):
    path, body, param = SCHEMA_SITES[site]
    for name, schema in UNENFORCEABLE_SCHEMAS.items():
        r = httpx.post(server.url + path, json=body(schema))
        assert r.status_code == 400, (name, r.text[:300])
        err = assert_error_body(path, r)
        assert err["code"] == "unsupported_schema" and err["param"] == param
        assert "not supported" in err["message"] and "\n" not in err["message"], err
    answered_at_once(server.url)


def test_backtracking_pattern_does_not_freeze_the_server():
    """The output re-check used to run Python's backtracking `re` on the event loop: a 61-character
    answer under ^(a|aa)+$ would have held the whole server for longer than any test. Now /health
    answers within 1 s while such requests run, and the failed check is still counted."""
    with scripted_server(max_model_len=1024, max_num_seqs=8, script=regex_script) as server:
        _freeze_case(server)


def _freeze_case(server) -> None:
    def invalid_count() -> float:
        text = httpx.get(server.url + "/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("tiermoe_structured_output_invalid_total"))

    before = invalid_count()
    schema = {"type": "string", "pattern": BACKTRACKING_PATTERN}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    results: list[httpx.Response] = []

    def hostile():
        results.append(httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "BACKTRACK"}], "response_format": fmt}))

    threads = [threading.Thread(target=hostile) for _ in range(4)]
    for t in threads:
        t.start()
    slowest = 0.0
    while any(t.is_alive() for t in threads):
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        slowest = max(slowest, time.monotonic() - t0)
    for t in threads:
        t.join()
    assert slowest < 1.0, slowest
    assert [r.status_code for r in results] == [200] * 4
    assert results[0].json()["choices"][0]["message"]["content"] == '"' + "a" * 60 + '!"'
    deadline = time.monotonic() + 10
    while invalid_count() < before + 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert invalid_count() == before + 4  # checked off the loop, by a linear-time matcher
    answered_at_once(server.url)


BUDGETS = [  # (path, body without the budget, budget field, what absent means)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story"}]}, "max_completion_tokens",
     "rest of context"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story"}]}, "max_tokens",
     "rest of context"),
    ("/v1/completions", {"prompt": "Tell me a story"}, "max_tokens", 16),
    ("/v1/responses", {"input": "Tell me a story"}, "max_output_tokens", "rest of context"),
    ("/v1/messages", {"model": "scripted", "messages": [{"role": "user", "content": "Tell me a story"}]}, "max_tokens",
     "required"),
]


@pytest.mark.parametrize("path,body,field,absent", BUDGETS, ids=[f"{b[0]} {b[2]}" for b in BUDGETS])
def test_token_budgets_zero_negative_and_absent(server, path, body, field, absent):
    for value in (0, -1, -(2**40)):
        r = httpx.post(server.url + path, json={**body, field: value})
        assert r.status_code == 400, (field, value, r.text[:200])
        err = assert_error_body(path, r)
        assert field in err["message"] and ("positive" in err["message"] or "at least 1" in err["message"])
        if not path.startswith("/v1/messages"):
            assert err["param"] == field
    r = httpx.post(server.url + path, json=body, timeout=30)
    if absent == "required":
        assert r.status_code == 400 and "max_tokens" in assert_error_body(path, r)["message"]
    else:
        assert r.status_code == 200, r.text[:200]
        usage = r.json()["usage"]
        produced = usage.get("completion_tokens", usage.get("output_tokens"))
        if absent == 16:
            assert produced == 16
        else:  # the story runs past 16 tokens and ends by itself, well inside the context
            assert 16 < produced < 8192
    r = httpx.post(server.url + path, json={**body, field: 3}, timeout=30)
    usage = r.json()["usage"]
    assert r.status_code == 200 and usage.get("completion_tokens", usage.get("output_tokens")) == 3
    answered_at_once(server.url)


def test_max_completion_tokens_zero_with_the_official_client(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="scripted", messages=MSG, max_completion_tokens=0)
    assert e.value.body["param"] == "max_completion_tokens"
    r = client.chat.completions.create(model="scripted", messages=MSG, max_completion_tokens=2)
    assert r.usage.completion_tokens == 2
