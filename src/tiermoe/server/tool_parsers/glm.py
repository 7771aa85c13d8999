"""GLM-4.5+ tool calls: <tool_call>name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n</tool_call>.

Values are raw text; whether "17" means the number or the string comes from the tool's JSON
schema (a "string" property stays text, any other type is read as JSON when it parses).
Arguments stream one complete key/value pair at a time: '{"city": "Paris"', then
', "unit": "c"', then '}' when the call closes, so the pieces always concatenate to the
final JSON object.
"""

from __future__ import annotations

import json
import re

from tiermoe.server.limits import loads
from tiermoe.server.tool_parsers.base import FORCED_WS, ParsedBody, PartialCall, ToolParser, schema_object

_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class GlmToolParser(ToolParser):
    name = "glm"

    def _name(self, body: str, complete: bool) -> str | None:
        cut = len(body)
        for sep in ("\n", "<arg_key>"):
            i = body.find(sep)
            if i != -1:
                cut = min(cut, i)
        if cut == len(body) and not complete:
            return None  # the name may still be growing
        name = body[:cut].strip()
        return name or None

    def _value(self, fn: str, key: str, raw: str):
        schema = schema_object(schema_object(self.tools.get(fn)).get("parameters"))
        kind = schema_object(schema_object(schema.get("properties")).get(key)).get("type")
        if kind in (None, "string") or (isinstance(kind, list) and "string" in kind):
            return raw
        try:
            value = loads(raw)
            json.dumps(value)  # a value nested past what json can write back stays text
            return value
        except (ValueError, RecursionError):
            return raw

    def _args_prefix(self, fn: str, body: str, scratch: dict | None = None) -> tuple[str, int]:
        """The arguments object's text up to its last complete key/value pair, and the pair
        count. With `scratch` (same call, growing body) pairs already read are not read again."""
        state = scratch if scratch is not None else {}
        if state.get("fn") != fn:
            state.clear()
            state.update(fn=fn, pos=0, items=[], seen=0)
        # a new pair can only have completed if a closing tag arrived since the last look
        if body.find("</arg_value>", max(state["seen"] - len("</arg_value>"), state["pos"])) != -1:
            for m in _PAIR.finditer(body, state["pos"]):
                key = m.group(1).strip()
                value = json.dumps(self._value(fn, key, m.group(2)), ensure_ascii=False)
                state["items"].append(f"{json.dumps(key, ensure_ascii=False)}: {value}")
                state["pos"] = m.end()
        state["seen"] = len(body)
        items = state["items"]
        return ("{" + ", ".join(items) if items else ""), len(items)

    def parse_partial(self, body: str, scratch: dict | None = None) -> PartialCall:
        name = self._name(body, complete=False)
        if name is None:
            return PartialCall()
        prefix, _ = self._args_prefix(name, body, scratch)
        return PartialCall(name=name, arguments_prefix=prefix)

    def parse_body(self, body: str) -> ParsedBody | None:
        name = self._name(body, complete=True)
        if name is None or any(c in name for c in "<>{}\"") or " " in name:
            return None
        prefix, n = self._args_prefix(name, body)
        return ParsedBody(name, prefix + "}" if n else "{}")

    def forced_prefix(self, name: str | None) -> str:
        return "<tool_call>" if name is None else f"<tool_call>{name}\n"

    def forced_grammar(self, name: str | None, marker) -> str | None:
        """Keys restricted to the function's parameters; values are free text (a value's type
        is only known after parsing). Needs the four arg markers to be single tokens, so a
        value's free text cannot swallow its closing marker."""
        marks = [marker(m) for m in ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")]
        if any(not m.startswith("<[") for m in marks) or (name is None and not self.tools):
            return None
        k0, k1, v0, v1 = marks
        ws, end = FORCED_WS, marker(self.end_marker)
        rules = []
        names = [name] if name is not None else list(self.tools)
        for i, fn in enumerate(names):
            keys = list((self._parameters(fn).get("properties") or {}).keys())
            key = " | ".join(json.dumps(k) for k in keys) if keys else "/[^<]+/"
            head = "" if name is not None else f"{json.dumps(fn)} {ws} "
            rules.append(f"call{i}: {head}pair{i}* {end}\npair{i}: {k0} ({key}) {k1} {ws} {v0} /(?s:.*)/ {v1} {ws}")
        calls = " | ".join(f"call{i}" for i in range(len(names)))
        more = "" if (name is not None or self.max_calls == 1) else \
            f" ({ws} {marker(self.start_marker)} call){{0,{self._more_calls()}}}"
        return f"start: call{more}\ncall: {calls}\n" + "\n".join(rules) + "\n"
