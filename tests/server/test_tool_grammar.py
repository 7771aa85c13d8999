"""Forced tool calls (tool_choice required / named) under a grammar: each format's grammar
accepts exactly well-formed calls of the offered tools, and a random tiny model behind the real
server returns calls whose arguments validate against the tool's schema. With parallel calls left
on, a required turn ends: the grammar allows MAX_FORCED_CALLS calls with bounded whitespace, and a
call that repeats an earlier one ends the turn without reaching the client."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tiermoe.engine.scripted import ScriptedReply
from tiermoe.models.tiny_tokenizer import build_tokenizer
from tiermoe.server.structured import lark_marker
from tiermoe.server.tool_parsers.base import MAX_FORCED_CALLS
from tiermoe.server.tool_parsers.glm import GlmToolParser
from tiermoe.server.tool_parsers.hermes import HermesToolParser

pytest.importorskip("llguidance")

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}}, "additionalProperties": False}
TOOLS = [{"name": "get_weather", "parameters": WEATHER}, {"name": "get_time", "parameters": TIME}]


@pytest.fixture(scope="module")
def backend():
    from tiermoe.runner.structured import GrammarBackend

    tok = build_tokenizer()
    return tok, GrammarBackend(tok, len(tok), [tok.convert_tokens_to_ids("<|im_end|>")])


def _accepts(backend, parser, name, text: str) -> bool:
    tok, gb = backend
    grammar = parser.forced_grammar(name, lambda t: lark_marker(tok, t))
    g = gb.build({"type": "lark", "grammar": grammar})
    g.sync(tok.encode(text, add_special_tokens=False))
    return g.error is None and g.matcher.is_accepting()


@pytest.mark.parametrize("name,text,ok", [
    ("get_weather", '{"city": "Oslo", "unit": "c", "days": 3}}\n</tool_call>', True),
    ("get_weather", '{"city": "Oslo", "unit": "k", "days": 3}}\n</tool_call>', False),  # not in the enum
    ("get_weather", '{"city": "Oslo", "unit": "c"}}\n</tool_call>', False),  # days missing
    (None, '{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>', True),
    (None, '{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n'
           '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "f", "days": 1}}\n</tool_call>', True),
    (None, '{"name": "send_mail", "arguments": {}}\n</tool_call>', False),  # not an offered tool
])
def test_hermes_grammar(backend, name, text, ok):
    assert _accepts(backend, HermesToolParser(TOOLS), name, text) is ok


@pytest.mark.parametrize("name,text,ok", [
    ("get_weather", "<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>", True),
    ("get_weather", "<arg_key>town</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>", False),
    (None, "get_time\n<arg_key>tz</arg_key>\n<arg_value>UTC</arg_value>\n</tool_call>", True),
    (None, "get_date\n</tool_call>", False),
])
def test_glm_grammar(backend, name, text, ok):
    assert _accepts(backend, GlmToolParser(TOOLS), name, text) is ok


def test_single_call_when_parallel_calls_are_off(backend):
    two = ('{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n'
           '{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not _accepts(backend, HermesToolParser(TOOLS, max_calls=1), None, two)


@pytest.fixture(scope="module")
def client(tiny_dir):
    from server_harness import ServerThread
    from tiermoe.engine.async_engine import AsyncEngine
    from tiermoe.engine.build import build_engine_core
    from tiermoe.server.app import create_app

    core = build_engine_core(str(tiny_dir("qwen3_moe")), device="cpu", dtype="float32", max_model_len=1024,
                             max_num_seqs=4)
    with ServerThread(create_app(AsyncEngine(core), served_model_name="tiny")) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_random_model_makes_valid_forced_calls(client, choice):
    tools = [{"type": "function", "function": t} for t in TOOLS]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                       tools=tools, tool_choice=choice, max_tokens=120, temperature=0.7, seed=1,
                                       parallel_tool_calls=False)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1
    call = msg.tool_calls[0].function
    schema = {t["name"]: t["parameters"] for t in TOOLS}[call.name]
    jsonschema.validate(json.loads(call.arguments), schema)


# ---- tool_choice "required" with parallel calls left on --------------------------------------------------
def _calls(*args_list) -> str:
    return "\n<tool_call>\n".join(json.dumps({"name": "get_time", "arguments": a}) + "\n</tool_call>"
                                  for a in args_list)


def test_forced_grammar_ends_after_max_calls(backend):
    parser = HermesToolParser(TOOLS)
    assert _accepts(backend, parser, None, _calls(*({"tz": f"T{i}"} for i in range(MAX_FORCED_CALLS))))
    assert not _accepts(backend, parser, None, _calls(*({"tz": f"T{i}"} for i in range(MAX_FORCED_CALLS + 1))))
    glm_call = "get_time\n<arg_key>tz</arg_key>\n<arg_value>UTC</arg_value>\n</tool_call>"
    glm = GlmToolParser(TOOLS)
    assert _accepts(backend, glm, None, "<tool_call>".join([glm_call] * MAX_FORCED_CALLS))
    assert not _accepts(backend, glm, None, "<tool_call>".join([glm_call] * (MAX_FORCED_CALLS + 1)))


def test_forced_grammar_bounds_whitespace_around_markers(backend):
    parser = HermesToolParser(TOOLS)
    call = '{"name": "get_time", "arguments": {}}'
    assert _accepts(backend, parser, None, call + "\n" + " " * 7 + "</tool_call>")
    assert not _accepts(backend, parser, None, call + "\n" * 40 + "</tool_call>")


def _repeating(prompt: str):
    """A model that, asked for the time, calls get_time(UTC), get_time(CET), then UTC again and again."""
    from server_harness import script

    if "What time is it" in prompt:
        return ScriptedReply(content="", tool_calls=[("get_time", {"tz": "UTC"}), ("get_time", {"tz": "CET"})]
                             + [("get_time", {"tz": "UTC"})] * 30)
    return script(prompt)


@pytest.fixture(scope="module")
def repeating_client(tokenizer):
    from server_harness import start_server

    with start_server(tokenizer, core_kwargs={"script": _repeating, "max_model_len": 4096}) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


TIME_TOOLS = [{"type": "function", "function": t} for t in TOOLS]
ASK_TIME = [{"role": "user", "content": "What time is it?"}]


def test_a_repeated_call_ends_a_required_turn(repeating_client):
    r = repeating_client.chat.completions.create(model="scripted", messages=ASK_TIME, tools=TIME_TOOLS,
                                                 tool_choice="required", max_tokens=2000)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == [{"tz": "UTC"}, {"tz": "CET"}]
    # two calls of the 32 the model writes: the first repeat ended the turn (how many tokens the
    # engine produced before the abort landed varies with load, so usage is not asserted)


def test_a_repeated_call_never_reaches_a_stream(repeating_client):
    calls: dict[int, dict] = {}
    finish = None
    for chunk in repeating_client.chat.completions.create(model="scripted", messages=ASK_TIME, tools=TIME_TOOLS,
                                                          tool_choice="required", max_tokens=2000, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"name": None, "arguments": ""})
            entry["name"] = d.function.name or entry["name"]
            entry["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [json.loads(c["arguments"]) for c in calls.values()] == [{"tz": "UTC"}, {"tz": "CET"}]


def test_auto_turns_keep_every_call(repeating_client):
    r = repeating_client.chat.completions.create(model="scripted", messages=ASK_TIME, tools=TIME_TOOLS,
                                                 max_tokens=2000)
    assert len(r.choices[0].message.tool_calls) == 32


def test_random_model_stops_after_a_required_call_it_would_repeat(client):
    """A tool without parameters: every further call of the random model is a repeat."""
    no_args = {"type": "object", "properties": {}, "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "ping", "parameters": no_args}}]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Ping?"}], tools=tools,
                                       tool_choice="required", max_tokens=400, temperature=0.7, seed=3)
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
    assert r.usage.completion_tokens < 200  # the budget is 400
