"""Forced tool calls (tool_choice required / named) under a grammar: each format's grammar
accepts exactly well-formed calls of the offered tools, and a random tiny model behind the real
server returns calls whose arguments validate against the tool's schema."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tiermoe.models.tiny_tokenizer import build_tokenizer
from tiermoe.server.structured import lark_marker
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
