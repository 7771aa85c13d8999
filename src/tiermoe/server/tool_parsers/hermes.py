"""Hermes / Qwen tool calls: <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>.

Arguments stream as the model writes them: once the body reads `{"name": "f", "arguments": `
the characters of the arguments object are passed through as they arrive, up to the brace
that closes it (tracked with a small JSON lexer, so braces inside strings do not count). The
final arguments are that same raw text, so streamed and non-streamed results agree.
"""

from __future__ import annotations

import json
import re

from tiermoe.protocol import JSON_WHITESPACE
from tiermoe.server.limits import loads
from tiermoe.server.tool_parsers.base import FORCED_WS, ParsedBody, PartialCall, ToolParser

_HEAD = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*', re.S)
_NAME = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"', re.S)


def _object_extent(text: str, start: int = 0, state: dict | None = None) -> tuple[int, bool]:
    """How far the JSON object at text[start] reaches: (chars consumed, closed?).

    `state` (a dict kept between calls on a growing text with the same start) resumes the scan
    where the last call stopped, so streaming a long call costs linear time, not quadratic."""
    if state is None or state.get("start") != start:
        state = {} if state is None else state
        state.clear()
        state.update(start=start, pos=start, depth=0, in_str=False, esc=False, end=None)
    if state["end"] is not None:
        return state["end"] - start, True
    depth, in_str, esc = state["depth"], state["in_str"], state["esc"]
    for i in range(state["pos"], len(text)):
        ch = text[i]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                state["end"] = i + 1
                return i + 1 - start, True
    state.update(pos=len(text), depth=depth, in_str=in_str, esc=esc)
    return len(text) - start, False


def _unquote(text: str) -> str | None:
    """A JSON string's body (between its quotes) as text; None if the model escaped it badly."""
    try:
        return loads(f'"{text}"')
    except ValueError:
        return None


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse_partial(self, body: str, scratch: dict | None = None) -> PartialCall:
        m = _HEAD.match(body)
        if m is None:
            n = _NAME.match(body)
            # the name alone is certain once its closing quote has arrived
            return PartialCall(name=_unquote(n.group(1)) if n else None)
        name = _unquote(m.group(1))
        if name is None or not body.startswith("{", m.end()):
            return PartialCall(name=name)  # not an object yet (or a string): wait for the end
        end, _ = _object_extent(body, m.end(), scratch)
        return PartialCall(name=name, arguments_prefix=body[m.end() : m.end() + end])

    def parse_body(self, body: str) -> ParsedBody | None:
        try:
            return self._parse_body(body.strip())
        except RecursionError:  # arguments nested past what == and json.dumps can walk
            return None

    def _parse_body(self, text: str) -> ParsedBody | None:
        try:
            obj = loads(text)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models double-encode the arguments
            try:
                args = loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        m = _HEAD.match(text)
        if m is not None and text[m.end() :].startswith("{"):
            end, closed = _object_extent(text[m.end() :])
            raw = text[m.end() : m.end() + end]
            try:
                if closed and loads(raw) == args:
                    return ParsedBody(obj["name"], raw)
            except ValueError:
                pass
        return ParsedBody(obj["name"], json.dumps(args, ensure_ascii=False))

    def forced_prefix(self, name: str | None) -> str:
        if name is None:
            return "<tool_call>\n"
        return '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": '

    def forced_grammar(self, name: str | None, marker) -> str | None:
        ws, end = FORCED_WS, marker(self.end_marker)
        if name is not None:  # the prompt ends inside the object, just before the arguments
            return f'start: args {ws} "}}" {ws} {end}\nargs: %json {json.dumps(self._parameters(name))}\n'
        if not self.tools:
            return None
        variants = [
            {"type": "object", "properties": {"name": {"const": fn}, "arguments": self._parameters(fn)},
             "required": ["name", "arguments"], "additionalProperties": False}
            for fn in self.tools
        ]
        body = {"anyOf": variants, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
        more = "" if self.max_calls == 1 else f" ({ws} {marker(self.start_marker)} {ws} call){{0,{self._more_calls()}}}"
        return f"start: call{more}\ncall: body {ws} {end}\nbody: %json {json.dumps(body)}\n"
