"""Forced tool calls on /v1/chat/completions and /v1/messages: a schema the grammar engine cannot compile, and a
response format alongside, are refused at request time.

A forced call's arguments are generated under its schema's grammar. A schema that could not be
compiled was served unconstrained, and the call came back with made-up arguments ("{}" for a schema
requiring a property); a response format alongside replaced the tool grammar after the call's
opening and returned markup as content. Both are now a 400 before anything runs."""

import openai
import pytest

MSG = [{"role": "user", "content": "call it"}]
UNSATISFIABLE = {"type": "object", "additionalProperties": False, "required": ["zz"]}
FINE = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _tool(name, params):
    return {"type": "function", "function": {"name": name, "parameters": params}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "bad"}}])
def test_a_forced_tool_whose_schema_cannot_be_enforced_is_a_400(client, choice):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="scripted", messages=MSG, max_tokens=20, tool_choice=choice,
                                       tools=[_tool("ok", FINE), _tool("bad", UNSATISFIABLE)])
    err = e.value.body
    assert err["code"] == "unsupported_schema" and err["param"] == "tools[1].parameters", err
    assert "cannot be enforced" in err["message"] and "\n" not in err["message"]


def test_only_the_tools_a_forced_call_may_use_are_enforced(client):
    """A named choice enforces its own tool; "auto" enforces none (the model may answer in text)."""
    tools = [_tool("ok", FINE), _tool("bad", UNSATISFIABLE)]
    named = {"type": "function", "function": {"name": "ok"}}
    r = client.chat.completions.create(model="scripted", messages=MSG, max_tokens=60, tools=tools, tool_choice=named)
    assert r.choices[0].finish_reason in ("tool_calls", "stop", "length")
    r = client.chat.completions.create(model="scripted", messages=MSG, max_tokens=20, tools=tools, tool_choice="auto")
    assert r.choices[0].message.role == "assistant"


@pytest.mark.parametrize("fmt", [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}},
])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "ok"}}])
def test_a_forced_tool_call_with_a_response_format_is_a_400(client, fmt, choice):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="scripted", messages=MSG, max_tokens=20, tools=[_tool("ok", FINE)],
                                       tool_choice=choice, response_format=fmt)
    err = e.value.body
    assert err["param"] == "response_format" and err["code"] == "conflicting_constraints"
    assert "tool_choice" in err["message"] and fmt["type"] in err["message"]


def test_auto_tools_with_a_response_format_are_still_served(client):
    r = client.chat.completions.create(model="scripted", messages=MSG, max_tokens=20, tools=[_tool("ok", FINE)],
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.role == "assistant"


def test_responses_route_applies_the_same_checks(client):
    """/v1/responses forces calls the same way, so it refuses the same requests."""
    bad = {"type": "function", "name": "bad", "parameters": UNSATISFIABLE}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="scripted", input="call it", tools=[bad], tool_choice="required")
    assert e.value.body["code"] == "unsupported_schema" and e.value.body["param"] == "tools[0].parameters"
    ok = {"type": "function", "name": "ok", "parameters": FINE}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="scripted", input="call it", tools=[ok], tool_choice="required",
                                text={"format": {"type": "json_object"}})
    assert e.value.body["code"] == "conflicting_constraints" and e.value.body["param"] == "text.format"


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "bad"}])
def test_a_forced_anthropic_tool_whose_schema_cannot_be_enforced_is_a_400(anthropic_client, choice):
    """/v1/messages forces a call with tool_choice any or tool: the same check, Anthropic's error shape."""
    import anthropic

    tools = [{"name": "ok", "input_schema": FINE}, {"name": "bad", "input_schema": UNSATISFIABLE}]
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model="scripted", max_tokens=20, messages=MSG, tools=tools,
                                         tool_choice=choice)
    body = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert "cannot be enforced" in body["error"]["message"]
    r = anthropic_client.messages.create(model="scripted", max_tokens=20, messages=MSG, tools=tools,
                                         tool_choice={"type": "auto"})  # auto enforces none: still served
    assert r.role == "assistant"


@pytest.mark.parametrize("field", ["output_config", "output_format"])
def test_a_forced_anthropic_tool_with_a_format_names_the_field_sent(anthropic_client, field):
    """The same conflict on /v1/messages, whichever of the two format fields carried the format."""
    import anthropic

    fmt = {"type": "json_schema", "schema": FINE}
    extra = {"output_config": {"format": fmt}} if field == "output_config" else {"output_format": fmt}
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model="scripted", max_tokens=20, messages=MSG, tool_choice={"type": "any"},
                                         tools=[{"name": "ok", "input_schema": FINE}], extra_body=extra)
    message = e.value.body["error"]["message"]
    assert message.startswith("output_config.format" if field == "output_config" else "output_format ("), message
    assert "tool_choice" in message
