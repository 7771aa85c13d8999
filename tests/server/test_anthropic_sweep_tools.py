"""Tool definitions on /v1/messages: Anthropic's own tools (server tools such as web search, and the
client tools with Anthropic-defined schemas) are a 400 that names the tool type; custom tools,
with or without `type: "custom"` and cache_control, are served."""

import anthropic
import pytest

CUSTOM = {"name": "get_weather", "description": "Current weather",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("tool", [
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
    {"type": "bash_20250124", "name": "bash"},
    {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
    {"type": "code_execution_20250825", "name": "code_execution"},
    {"type": "made_up_tool_type", "name": "f", "input_schema": {"type": "object"}},
], ids=lambda t: t["type"])
def test_anthropic_defined_tools_are_a_400_naming_the_type(anthropic_client, tool):
    for call, extra in ((anthropic_client.messages.create, {"max_tokens": 20}),
                        (anthropic_client.messages.count_tokens, {})):
        with pytest.raises(anthropic.BadRequestError) as e:
            call(model="scripted", messages=ASK, tools=[CUSTOM, tool], **extra)
        message = e.value.body["error"]["message"]
        assert e.value.body["error"]["type"] == "invalid_request_error"
        assert tool["type"] in message and "tools[1]" in message, message


@pytest.mark.parametrize("tool", [
    {**CUSTOM, "type": "custom"},
    {**CUSTOM, "cache_control": {"type": "ephemeral"}},
    {**CUSTOM, "type": None},
])
def test_custom_tools_in_every_spelling_are_served(anthropic_client, tool):
    m = anthropic_client.messages.create(model="scripted", max_tokens=200, messages=ASK, tools=[tool])
    assert m.stop_reason == "tool_use" and m.content[-1].input == {"city": "Paris"}


def test_a_custom_tool_without_input_schema_is_still_named(anthropic_client):
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model="scripted", max_tokens=20, messages=ASK,
                                         tools=[{"name": "f", "description": "no schema"}])
    assert "tools[0].input_schema" in e.value.body["error"]["message"]
