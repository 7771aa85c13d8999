"""Chat requests -> the inputs of the model's chat template, with every check a 400 needs.

Endpoints normalise their own message formats (OpenAI chat, Responses items, Anthropic
blocks) into OpenAI-style message dicts and function definitions, then share the checks here:
non-empty messages, text-only content, valid tool definitions (name pattern, parameters that
describe an object, no duplicates) and a tool_choice that names a real tool. The parameter
schemas are collected in `ToolPlan.schemas` for `ServerContext.check_schemas` (limits first,
then the JSON Schema check, off the event loop).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tiermoe.server.errors import APIError, bad_request
from tiermoe.server.limits import loads
from tiermoe.server.structured import SchemaToCheck, format_schemas

_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_.:-]{1,64}$")


@dataclass
class ToolPlan:
    """Which tools the template sees, whether output is parsed for calls, and any forced call."""

    template_tools: list[dict] | None  # OpenAI {"type": "function", "function": {...}} dicts
    functions: list[dict]  # the bare function definitions, for the parser
    parse: bool
    force: bool = False  # tool_choice required / named: the prompt opens the call
    forced_name: str | None = None
    max_calls: int | None = None  # 1 when parallel_tool_calls is false
    schemas: list[SchemaToCheck] = field(default_factory=list)  # the tools' parameters, to check


_TEXT_PARTS = ("text", "input_text", "output_text")


def text_content(content, param: str, assistant: bool = False) -> str:
    """A message's content as text; non-text parts are refused (this server is text-only).

    An assistant's "refusal" part (a refusal the model gave, replayed in the conversation; the
    OpenAI chat and Responses APIs both accept it there) is read as its text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    pieces = []
    for i, part in enumerate(content):
        if isinstance(part, dict):  # Responses items arrive as plain JSON
            get = part.get
        elif hasattr(part, "type"):  # pydantic content parts (chat; extra keys are attributes)
            def get(key, part=part):
                return getattr(part, key, None)
        else:
            raise bad_request("content parts must be objects", param=f"{param}[{i}]")
        kind = get("type")
        key = "text" if kind in _TEXT_PARTS else "refusal" if kind == "refusal" else None
        if key is None:
            raise bad_request(f"content part of type {kind!r} is not supported (text only)", param=f"{param}[{i}].type")
        if key == "refusal" and not assistant:
            raise bad_request("a content part of type 'refusal' may only be in an assistant message",
                              param=f"{param}[{i}].type")
        value = get(key)
        if not isinstance(value, str):
            raise bad_request(f"a content part of type {kind!r} needs a '{key}' string", param=f"{param}[{i}].{key}")
        pieces.append(value)
    return "".join(pieces)


def _arguments_for_template(arguments, param: str):
    """Templates iterate arguments as a mapping; OpenAI sends them as a JSON string."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = loads(arguments) if arguments else {}
    except ValueError:
        raise bad_request("tool call arguments must be a JSON object", param=param) from None
    if not isinstance(value, dict):
        raise bad_request("tool call arguments must be a JSON object", param=param)
    return value


def openai_messages(messages) -> list[dict]:
    """OpenAI ChatMessage models -> plain dicts a chat template can render."""
    if not messages:
        raise bad_request("messages must contain at least one message", param="messages", code="empty_messages")
    out = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        msg: dict = {"role": role,
                     "content": text_content(m.content, f"messages[{i}].content", assistant=m.role == "assistant")}
        if m.role == "assistant" and m.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": tc.id or f"call_{i}_{j}",
                    "type": "function",
                    "function": {
                        "name": tc.function.name,
                        "arguments": _arguments_for_template(
                            tc.function.arguments, f"messages[{i}].tool_calls[{j}].function.arguments"
                        ),
                    },
                }
                for j, tc in enumerate(m.tool_calls)
            ]
        if m.role == "tool":
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        if m.reasoning_content:
            msg["reasoning_content"] = m.reasoning_content
        out.append(msg)
    # A conversation of system (or developer) messages alone is valid (OpenAI and vLLM answer it);
    # whether the model's chat template can render it is the template's to say (a 400 then).
    return out


def check_functions(functions: list[dict], param: str = "tools", forced: bool | str = False) -> list[SchemaToCheck]:
    """Tool definitions: a valid name, unique, parameters an object schema of type object.
    Returns the parameter schemas, for ServerContext.check_schemas; those a forced call may use
    (`forced`: True for every tool, a name for that one) are marked enforced: a forced call's
    arguments are generated under its schema's grammar, so a schema the grammar engine cannot
    compile is a 400 at request time, as for a response format, not an unconstrained run whose
    arguments ignore the schema."""
    seen = set()
    schemas = []
    for i, fn in enumerate(functions):
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise bad_request(
                f"tool name {name!r} must be 1-64 characters of letters, digits, '_', '-', '.' or ':'",
                param=f"{param}[{i}].name",
            )
        if name in seen:
            raise bad_request(f"tool name {name!r} is defined twice", param=f"{param}[{i}].name")
        seen.add(name)
        schema = fn.get("parameters")
        if schema is None:
            continue
        if not isinstance(schema, dict):
            raise bad_request("tool parameters must be a JSON Schema object", param=f"{param}[{i}].parameters")
        if schema.get("type", "object") != "object":
            raise bad_request("tool parameters must describe an object (type: object)",
                              param=f"{param}[{i}].parameters.type")
        enforced = forced is True or forced == name
        schemas.append(SchemaToCheck(schema, f"{param}[{i}].parameters", enforced=enforced))
    return schemas


def plan_tools(functions: list[dict] | None, choice, *, can_parse: bool, param: str = "tool_choice") -> ToolPlan:
    """Decide prompt tools and parsing from the functions and a normalised tool_choice.

    choice: None | "auto" | "none" | "required" | {"name": str}
    """
    functions = functions or []
    forced: bool | str = choice == "required"  # whose schemas a forced call is generated under
    if isinstance(choice, dict) and isinstance(choice.get("name"), str):
        forced = choice["name"]
    schemas = check_functions(functions, forced=forced)
    if not functions:
        if choice == "required" or isinstance(choice, dict):
            raise bad_request("tool_choice requires tools", param=param)
        return ToolPlan(None, [], parse=False)
    template_tools = [{"type": "function", "function": fn} for fn in functions]
    if choice == "none":
        return ToolPlan(None, functions, parse=False, schemas=schemas)
    if not can_parse:
        raise APIError(400, "this model has no tool-call parser", param="tools")
    if choice in (None, "auto"):
        return ToolPlan(template_tools, functions, parse=True, schemas=schemas)
    if choice == "required":
        return ToolPlan(template_tools, functions, parse=True, force=True, schemas=schemas)
    if isinstance(choice, dict):
        name = choice.get("name")
        if not isinstance(name, str) or name not in {fn["name"] for fn in functions}:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", param=param)
        chosen = [t for t in template_tools if t["function"]["name"] == name]
        return ToolPlan(chosen, functions, parse=True, force=True, forced_name=name, schemas=schemas)
    raise bad_request(f"invalid tool_choice {choice!r}", param=param)


def constraint_schemas(plan: ToolPlan, spec: dict | None, format_param: str, schema_param: str) -> list[SchemaToCheck]:
    """Every schema a request brings, for ServerContext.check_schemas: the tools' parameters
    (a forced call's marked enforced by plan_tools) and a structured-output format's schema.
    A forced call and a format would both constrain the same output (the call's grammar or the
    format's), so that pair is a 400 naming the format field (`format_param`)."""
    if spec is not None and plan.force:
        call = f"tool_choice names {plan.forced_name!r}" if plan.forced_name else "tool_choice forces a call"
        raise bad_request(f"{format_param} ({spec['type']}) and a forced tool call ({call}) would constrain the "
                          f"same output; send one of them", param=format_param, code="conflicting_constraints")
    return plan.schemas + format_schemas(spec, schema_param)
