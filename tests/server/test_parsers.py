"""Reasoning and tool-call parsers: streamed char by char == parsed whole."""

import json

import pytest

from tiermoe.engine.scripted import ScriptedReply, render_reply
from tiermoe.server.reasoning import ReasoningParser
from tiermoe.server.tool_parsers import GlmToolParser, HermesToolParser, detect_tool_format

TOOLS = [{"name": "get_weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}]


def _run(parser, text, step):
    content, calls = "", {}
    chunks = [text[i : i + step] for i in range(0, len(text), step)]
    for piece in chunks + [None]:
        c, deltas = parser.finish() if piece is None else parser.feed(piece)
        content += c
        for d in deltas:
            entry = calls.setdefault(d.index, {"name": None, "arguments": "", "id": None})
            if d.id is not None:
                assert entry["id"] is None, "id/name sent twice"
                entry.update(id=d.id, name=d.name)
            entry["arguments"] += d.arguments
    return content, calls


@pytest.mark.parametrize("cls,fmt", [(HermesToolParser, "hermes"), (GlmToolParser, "glm")])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_tool_calls_stream_equals_whole(cls, fmt, step):
    scripted_calls = [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Oslo"})]
    reply = ScriptedReply(content="Checking.", tool_calls=scripted_calls)
    text = render_reply(reply, fmt)
    parser = cls(TOOLS)
    content, calls = _run(parser, text, step)
    assert content == "Checking."
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_weather"]
    assert [json.loads(c["arguments"]) for c in calls.values()] == [{"city": "Paris", "days": 3}, {"city": "Oslo"}]
    assert [c.arguments for c in parser.calls] == [c["arguments"] for c in calls.values()]
    assert [c.id for c in parser.calls] == [c["id"] for c in calls.values()]


def test_hermes_arguments_stream_before_the_call_closes():
    parser = HermesToolParser(TOOLS)
    _, deltas = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert deltas[0].name == "get_weather"
    assert "".join(d.arguments for d in deltas) == '{"city": "Pa'
    _, deltas = parser.feed('ris", "note": "a } brace"}}\n</tool_call>')
    assert parser.calls[0].arguments == '{"city": "Paris", "note": "a } brace"}'


def test_glm_values_typed_by_schema():
    parser = GlmToolParser(TOOLS)
    parser.feed("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>17</arg_value>\n"
                "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>")
    assert parser.calls[0].arguments_dict() == {"city": "17", "days": 2}


def test_malformed_call_becomes_content():
    parser = HermesToolParser(TOOLS)
    content, calls = _run(parser, "Hi <tool_call>not json</tool_call>", 4)
    assert calls == {} and "not json" in content


def test_unterminated_call_parsed_at_finish():
    parser = HermesToolParser(TOOLS)
    _run(parser, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}', 5)
    assert parser.calls[0].arguments_dict() == {"city": "Rome"}


def test_forced_prefix_then_continuation():
    parser = HermesToolParser(TOOLS)
    parser.feed(parser.forced_prefix("get_weather"))
    parser.feed('{"city": "Paris"}}\n</tool_call>')
    parser.finish()
    assert parser.calls[0].name == "get_weather" and parser.calls[0].arguments_dict() == {"city": "Paris"}


def test_detect_format():
    assert detect_tool_format({"tool_format": "glm"}, None) == "glm"
    assert detect_tool_format({}, "... <arg_key> ...") == "glm"
    assert detect_tool_format({"arch": "qwen3_moe"}, "<tool_call>") == "hermes"
    assert detect_tool_format({"arch": "glm4_moe"}, None) == "glm"  # no template: the family decides
    assert detect_tool_format({"arch": "glm4_moe"}, "<|im_start|>{{ m }}") == "hermes"  # converted ChatML model


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
def test_reasoning_split(step):
    text = "<think>\nLet me add: 17 * 23 = 391.\n</think>\n\n391"
    p = ReasoningParser()
    r, c = "", ""
    for i in range(0, len(text), step):
        dr, dc = p.feed(text[i : i + step])
        r, c = r + dr, c + dc
    dr, dc = p.finish()
    assert (r + dr, c + dc) == ("Let me add: 17 * 23 = 391.", "391")


def test_reasoning_opened_by_prompt_and_plain_answers():
    p = ReasoningParser(prompt_opens_reasoning=True)
    assert p.feed("thinking...</think>answer") == ("thinking...", "answer")
    q = ReasoningParser()
    assert q.feed("<thi") == ("", "")
    assert q.feed("s is plain") == ("", "<this is plain")


def test_metrics_export_engine_expert_tiers():
    from tiermoe.server.metrics import Metrics

    m = Metrics()
    stats = {"running": 1, "kv_usage": 0.25, "experts": {
        "slots": {"hits": 120, "misses": 30, "capacity": 9}, "host": {"hits": 25, "misses": 5},
        "disk": {"reads": 5, "bytes_read": 10}, "decode_tokens": 10, "per_decode_token": {"slots_hits": 12.0}}}
    text = m.render(stats, running=1, waiting=0).decode()
    assert 'tiermoe_expert_hits_total{tier="slots"} 120.0' in text
    assert 'tiermoe_expert_misses_total{tier="host"} 5.0' in text
    assert 'tiermoe_expert_hits_total{tier="disk"} 5.0' in text
    assert 'tiermoe_expert_per_decode_token{kind="slots_hits"} 12.0' in text
    assert "tiermoe_kv_cache_usage_ratio 0.25" in text and "tiermoe_engine_running 1.0" in text
    summary = m.summary(stats, 1, 0)
    assert summary["expert_tiers_per_decode_token"]["slots"] == {"hits": 12.0, "misses": 3.0}


def test_single_call_limit_drops_later_calls():
    scripted_calls = [("get_weather", {"city": "A"}), ("get_weather", {"city": "B"})]
    text = render_reply(ScriptedReply(tool_calls=scripted_calls), "hermes")
    parser = HermesToolParser(TOOLS, max_calls=1)
    content, calls = _run(parser, text, 2)
    assert list(calls) == [0] and len(parser.calls) == 1 and content == ""


def test_hostile_schemas_and_output_do_not_break_the_parsers():
    """Tool schemas come from clients and call bodies from the model: a `true` property schema, a
    string where the grammar options belong, a badly escaped name, arguments nested past what
    json can read: each is read as no constraint / malformed output, never an exception."""
    tools = [{"name": "f", "parameters": {"type": "object", "properties": {"a": True, "b": {"type": "integer"}},
                                          "x-guidance": "x"}}]
    glm = GlmToolParser(tools)
    _run(glm, "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n"
              "<arg_key>b</arg_key>\n<arg_value>" + "[" * 5000 + "</arg_value>\n</tool_call>", 7)
    assert glm.calls[0].arguments_dict() == {"a": "1", "b": "[" * 5000}
    hermes = HermesToolParser(tools)
    assert hermes.forced_grammar("f", json.dumps)  # the string options are dropped, not unpacked
    content, calls = _run(hermes, '<tool_call>\n{"name": "f\\x", "arguments": {}}\n</tool_call>', 3)
    assert calls == {} and "f\\x" in content
    deep = '<tool_call>\n{"name": "f", "arguments": {"a": ' + "[" * 50_000 + "]" * 50_000 + "}}\n</tool_call>"
    content, calls = _run(hermes, deep, 4096)
    assert calls == {} or all(c["name"] == "f" for c in calls.values())


@pytest.mark.parametrize("cls,fmt", [(HermesToolParser, "hermes"), (GlmToolParser, "glm")])
def test_a_long_call_streams_in_linear_time(cls, fmt):
    """Each delta resumes the call's scan where the last stopped: 30 000 one-character deltas of
    one argument cost about what parsing it once does (a rescan per delta is quadratic)."""
    import time

    text = render_reply(ScriptedReply(tool_calls=[("get_weather", {"city": "x" * 30_000, "days": 2})]), fmt)
    t0 = time.monotonic()
    _, calls = _run(cls(TOOLS), text, 1)
    assert time.monotonic() - t0 < 3
    assert json.loads(calls[0]["arguments"]) == {"city": "x" * 30_000, "days": 2}
