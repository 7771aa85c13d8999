"""Hostile values shared by the fuzzers and the per-field sweep: edge strings, numbers, deep JSON,
and the JSON Schemas that once crashed or froze the server (deep nesting, a string where an
object of grammar options belongs, backtracking and look-around patterns)."""

from __future__ import annotations

import math

EDGE_TEXT = [
    "", " ", "\x00", "a\x00b", "\ud800", "\udfff", "x\ud83dy", "\u202eevil\u202c",
    "\u200f\u05e9\u05dc\u05d5\u05dd\u200e", "🚀" * 50, "👩‍👩‍👧‍👦", "e\u0301" * 30, "\ufeff", "\u2028\u2029",
    "\uffff", "\U0010ffff", "<|im_start|>system\n",
    "<|im_end|>", "<think>", "</think>", "<tool_call>{\"name\": \"x\"", "{{ raise_exception('x') }}", "{% for %}",
    "\\u0000", "\r\n" * 20, "\t" * 100, "Tell me a story", "TRIGGER nothing", "null", "[]",
]
EDGE_NUMBERS = [0, -1, 1, 2**31, 2**63, -(2**63) - 1, 10**400, math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324, 0.5]


class _DeepList(list):
    depth = 0

    def __repr__(self) -> str:  # short, so a failing example can be printed at all
        return f"<{self.depth}-deep JSON>"

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(repr(self))


class _DeepDict(dict):
    __repr__ = _DeepList.__repr__
    _repr_pretty_ = _DeepList._repr_pretty_


def nested(depth: int, leaf=1):
    """`depth` alternating levels of {"k": ...} and [...] around `leaf`."""
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    out = _DeepList(value) if isinstance(value, list) else _DeepDict(value)
    out.depth = depth
    return out


def deep_schema(kind: str, levels: int) -> dict:
    """A valid JSON Schema nesting `levels` subschemas through `kind`: items, anyOf, properties,
    not or additionalProperties (each level adds one or two JSON levels)."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        if kind == "items":
            schema = {"type": "array", "items": schema}
        elif kind == "anyOf":
            schema = {"anyOf": [schema, {"type": "null"}]}
        elif kind == "properties":
            schema = {"type": "object", "properties": {"p": schema}}
        elif kind == "not":
            schema = {"not": schema}
        else:
            schema = {"type": "object", "additionalProperties": schema}
    return schema


def object_schema(inner: dict) -> dict:
    """`inner` as the one property of an object schema (tool parameters must be objects)."""
    return {"type": "object", "properties": {"v": inner}}


BACKTRACKING_PATTERN = "^(a|aa)+$"  # exponential for a backtracking matcher on "aaa...a!"
# Schemas the server must refuse (400), each with the error code that says why
BAD_SCHEMAS = {
    "items-120": (object_schema(deep_schema("items", 120)), "schema_too_deep"),
    "anyOf-90": (object_schema(deep_schema("anyOf", 90)), "schema_too_deep"),
    "properties-90": (object_schema(deep_schema("properties", 90)), "schema_too_deep"),
    "not-150": (object_schema(deep_schema("not", 150)), "schema_too_deep"),
    "x-guidance-string": ({"type": "object", "x-guidance": "x"}, None),
    "x-guidance-list": ({"type": "object", "x-guidance": [1]}, None),
    "long-pattern": (object_schema({"type": "string", "pattern": "a" * 1001}), "pattern_too_long"),
    "wide": ({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}, "schema_too_large"),
}
# Schemas a response format may not use: the grammar engine cannot enforce them
UNENFORCEABLE_SCHEMAS = {
    "look-ahead": {"type": "string", "pattern": "^(?=a)a+$"},
    "look-behind": {"type": "string", "pattern": "(?<=a)b"},
    "backreference": {"type": "string", "pattern": "^(a+)\\1$"},
}
# JSON values for any field: what the fuzzers send plus the schemas above
SWEEP_VALUES = [
    None, True, "", "\ud800", "<|im_end|>", "{{ raise_exception('x') }}", "y" * 5000, 0, -1, 10**400, math.nan,
    -math.inf, 1e308, 0.5, [], {}, [None], {"k": None}, nested(150), nested(150, {}), ["x"] * 40,
    {"type": "object", "x-guidance": "x"}, object_schema(deep_schema("anyOf", 90)),
    object_schema({"type": "string", "pattern": BACKTRACKING_PATTERN}), UNENFORCEABLE_SCHEMAS["look-ahead"],
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "x-guidance": "x"}}},
    {"type": "json_schema", "json_schema": {"schema": {"type": "object", "x-guidance": "x"}}},
]
