"""Typed messages between the server, the engine and the layers under it (no torch here).

The server builds a `SamplingParams` per request and reads `RequestOutput`s; the engine's
step loop consumes the first and produces the second, and the scheduler and the runner carry
the params of each request. The module sits below all four, so none of them imports another
for these types, and it imports only the standard library, so the HTTP layer can be tested
without a model and keeps torch out of the server process' imports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class InvalidRequest(ValueError):
    """A request the engine cannot serve as given; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How one sequence is sampled. Defaults mean greedy decoding with no penalties."""

    max_tokens: int | None = None  # None: the remaining context
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token (0: only the chosen)
    min_tokens: int = 0
    # Constrained decoding: {"type": "json_object"} | {"type": "json_schema", "schema": {...}}
    # | {"type": "regex", "pattern": "..."} (see StructuredSpec below); None: unconstrained.
    structured: dict | None = None
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit, in [-100, 100]
    prompt_logprobs: int | None = None  # top alternatives per prompt token (0: only the prompt token's own)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise InvalidRequest for values no sampler can honour."""

        def finite(name: str, value: float) -> None:
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise InvalidRequest(f"{name} must be a finite number", name)

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            finite(name, getattr(self, name))
        if self.temperature < 0:
            raise InvalidRequest("temperature must be >= 0", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest("top_p must be in (0, 1]", "top_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest("min_p must be in [0, 1]", "min_p")
        if self.repetition_penalty <= 0:
            raise InvalidRequest("repetition_penalty must be > 0", "repetition_penalty")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise InvalidRequest("presence_penalty must be in [-2, 2]", "presence_penalty")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise InvalidRequest("frequency_penalty must be in [-2, 2]", "frequency_penalty")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequest("top_k must be an integer >= -1", "top_k")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise InvalidRequest("max_tokens must be a positive integer", "max_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            # as vLLM: the request could only stop at max_tokens, short of its own minimum
            raise InvalidRequest(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})",
                                 "min_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequest("top_logprobs must be in [0, 20]", "top_logprobs")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequest("seed must be an integer", "seed")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidRequest("logit_bias must map token ids to numbers", "logit_bias")
            for tid, bias in self.logit_bias.items():
                if not isinstance(tid, int) or isinstance(tid, bool) or tid < 0:
                    raise InvalidRequest(f"logit_bias key {tid!r} is not a token id", "logit_bias")
                finite("logit_bias", bias)
                if not -100.0 <= bias <= 100.0:
                    raise InvalidRequest(f"logit_bias for token {tid} must be in [-100, 100]", "logit_bias")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or isinstance(self.prompt_logprobs, bool)
            or not 0 <= self.prompt_logprobs <= 20
        ):
            raise InvalidRequest("prompt_logprobs must be an integer in [0, 20]", "prompt_logprobs")
        if self.structured is not None:
            kind = self.structured.get("type") if isinstance(self.structured, dict) else None
            if kind not in ("json_object", "json_schema", "regex", "lark"):
                raise InvalidRequest("structured must have type json_object, json_schema, regex or lark",
                                     "response_format")


@dataclass
class TokenLogprob:
    """The chosen token's logprob and the top alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


# RequestOutput.error_code of a request that failed in the expert store: the server answers it
# with a 503 naming the fault. STORE_CORRUPT (a record failed its checksum: the files are damaged)
# also turns /health unhealthy until a restart; STORE_ERROR (an I/O error, a short read) may pass.
STORE_ERROR = "store_error"
STORE_CORRUPT = "store_corrupt"
STORE_CODES = (STORE_ERROR, STORE_CORRUPT)
# RequestOutput.error_code of a request whose grammar (its response format, compiled by the
# grammar engine) failed while decoding: the request's own format is past what the grammar engine
# can expand, so the server answers 400 as for a schema refused up front.
GRAMMAR_ERROR = "grammar_error"


@dataclass
class RequestOutput:
    """What one engine step produced for one request (only the new tokens)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprob] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # total so far
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # set when finish_reason == "error"
    # Only in a request's first output, when SamplingParams.prompt_logprobs was set: one entry
    # per prompt token (its logprob given the tokens before it), None for the first token.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error_code: str | None = None  # with an error: STORE_ERROR / STORE_CORRUPT when the expert store failed


# Structured output request carried to the sampler: {"type": "json_object"} or
# {"type": "json_schema", "schema": {...}} or {"type": "regex", "pattern": "..."}.
# Also {"type": "lark", "grammar": "..."} (llguidance Lark; the server's forced tool calls), and
# any of them may carry "reasoning": "open" | "optional" (free text up to </think> first).
StructuredSpec = dict

# Whitespace allowed between JSON tokens under a grammar: none, one space or tab, or one line
# break plus indentation. Compact, `"a": 1` style and pretty-printed JSON all pass, but a weak
# model cannot spend its budget on runs of blank lines. (llguidance `whitespace_pattern`.)
JSON_WHITESPACE = r"[ \t]?|\r?\n[ \t]{0,40}"


class EngineCore:
    """The synchronous engine the async bridge drives (documented interface, duck-typed).

    Attributes: `tokenizer` (a transformers tokenizer with the checkpoint's chat template),
    `max_model_len` (int), `eos_token_ids` (list[int]), `model_info` (dict: "arch", "name").
    Methods:
      add_request(request_id, prompt_token_ids, params: SamplingParams) -> None
          raises InvalidRequest for a prompt or params it cannot serve.
      abort_request(request_id) -> None      frees the sequence within one step.
      step() -> list[RequestOutput]          one scheduler step; only new tokens.
      has_unfinished_requests() -> bool
      stats() -> dict                        JSON-able counters (KV usage, tiers, queue).
      expert_heat() -> dict | None           per-layer expert counts (engine/expert_heat.py), or None.
    """
