"""Request schemas: OpenAI chat / completions / responses, Anthropic messages, tokenize.

Validation is strict (a string where a number belongs is a 400, not a silent coercion) and
runs on the raw body (`model_validate_json`), so malformed JSON and wrong types surface as
pydantic errors that `errors.py` turns into 4xx bodies. Unknown fields are ignored, as the
OpenAI clients send newer fields than any server knows. Responses are built as plain dicts
by the route modules (they only ever leave the process as JSON).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _Open(BaseModel):
    """Nested objects whose extra keys are kept (content parts, tool schemas)."""

    model_config = ConfigDict(strict=True, extra="allow")


def _null_is_default(cls, value, info: ValidationInfo):
    """An explicit null takes the field's default: the OpenAI reference types these fields "or
    null" and vLLM reads them as Optional, so clients that send every field (unset ones as null)
    must get the default, not a 400."""
    return cls.model_fields[info.field_name].default if value is None else value


def null_means_default(*names: str):
    """A before-validator mapping null to the default for `names` (fields with a non-null default)."""
    return field_validator(*names, mode="before")(classmethod(_null_is_default))


# ---- OpenAI chat ---------------------------------------------------------------------------


class ContentPart(_Open):
    type: str
    text: str | None = None


class FunctionCallIn(_Open):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(_Open):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Open):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(_Open):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class SamplingFields(_Strict):
    """Fields shared by chat and completions (OpenAI names plus vLLM's extensions)."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    _nulls = null_means_default("n", "stream", "ignore_eos", "min_tokens")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    thinking_budget: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    return_tokens_as_token_ids: bool = False  # vLLM: logprob tokens as "token_id:N"
    # OpenAI's deprecated forms of tools and tool_choice: read only to refuse them (chat route), as
    # ignoring them would answer as if the model had no functions
    functions: list[Any] | None = None
    function_call: Any = None

    _chat_nulls = null_means_default("logprobs", "add_generation_prompt", "return_tokens_as_token_ids")


# ---- OpenAI completions --------------------------------------------------------------------


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    response_format: ResponseFormat | None = None
    return_tokens_as_token_ids: bool = False  # vLLM: logprob tokens as "token_id:N"

    _completion_nulls = null_means_default("echo", "return_tokens_as_token_ids")


# ---- OpenAI responses ----------------------------------------------------------------------


class ResponsesTool(_Open):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesReasoning(_Open):
    effort: str | None = None


class ResponsesTextFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class ResponsesText(_Open):
    format: ResponsesTextFormat | None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    reasoning: ResponsesReasoning | None = None
    text: ResponsesText | None = None
    previous_response_id: str | None = None
    background: bool | None = None  # true is refused: nothing to poll later (no stored responses)
    store: bool | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None

    _nulls = null_means_default("stream")


# ---- Anthropic messages --------------------------------------------------------------------


class AnthropicBlock(_Open):
    type: str
    text: str | None = None


class AnthropicMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[AnthropicBlock]


class AnthropicTool(_Open):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AnthropicThinking(_Strict):
    """Anthropic's thinking config. "adaptive" and "between_tools" (think between tool calls) let the model decide,
    which a template's enable_thinking switch serves as "enabled" without a budget (anthropic_routes)."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=0)


class AnthropicMessagesRequest(_Strict):
    model: str
    messages: list[AnthropicMessage]
    max_tokens: int
    system: str | list[AnthropicBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None
    metadata: dict[str, Any] | None = None


class AnthropicCountTokensRequest(_Strict):
    model: str
    messages: list[AnthropicMessage]
    system: str | list[AnthropicBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None


# ---- tokenize ------------------------------------------------------------------------------


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[ToolDef] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    _nulls = null_means_default("add_special_tokens", "add_generation_prompt")


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
