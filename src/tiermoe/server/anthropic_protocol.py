"""Anthropic request fields that change what the answer must look like, read on top of protocol.py.

protocol.py ignores unknown fields, which is right for harmless ones (metadata, service_tier,
output_config.effort) but wrong for structured outputs: a client that sends
`output_config.format` (or the older beta's top-level `output_format`) relies on the answer
being JSON that matches its schema, and must get either that or a 400, never free text. So the
Messages request models here add those fields, and `output_spec` turns them into the same
sampler spec the OpenAI routes build from `response_format`.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from tiermoe.server.errors import bad_request
from tiermoe.server.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest, AnthropicTool, _Open
from tiermoe.server.structured import structured_spec


class AnthropicOutputFormat(_Open):
    type: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class AnthropicOutputConfig(_Open):
    """Only `format` is read; `effort`, `task_budget` and the like do not change the output's
    contract, so they are accepted and have no effect here."""

    format: AnthropicOutputFormat | None = None


class ToolDefinition(AnthropicTool):
    """A tool as the Anthropic API takes it: a custom tool (`type` absent or "custom") with its
    input_schema, or one of Anthropic's own (`web_search_20250305`, `bash_20250124`, ...), which
    carries no schema. Read as one model so that the latter gets a 400 naming its type
    (`check_tools`), not "missing input_schema", which would send the client looking for a typo."""

    type: str | None = None
    input_schema: dict[str, Any] | None = None


class AnthropicMetadata(_Open):
    """`metadata.user_id` is typed "string or null" by the Anthropic API, which refuses anything else;
    it has no effect here, but a number or object sent there is a client bug worth a 400."""

    user_id: str | None = None


class MessagesRequest(AnthropicMessagesRequest):
    tools: list[ToolDefinition] | None = None
    metadata: AnthropicMetadata | None = None
    output_config: AnthropicOutputConfig | None = None
    output_format: AnthropicOutputFormat | None = None  # the structured-outputs beta's spelling


class CountTokensRequest(AnthropicCountTokensRequest):
    tools: list[ToolDefinition] | None = None
    output_config: AnthropicOutputConfig | None = None
    output_format: AnthropicOutputFormat | None = None


def check_tools(tools: list[ToolDefinition] | None) -> None:
    """Only custom tools can be served: Anthropic's own tools run on Anthropic's side (web search,
    code execution) or follow schemas only Anthropic's models are trained on (bash, text editor,
    computer use), so each is a 400 naming it rather than a tool the model knows nothing about."""
    for i, tool in enumerate(tools or []):
        if tool.type not in (None, "custom"):
            raise bad_request(f"tools[{i}] ({tool.name!r}) has type {tool.type!r}, one of Anthropic's own tools, "
                              "which this server does not provide; send it as a custom tool with an input_schema",
                              param=f"tools[{i}].type")
        if tool.input_schema is None:
            raise bad_request(f"missing required field 'tools[{i}].input_schema'", param=f"tools[{i}].input_schema",
                              code="missing_field")


def output_spec(req) -> tuple[dict | None, str]:
    """(sampler spec or None, the request's format field) for a structured-output request.

    Only `json_schema` exists in Anthropic's API; another type is a 400, not plain text."""
    config_format = req.output_config.format if req.output_config is not None else None
    fmt, where = config_format, "output_config.format"
    if req.output_format is not None:
        if config_format is not None and config_format.model_dump(by_alias=True) != \
                req.output_format.model_dump(by_alias=True):
            raise bad_request("output_format and output_config.format disagree; send one of them",
                              param="output_format")
        fmt, where = req.output_format, "output_format"
    if fmt is None:
        return None, where
    if fmt.type != "json_schema":
        raise bad_request(f"{where}.type must be 'json_schema', not {fmt.type!r}", param=f"{where}.type")
    return structured_spec("json_schema", fmt.schema_, where, f"{where}.schema"), where
