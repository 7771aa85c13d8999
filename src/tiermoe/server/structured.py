"""response_format -> a structured-output spec for the sampler, and the checks on every schema.

The spec travels to the engine as `SamplingParams.structured` (the shape of protocol.py's
`StructuredSpec`: {"type": "json_object"} or {"type": "json_schema", "schema": {...}}); the
sampler's grammar backend (llguidance) enforces it. `ServerContext.make_run` adds
"reasoning" when the answer may follow a think block, and gives forced tool calls
(tool_choice required / named) a Lark grammar for the call's rest built by the tool parser.

The server's part is to refuse, with a 400 before any work is done, a schema it cannot
serve: one past the limits of limits.py (measured first, iteratively), one that is not a valid
JSON Schema, and for response formats one the grammar engine cannot enforce (its regex
dialect is linear-time, so look-around and backreferences are refused here rather than ever
reaching a backtracking matcher). The metaschema check is slow for large schemas, so the checks
run on a worker thread and a schema that passed is remembered (clients resend the same tools
every turn). The finished output is re-checked by output_check.py.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass

from tiermoe.protocol import JSON_WHITESPACE
from tiermoe.server.errors import bad_request, brief
from tiermoe.server.limits import SchemaBudget, check_schema_limits

# The grammar options the engine compiles response formats with (runner/structured.py); a
# schema's own "x-guidance" options win over them there, and so here.
GRAMMAR_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}
_REMEMBERED = 512  # distinct schemas known to be valid


@dataclass(frozen=True)
class SchemaToCheck:
    schema: dict
    param: str  # where it sits in the request, for the 400
    enforced: bool = False  # compiled into a grammar the output must follow (response formats)


def structured_spec(kind: str | None, schema, format_param: str, schema_param: str) -> dict | None:
    """The sampler spec for a response format (None for plain text). `format_param` and
    `schema_param` name the format and its schema where the route's API puts them (chat's
    response_format, the Responses API's text.format, Anthropic's output_config.format), so a
    400 names the field the client sent. The schema itself is checked by `SchemaChecker` (see
    `format_schemas`)."""
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(schema, dict):
            raise bad_request(f"{format_param} of type json_schema needs a 'schema' object", param=schema_param)
        return {"type": "json_schema", "schema": schema}
    raise bad_request(f"unsupported {format_param} type {kind!r} (text, json_object or json_schema)",
                      param=f"{format_param}.type")


def format_schemas(spec: dict | None, param: str) -> list[SchemaToCheck]:
    if spec is None or spec["type"] != "json_schema":
        return []
    return [SchemaToCheck(spec["schema"], param, enforced=True)]


def lark_marker(tokenizer, text: str) -> str:
    """The Lark terminal (llguidance) for a marker string: `<[id]>` when it is one token (a
    special token can only be matched that way), else the quoted literal."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(text)


def grammar_options(schema: dict) -> dict:
    """The schema's "x-guidance" grammar options (an object, checked by `check_light`)."""
    options = schema.get("x-guidance")
    return options if isinstance(options, dict) else {}


def check_light(schema: dict, param: str, budget: SchemaBudget) -> None:
    """The cheap checks, on the event loop: limits first, then the values the server itself reads."""
    check_schema_limits(schema, param, budget)
    if "x-guidance" in schema and not isinstance(schema["x-guidance"], dict):
        raise bad_request("x-guidance must be an object of grammar options", param=f"{param}.x-guidance")


def check_schema(schema: dict, param: str) -> None:
    """400 unless `schema` is a valid JSON Schema (under the draft it declares, else 2020-12).
    Only for schemas within the limits: the validator recurses once per level."""
    import jsonschema
    from jsonschema.exceptions import SchemaError

    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "(root)"
        raise bad_request(f"invalid JSON schema at {where}: {exc.message}", param=param) from None


def check_enforceable(schema: dict, param: str) -> None:
    """400 unless the grammar engine can compile `schema` as the engine will (same options)."""
    import llguidance

    huge = _number_past_64_bits(schema)
    if huge is not None:
        # the grammar engine reads numbers as 64-bit values: a larger integer literal (a "maximum"
        # of 10**30) cannot be passed to it at all
        path, value = huge
        shown = brief(str(value), 60)
        raise bad_request(f"the JSON schema cannot be enforced: it holds the number {shown} at {path}, outside "
                          f"the 64-bit range the grammar engine reads", param=param, code="unsupported_schema")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            {**schema, "x-guidance": {**GRAMMAR_OPTIONS, **grammar_options(schema)}})
    except ValueError as exc:
        raise bad_request(f"the JSON schema cannot be enforced: {_one_line(str(exc))}", param=param,
                          code="unsupported_schema") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise bad_request(f"the JSON schema cannot be enforced: {_one_line(error)}", param=param,
                          code="unsupported_schema")


def _number_past_64_bits(schema: dict) -> tuple[str, int] | None:
    """(JSON pointer, value) of the first integer outside [-2**63, 2**64), the values a 64-bit
    signed or unsigned field holds; None if there is none. Iterative: the limits allow deep schemas."""
    stack = [(schema, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            stack.extend((v, f"{path}/{k}") for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((v, f"{path}/{i}") for i, v in reversed(list(enumerate(value))))
        elif isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
            return path or "/", value
    return None


def _one_line(message: str) -> str:
    """llguidance's multi-line messages (a regex error draws a caret under the pattern) as one line."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip() and set(ln.strip()) != {"^"}]
    return "; ".join(lines)[:500]


class SchemaChecker:
    """Runs every schema check of a request; the slow ones off the event loop, once per schema."""

    def __init__(self, off_loop):
        self._off_loop = off_loop  # async fn(callable, *args) on a worker thread
        self._valid: OrderedDict[bytes, None] = OrderedDict()

    async def check(self, items: list[SchemaToCheck]) -> None:
        budget = SchemaBudget()
        for item in items:
            check_light(item.schema, item.param, budget)
        todo, keys = [], []
        for item in items:
            key = _key(item)
            if key in self._valid:
                self._valid.move_to_end(key)
            elif key not in keys:
                todo.append(item)
                keys.append(key)
        if todo:
            await self._off_loop(_check_heavy, todo)
        for key in keys:
            self._valid[key] = None
            if len(self._valid) > _REMEMBERED:
                self._valid.popitem(last=False)


def _check_heavy(items: list[SchemaToCheck]) -> None:
    for item in items:
        check_schema(item.schema, item.param)
        if item.enforced:
            check_enforceable(item.schema, item.param)


def _key(item: SchemaToCheck) -> bytes:
    text = json.dumps(item.schema, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"{int(item.enforced)}{text}".encode("utf-8", "surrogatepass")).digest()
