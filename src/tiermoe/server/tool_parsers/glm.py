"""GLM-4.5+ tool calls: <tool_call>name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n</tool_call>.

Values are raw text; whether "17" means the number or the string comes from the tool's JSON
schema (a "string" property stays text, any other type is read as JSON when it parses).
Arguments stream one complete key/value pair at a time: '{"city": "Paris"', then
', "unit": "c"', then '}' when the call closes, so the pieces always concatenate to the
final JSON object.

Pairs are read as `_PAIR.finditer` reads them, by `_read_pairs`, which takes the body a piece
at a time and keeps its place in scratch: a value of hundreds of kilobytes arriving a token
at a time is searched once for its end, not once per token. The complete body is read by the
same function, so the streamed pairs are the final ones.
"""

from __future__ import annotations

import json
import re

from tiermoe.server.limits import loads
from tiermoe.server.tool_parsers.base import FORCED_WS, ParsedBody, PartialCall, ToolParser, schema_object

# what a pair is; _read_pairs reads the same pairs from a growing text
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_KEY0, _KEY1, _VALUE0, _VALUE1 = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
_SPACE = re.compile(r"\s*")


def _new_reader() -> dict:
    return {"mode": "seek", "hold": "", "key": [], "gap": [], "value": []}


def _keep(text: str, start: int, marker: str) -> int:
    """Where the tail of text[start:] that may begin `marker` starts (that tail waits for more)."""
    return max(start, len(text) - len(marker) + 1)


def _read_pairs(piece: str, st: dict) -> list[tuple[str, str]]:
    """The (key, value) pairs, as `_PAIR.finditer` groups, that `piece` completes, for a text
    read so far with state `st`. A match starts at the first <arg_key> (its key may reach past
    any later one), its key ends at the first </arg_key> followed by whitespace and <arg_value>,
    its value at the next </arg_value>: so each mode looks for one marker, and `hold` keeps a
    tail that may be the start of one (never longer than a marker) for the next piece."""
    text, i, pairs = st["hold"] + piece, 0, []
    st["hold"] = ""
    while True:
        mode = st["mode"]
        if mode == "seek":
            j = text.find(_KEY0, i)
            if j == -1:
                st["hold"] = text[_keep(text, i, _KEY0) :]
                return pairs
            i, st["mode"], st["key"] = j + len(_KEY0), "key", []
        elif mode == "gap":
            j = _SPACE.match(text, i).end()
            st["gap"].append(text[i:j])
            if text.startswith(_VALUE0, j):
                i, st["mode"], st["value"] = j + len(_VALUE0), "value", []
            elif len(text) - j < len(_VALUE0) and _VALUE0.startswith(text[j:]):
                st["hold"] = text[j:]  # the text ends in whitespace or in a part of the marker
                return pairs
            else:  # no value follows: the key goes on, through what the gap held
                st["key"] += st["gap"]
                i, st["mode"] = j, "key"
        else:  # "key" or "value": its text runs to its closing marker
            end = _KEY1 if mode == "key" else _VALUE1
            j = text.find(end, i)
            if j == -1:
                keep = _keep(text, i, end)
                st[mode].append(text[i:keep])
                st["hold"] = text[keep:]
                return pairs
            st[mode].append(text[i:j])
            i = j + len(end)
            if mode == "key":
                st["mode"], st["gap"] = "gap", [_KEY1]
            else:
                pairs.append(("".join(st["key"]), "".join(st["value"])))
                st["mode"] = "seek"


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

    def _items(self, fn: str, pairs: list[tuple[str, str]], first: bool) -> str:
        """Pairs as the arguments object's text: '{' before the first, ', ' between."""
        out = []
        for key, raw in pairs:
            key = key.strip()
            value = json.dumps(self._value(fn, key, raw), ensure_ascii=False)
            out.append(("{" if first and not out else ", ") + f"{json.dumps(key, ensure_ascii=False)}: {value}")
        return "".join(out)

    def _partial_name(self, piece: str, st: dict) -> str | None:
        """The name once the text after it has begun (_name), found looking at each piece once."""
        if "fn" in st:
            return st["fn"]
        text = st["tail"] + piece  # the tail: the last characters read, that may begin <arg_key>
        cuts = [i for i in (text.find("\n"), text.find(_KEY0)) if i != -1]
        st["head"].append(piece)
        if not cuts:
            st["tail"] = text[_keep(text, 0, _KEY0) :]
            st["read"] += len(piece)
            return None
        cut = st["read"] - len(st["tail"]) + min(cuts)
        st["fn"] = "".join(st["head"])[:cut].strip() or None
        st["head"] = []
        return st["fn"]

    def parse_partial(self, piece: str, scratch: dict) -> PartialCall:
        if not scratch:
            scratch.update(_new_reader(), head=[], tail="", read=0, sent=0)
        name = self._partial_name(piece, scratch)
        pairs = _read_pairs(piece, scratch)
        if name is None or not pairs:
            return PartialCall(name=name)
        first, scratch["sent"] = scratch["sent"] == 0, scratch["sent"] + len(pairs)
        return PartialCall(name=name, arguments=self._items(name, pairs, first))

    def parse_body(self, body: str) -> ParsedBody | None:
        name = self._name(body, complete=True)
        if name is None or any(c in name for c in "<>{}\"") or " " in name:
            return None
        pairs = _read_pairs(body, _new_reader())
        return ParsedBody(name, self._items(name, pairs, True) + "}" if pairs else "{}")

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
