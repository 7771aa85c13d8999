"""Hermes / Qwen tool calls: <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>.

Arguments stream as the model writes them: once the body reads `{"name": "f", "arguments": `
the characters of the arguments object are passed through as they arrive, up to the brace
that closes it (tracked with a small JSON lexer, so braces inside strings do not count). The
final arguments are that same raw text, so streamed and non-streamed results agree.

While a call streams, each piece is read once: the head (`{"name": "f", "arguments": `) by a
small state machine that accepts what `_HEAD` matches, one character at a time, so a piece
never sends it back to the start of the body; the arguments by the lexer, resumed from scratch.
"""

from __future__ import annotations

import json
import re

from tiermoe.protocol import JSON_WHITESPACE
from tiermoe.server.limits import loads
from tiermoe.server.tool_parsers.base import FORCED_WS, ParsedBody, PartialCall, ToolParser

_HEAD = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*', re.S)
_PLAIN = re.compile(r'[^"\\]*')  # a run inside a JSON string, up to a quote or escape
_OTHER = re.compile(r'[^"{}\[\]]*')  # a run outside strings, up to what the lexer counts
_SPACE = re.compile(r"\s*")
# _HEAD, one step at a time: a run of whitespace, the name string (after its opening quote, up
# to its closing one), or a literal (one of a tuple), matched character by character.
_HEAD_STEPS = ("ws", ("{",), "ws", ('"name"',), "ws", (":",), "ws", ('"',), "name", "ws", (",",), "ws",
               ('"arguments"', '"parameters"'), "ws", (":",), "ws")
_DEAD = -1  # the head can no longer match: no (more) name, no arguments


def _scan_object(text: str, pos: int, state: dict) -> int:
    """Lex text[pos:] as the continuation of a JSON value whose lexer state is `state` (depth,
    in a string, after a backslash; kept between calls): where the value ends in text (the index
    after its closing bracket; `state["closed"]` is then set), else len(text)."""
    depth, in_str, esc = state["depth"], state["in_str"], state["esc"]
    i, n = pos, len(text)
    while i < n:
        if in_str:
            if esc:
                esc = False
            else:
                i = _PLAIN.match(text, i).end()
                if i == n:
                    break
                esc = text[i] == "\\"
                in_str = esc
        else:
            i = _OTHER.match(text, i).end()
            if i == n:
                break
            ch = text[i]
            if ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    state["closed"] = True
                    return i + 1
        i += 1
    state.update(depth=depth, in_str=in_str, esc=esc)
    return n


def _new_lexer() -> dict:
    return {"depth": 0, "in_str": False, "esc": False, "closed": False}


def _unquote(text: str) -> str | None:
    """A JSON string's body (between its quotes) as text; None if the model escaped it badly."""
    try:
        return loads(f'"{text}"')
    except ValueError:
        return None


def _read_head(text: str, st: dict) -> int | None:
    """Advance the head's state `st` over text: the index in text where the arguments object
    begins (its "{"), or None (not yet, or never: the step is then _DEAD). `st["name"]` is set
    once the name's closing quote has arrived (the name alone is certain then)."""
    i, n = 0, len(text)
    while i < n and st["step"] != _DEAD:
        if st["step"] == len(_HEAD_STEPS):  # the head is complete: an object, or not one
            if text[i] == "{":
                return i
            st["step"] = _DEAD  # a string (or worse): the arguments wait for the end
            break
        step = _HEAD_STEPS[st["step"]]
        if step == "ws":
            i = _SPACE.match(text, i).end()
            if i < n:  # what follows the run has arrived
                st["step"] += 1
        elif step == "name":
            j, esc = i, st["esc"]
            while j < n and (esc or text[j] != '"'):
                esc = not esc and text[j] == "\\"
                j += 1
            st["esc"] = esc
            st["parts"].append(text[i:j])
            if j < n:
                st["name"] = _unquote("".join(st["parts"]))
                st["step"] = _DEAD if st["name"] is None else st["step"] + 1
            i = j + 1
        else:
            lit = st["lit"] + text[i]
            if lit in step:
                st["step"], st["lit"] = st["step"] + 1, ""
            elif any(option.startswith(lit) for option in step):
                st["lit"] = lit
            else:
                st["step"] = _DEAD
            i += 1
    return None


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse_partial(self, piece: str, scratch: dict) -> PartialCall:
        if not scratch:
            scratch.update(step=0, lit="", esc=False, parts=[], name=None, args=None)
        start = 0
        if scratch["args"] is None:
            at = _read_head(piece, scratch)
            if at is None:
                return PartialCall(name=scratch["name"])
            scratch["args"], start = _new_lexer(), at
        lexer = scratch["args"]
        if lexer["closed"]:
            return PartialCall(name=scratch["name"])
        end = _scan_object(piece, start, lexer)
        return PartialCall(name=scratch["name"], arguments=piece[start:end])

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
        if m is not None and text.startswith("{", m.end()):
            lexer = _new_lexer()
            raw = text[m.end() : _scan_object(text, m.end(), lexer)]
            try:
                if lexer["closed"] and loads(raw) == args:
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
