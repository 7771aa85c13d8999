"""A turn cut off (max_tokens) while the model writes a tool call's start marker: the partial
marker is markup, never content; a finished answer keeps its own text."""

import json

import anthropic
import openai
import pytest
from server_harness import script, start_server

from tiermoe.server.tool_parsers import GlmToolParser, HermesToolParser

TOOLS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def run(parser, pieces):
    content, calls = "", []
    for piece in pieces:
        c, d = parser.feed(piece)
        content += c
        calls += d
    c, d = parser.finish()
    return content + c, parser.calls


@pytest.mark.parametrize("cls", [HermesToolParser, GlmToolParser])
@pytest.mark.parametrize("tail", ["\n<", "\n<tool", "\n<tool_call"])
def test_partial_start_marker_after_a_call_is_dropped(cls, tail):
    call = CALL if cls is HermesToolParser else "<tool_call>get_weather\n<arg_key>city</arg_key>\n" \
        "<arg_value>Paris</arg_value>\n</tool_call>"
    text = call + tail
    content, calls = run(cls(TOOLS, unique_calls=True), [text[i:i + 3] for i in range(0, len(text), 3)])
    assert content == "" and [c.name for c in calls] == ["get_weather"]
    content, calls = run(cls(TOOLS), [text])
    assert content == "" and len(calls) == 1


def test_partial_start_marker_after_text_is_dropped_but_text_kept():
    content, calls = run(HermesToolParser(TOOLS), ["Let me check the weather.", "\n<tool_c"])
    assert content == "Let me check the weather." and calls == []


def test_a_completed_answer_keeps_its_own_characters():
    assert run(HermesToolParser(TOOLS), ["Compare them with <"])[0] == "Compare them with <"
    assert run(HermesToolParser(TOOLS), ["a <tool_cal> b"])[0] == "a <tool_cal> b"
    assert run(HermesToolParser(TOOLS), ["<tool_call> not json"])[0] == "<tool_call> not json"


# ---- through the server: a model that starts a second call and is cut off in its marker ----

# ordinary tokens (the marker itself is one special token in the test tokenizer, as it is not in
# every model's), so max_tokens can cut right after "<tool_call"
SECOND = CALL + "\n<tool_call and the rest"


def cut_script(prompt: str):
    if "CUT_CALL" in prompt:
        return SECOND
    return script(prompt)


@pytest.fixture(scope="module")
def cut_server(tokenizer):
    with start_server(tokenizer, core_kwargs={"script": cut_script, "max_model_len": 4096},
                      max_model_len=4096) as s:
        s.tokenizer = tokenizer
        yield s


def cut_max_tokens(tokenizer, forced_prefix: str) -> int:
    """Tokens the scripted model writes up to and including the second, unfinished "<tool_call"."""
    ids = tokenizer.encode(SECOND[len(forced_prefix):], add_special_tokens=False)
    for n in range(1, len(ids) + 1):
        if tokenizer.decode(ids[:n], skip_special_tokens=False).endswith("\n<tool_call"):
            return n
    raise AssertionError("the script never writes the partial marker")


def test_openai_required_cut_off_has_no_markup(cut_server):
    c = openai.OpenAI(base_url=cut_server.url + "/v1", api_key="x", max_retries=0, timeout=30)
    n = cut_max_tokens(cut_server.tokenizer, "<tool_call>\n")
    r = c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "CUT_CALL weather?"}],
                                  tools=[{"type": "function", "function": TOOLS[0]}], tool_choice="required",
                                  max_tokens=n)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    assert [json.loads(t.function.arguments) for t in choice.message.tool_calls] == [{"city": "Paris"}]


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_any_cut_off_has_no_markup(cut_server, stream):
    c = anthropic.Anthropic(base_url=cut_server.url, api_key="x", max_retries=0, timeout=30)
    tools = [{"name": "get_weather", "input_schema": TOOLS[0]["parameters"]}]
    kwargs = dict(model="scripted", max_tokens=cut_max_tokens(cut_server.tokenizer, "<tool_call>\n"), tools=tools,
                  tool_choice={"type": "any"}, messages=[{"role": "user", "content": "CUT_CALL weather?"}])
    if stream:
        with c.messages.stream(**kwargs) as s:
            m = s.get_final_message()
    else:
        m = c.messages.create(**kwargs)
    assert m.stop_reason == "max_tokens"
    assert [(b.type, getattr(b, "input", None)) for b in m.content] == [("tool_use", {"city": "Paris"})]
