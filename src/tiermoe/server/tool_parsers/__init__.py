"""Tool-call parsers, one module per model family's output format.

`get_tool_parser(name)` returns the class; `detect_tool_format(...)` picks one from what the
engine reports (`model_info["tool_format"]`) or, failing that, from the chat template text.
To add a format: a module with a ToolParser subclass, and a line in PARSERS.
"""

from __future__ import annotations

from tiermoe.server.tool_parsers.base import ToolCall, ToolCallDelta, ToolParser
from tiermoe.server.tool_parsers.glm import GlmToolParser
from tiermoe.server.tool_parsers.hermes import HermesToolParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "glm": GlmToolParser,
    "glm45": GlmToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call format {name!r}; known: {', '.join(sorted(PARSERS))}") from None


def detect_tool_format(model_info: dict | None, chat_template: str | None) -> str:
    """The engine's declared format, else a guess from the chat template, else hermes."""
    declared = (model_info or {}).get("tool_format")
    if declared in PARSERS:
        return declared
    template = chat_template or ""
    if "<arg_key>" in template:
        return "glm"
    # The architecture only decides when there is no template to read: a checkpoint converted
    # into a GLM-family layout (the embedded SmolLM2) keeps its own ChatML template.
    arch = str((model_info or {}).get("arch", "")).lower()
    if not template and arch.startswith("glm"):
        return "glm"
    return "hermes"


__all__ = ["ToolCall", "ToolCallDelta", "ToolParser", "PARSERS", "get_tool_parser", "detect_tool_format"]
