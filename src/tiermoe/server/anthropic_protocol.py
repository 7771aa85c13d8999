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
from tiermoe.server.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest, _Open
from tiermoe.server.structured import structured_spec


class AnthropicOutputFormat(_Open):
    type: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class AnthropicOutputConfig(_Open):
    """Only `format` is read; `effort`, `task_budget` and the like do not change the output's
    contract, so they are accepted and have no effect here."""

    format: AnthropicOutputFormat | None = None


class MessagesRequest(AnthropicMessagesRequest):
    output_config: AnthropicOutputConfig | None = None
    output_format: AnthropicOutputFormat | None = None  # the structured-outputs beta's spelling


class CountTokensRequest(AnthropicCountTokensRequest):
    output_config: AnthropicOutputConfig | None = None
    output_format: AnthropicOutputFormat | None = None


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
