"""response_format -> a structured-output spec for the sampler, plus checks on both ends.

The spec travels to the engine as `SamplingParams.structured` (the shape of protocol.py's
`StructuredSpec`: {"type": "json_object"} or {"type": "json_schema", "schema": {...}}); the
sampler's grammar backend (llguidance) enforces it. `ServerContext.make_run` adds
"reasoning" when the answer may follow a think block, and gives forced tool calls
(tool_choice required / named) a Lark grammar for the call's rest built by the tool parser. The server's part is to refuse a schema that is not a
valid JSON Schema (400 before any work is done) and to check the finished output, counting
outputs that do not satisfy their format (a sampler without grammar support, or a
generation cut short by max_tokens).
"""

from __future__ import annotations

import json

from tiermoe.server.errors import bad_request


def structured_spec(kind: str | None, schema: dict | None, param: str = "response_format") -> dict | None:
    """Validate a response_format and return the sampler spec (None for plain text)."""
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(schema, dict):
            raise bad_request("response_format json_schema needs a 'schema' object", param=f"{param}.json_schema.schema")
        check_schema(schema, f"{param}.json_schema.schema")
        return {"type": "json_schema", "schema": schema}
    raise bad_request(f"unsupported response_format type {kind!r}", param=f"{param}.type")


def lark_marker(tokenizer, text: str) -> str:
    """The Lark terminal (llguidance) for a marker string: `<[id]>` when it is one token (a
    special token can only be matched that way), else the quoted literal."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(text)


def check_schema(schema: dict, param: str) -> None:
    """400 unless `schema` is a valid JSON Schema (under the draft it declares, else 2020-12)."""
    import jsonschema
    from jsonschema.exceptions import SchemaError

    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "(root)"
        raise bad_request(f"invalid JSON schema at {where}: {exc.message}", param=param) from None


def output_satisfies(spec: dict | None, text: str) -> bool:
    """Whether finished output `text` meets the spec (True when there is no spec)."""
    if spec is None:
        return True
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if spec["type"] == "json_object":
        return isinstance(value, dict)
    if spec["type"] == "json_schema":
        import jsonschema

        cls = jsonschema.validators.validator_for(spec["schema"], default=jsonschema.Draft202012Validator)
        return cls(spec["schema"]).is_valid(value)
    return True
