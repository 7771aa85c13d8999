"""Bounds on the client-supplied JSON the server itself walks, checked before anything recursive.

pydantic's parser already refuses bodies nested past its own recursion limit, but the JSON
Schemas clients send (tool parameters, response formats) are then handed to libraries that
recurse once per level and do work per value: jsonschema's metaschema check, the grammar
compiler, chat templates. A schema well inside the parser's limit could still exhaust Python's
recursion limit there (a RecursionError, and a traceback as deep as the schema in the log) or
hold a worker for as long as its size allows. So every schema is measured here first, iteratively, and a
schema past a limit is a 400 that names the limit. The same walk bounds the pattern strings a
schema may carry.

Limits (also in README.md and `tiermoe serve --help`):
  - depth: objects and arrays nested at most MAX_SCHEMA_DEPTH deep in one schema document;
  - size: at most MAX_SCHEMA_VALUES JSON values (objects, arrays, strings, numbers, ...) over
    all the schemas of one request, so a thousand small tools cost what one large one does;
  - patterns (`pattern` values and `patternProperties` keys): at most MAX_PATTERN_CHARS
    characters.

Stop strings (`stop` on the OpenAI routes, `stop_sequences` on /v1/messages) are bounded here
too, by one check every route calls: at most MAX_STOP_STRINGS of them, each at most
MAX_STOP_CHARS characters (check_stop_strings).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

MAX_SCHEMA_DEPTH = 64
MAX_SCHEMA_VALUES = 10_000
MAX_PATTERN_CHARS = 1_000
MAX_STOP_STRINGS = 16
# Why 4,096 characters a stop string: no API documents a length limit to follow (OpenAI documents
# only a count, 4; vLLM and llama.cpp accept any length), and real clients send short sentinels
# ("\n\nUser:", "</answer>", "```", at most a few dozen characters). A stop string only matches
# once the model has written all of it, so a longer one is bounded in use by the output (at most
# the context, max_model_len tokens), not by the body it arrives in (--max-body-mb, 32 MB). Matching
# costs time linear in the output however long the stop strings are (stop_strings.py), so the bound
# is not for speed: it caps how much of a stream one stop string can hold back (all but one of its
# characters, while the output follows its prefix) and the failure table built as the output
# follows it, and it turns a slip (a document or prompt passed as `stop`) into a clear 400. 4,096
# characters is about a thousand tokens of English: far past any sentinel, well inside the
# contexts models are served with.
MAX_STOP_CHARS = 4_096


@dataclass
class SchemaBudget:
    """What is left of the per-request schema size limit, spent by each schema measured."""

    values_left: int = MAX_SCHEMA_VALUES


def check_schema_limits(schema, param: str, budget: SchemaBudget) -> None:
    """400 unless `schema` is within the depth, size and pattern limits; spends `budget`.

    Iterative (an explicit stack), so any nesting the JSON parser let through is measured
    without recursion; it stops at the first limit passed.
    """
    stack = [(schema, 0, None)]  # (value, containers around it, key it sits under)
    while stack:
        value, depth, key = stack.pop()
        budget.values_left -= 1
        if budget.values_left < 0:
            raise _refuse(
                f"JSON schemas in this request have more than {MAX_SCHEMA_VALUES} values in all "
                f"(the server's schema size limit)", param=param, code="schema_too_large")
        if isinstance(value, dict):
            if depth >= MAX_SCHEMA_DEPTH:
                raise _too_deep(param)
            if key == "patternProperties":
                for pattern in value:
                    _check_pattern(pattern, param)
            stack.extend((v, depth + 1, k) for k, v in value.items())
        elif isinstance(value, list):
            if depth >= MAX_SCHEMA_DEPTH:
                raise _too_deep(param)
            stack.extend((v, depth + 1, None) for v in value)
        elif key == "pattern" and isinstance(value, str):
            _check_pattern(value, param)


def _too_deep(param: str):
    return _refuse(f"JSON schema nests objects and arrays more than {MAX_SCHEMA_DEPTH} deep "
                   f"(the server's schema depth limit)", param=param, code="schema_too_deep")


def _check_pattern(pattern: str, param: str) -> None:
    if len(pattern) > MAX_PATTERN_CHARS:
        raise _refuse(f"a pattern in this JSON schema is {len(pattern)} characters long; the limit is "
                      f"{MAX_PATTERN_CHARS}", param=param, code="pattern_too_long")


def check_stop_strings(stop: str | list[str] | None, param: str) -> list[str]:
    """The request's stop strings as a list, or a 400 naming `param` ("stop" or "stop_sequences",
    with the index of a list entry) past the count or length limit. One check for every route, so
    the OpenAI and Anthropic routes cannot drift apart; each route answers in its own error shape
    (errors.py chooses it by path). Called before tokenizing, so a refused request costs nothing."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise _refuse(f"{param} has {len(stops)} entries; at most {MAX_STOP_STRINGS} stop sequences are allowed",
                      param=param, code="too_many_stop_sequences")
    for i, s in enumerate(stops):
        if len(s) > MAX_STOP_CHARS:
            where = param if isinstance(stop, str) else f"{param}[{i}]"
            raise _refuse(f"{where} is {len(s)} characters long; a stop sequence may have at most "
                          f"{MAX_STOP_CHARS} characters", param=where, code="stop_sequence_too_long")
    return stops


def _refuse(message: str, param: str, code: str):
    # imported here so that `tiermoe serve --help`, which prints these limits, stays light
    from tiermoe.server.errors import bad_request

    return bad_request(message, param=param, code=code)


def json_depth_exceeds(value, limit: int) -> bool:
    """Whether objects and arrays in `value` nest deeper than `limit` (iterative)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth >= limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return False


def loads(text: str):
    """json.loads for text from a client or a model: too deep to parse is a ValueError like any
    other malformed JSON (json raises RecursionError there, which callers would not expect)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply to parse") from None
