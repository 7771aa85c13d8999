"""What every route needs: the engine, the limits, the tokenizer, and the shared checks.

Tokenizing and rendering chat templates run on one dedicated worker thread, so a 32k-token
prompt never stalls the event loop that is streaming other clients' tokens (and the tokenizer
is never entered by two threads at once from this process). JSON Schema checks run on a second
one and the output re-checks of structured requests on a third, for the same reason (and so a
queue of output checks never delays a request's schema check).
"""

from __future__ import annotations

import asyncio
import math
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass, field

from tiermoe.engine.async_engine import AsyncEngine, EngineDead, EngineShutdown
from tiermoe.protocol import InvalidRequest, SamplingParams
from tiermoe.server.chat import ToolPlan
from tiermoe.server.connections import ConnectionSlots
from tiermoe.server.detokenize import TokenTexts, hidden_token_ids
from tiermoe.server.errors import APIError, bad_request, brief
from tiermoe.server.generation import ChoiceRun
from tiermoe.server.metrics import Metrics
from tiermoe.server.output_check import OutputChecker
from tiermoe.server.reasoning import ReasoningParser
from tiermoe.server.sampling_defaults import SamplingDefaults
from tiermoe.server.structured import SchemaChecker, SchemaToCheck, lark_marker
from tiermoe.server.tool_parsers import ToolParser, detect_tool_format, get_tool_parser

# Whether the request being handled (one per asyncio task) has been handed to the engine; before
# that, any failure comes from its content (handling.run_endpoint answers 400).
reached_engine: ContextVar[bool] = ContextVar("tiermoe_reached_engine", default=False)



class Reservation:
    """Queue slots one request has reserved at admission and not yet handed to the engine."""

    __slots__ = ("slots",)

    def __init__(self) -> None:
        self.slots = 0


# The reservation of the request being handled (one per asyncio task); run_endpoint sets it and
# releases what is left of it however the request ends (error, disconnect, cancellation).
reservation: ContextVar[Reservation | None] = ContextVar("tiermoe_reservation", default=None)

# A logit_bias key: a token id in decimal, ASCII digits only (re's [0-9] matches no other digits).
_TOKEN_ID = re.compile(r"[0-9]+")


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_model_len: int | None = None  # None: the engine's
    max_queue: int = 256  # requests allowed to wait beyond the engine's running capacity
    max_body_bytes: int = 32 * 1024 * 1024
    tool_format: str | None = None  # None: detect from the engine / chat template
    reasoning: bool | None = None  # None: on when the tokenizer knows </think>
    thinking_budget: int | None = None  # default budget when a request sets none
    cors_origins: list[str] = field(default_factory=list)
    retry_after_s: int = 1
    aliases: list[str] = field(default_factory=list)  # other names accepted as `model`
    request_timeout_s: float | None = None  # a generation running longer is aborted (504 / in-stream error)
    max_connections: int | None = None  # concurrent API requests (probes excluded) before 429
    max_connections_per_client: int | None = None  # of those, from one client address (connections.py)
    body_timeout_s: float | None = 30.0  # the whole body must arrive within this (408 and close)
    header_timeout_s: float = 10.0  # request headers must arrive within this (408 and close; uvicorn level)
    keep_alive_timeout_s: float = 5.0  # an idle connection between requests is closed after this
    # what a request's left-out temperature, top_p, top_k, min_p, repetition_penalty take (sampling_defaults.py)
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)


def check_temperature(value: float | None, upper: float) -> None:
    """The API's own range for temperature, [0, upper] (OpenAI 2, Anthropic 1), on its routes: vLLM
    has no upper bound, but a 20 meant as 0.2 would sample noise. Below 0 and non-finite values are
    SamplingParams.validate's."""
    if value is not None and math.isfinite(value) and value > upper:
        raise bad_request(f"temperature must be in [0, {upper:g}], got {value:g}", param="temperature",
                          code="invalid_value")


class ServerContext:
    def __init__(self, engine: AsyncEngine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        self.model_name = config.served_model_name
        self.model_names = {config.served_model_name, *config.aliases}
        self.max_model_len = min(config.max_model_len or engine.max_model_len, engine.max_model_len)
        self.hidden_ids = hidden_token_ids(self.tokenizer, engine.eos_token_ids)
        self.token_texts = TokenTexts(self.tokenizer)
        self.metrics = Metrics()
        self.vocab_size = len(self.tokenizer)
        template = getattr(self.tokenizer, "chat_template", None)
        fmt = config.tool_format or detect_tool_format(engine.model_info, template)
        self.tool_parser_cls: type[ToolParser] = get_tool_parser(fmt)
        self.tool_format = fmt
        vocab = self.tokenizer.get_vocab()
        self.reasoning_enabled = config.reasoning if config.reasoning is not None else ("</think>" in vocab)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiermoe-tokenize")
        self._check_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiermoe-check")
        self._output_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiermoe-output-check")
        self.schemas = SchemaChecker(self._off_loop_checks)
        self.outputs = OutputChecker(self._output_pool, self.metrics.structured_invalid)
        self.reserved = 0  # slots admitted but not yet in the engine (admit -> start_runs)
        self.connections = ConnectionSlots.with_stream_pool(config.max_connections, config.max_connections_per_client,
                                                            config.retry_after_s)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._check_pool.shutdown(wait=False, cancel_futures=True)
        self._output_pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}{uuid.uuid4().hex}"

    # ---- checks ---------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is None or name in self.model_names:
            return
        raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_name}'",
                       param="model", code="model_not_found")

    def admit(self, n: int) -> None:
        """Refuse work the engine cannot queue: 503 while draining, 429 when the queue is full.

        The n slots are reserved here, at once: between admission and `start_runs` a handler
        awaits rendering, tokenizing and schema checks, and a count read only from the engine
        let a burst of simultaneous requests all pass against the same number (9 admitted for a
        limit of 4). The reservation is released as the runs reach the engine (which counts them
        from then on), or by `release` when the request ends without reaching it."""
        engine = self.engine
        if engine.draining:
            raise APIError(503, "server is shutting down", code="shutting_down")
        if not engine.alive:
            raise APIError(503, "engine is not running", code="engine_unavailable")
        limit = engine.capacity + self.config.max_queue
        in_flight = engine.num_unfinished + self.reserved
        if in_flight + n > limit:
            self.metrics.rejected.inc()
            raise APIError(
                429,
                f"server is at capacity ({in_flight} requests in flight, limit {limit}); retry shortly",
                code="queue_full",
                headers={"Retry-After": str(self.config.retry_after_s)},
            )
        held = reservation.get()
        if held is not None:  # outside run_endpoint nothing could release it: check only
            held.slots += n
            self.reserved += n

    def release(self, held: Reservation, n: int | None = None) -> None:
        """Give back n (default: all) of a request's reserved slots."""
        n = held.slots if n is None else min(n, held.slots)
        held.slots -= n
        self.reserved -= n

    def check_context(self, prompt_len: int, max_tokens: int | None, prompt_param: str, max_param: str) -> int:
        """Validate lengths against the context; returns the max_tokens to use."""
        if prompt_len == 0:
            raise bad_request("the prompt is empty", param=prompt_param)
        room = self.max_model_len - prompt_len
        if room < 1:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens; "
                f"the prompt has {prompt_len} tokens",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            return room
        if isinstance(max_tokens, bool) or max_tokens < 1:
            raise bad_request(f"{max_param} must be a positive integer", param=max_param)
        if max_tokens > room:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens; you requested "
                f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} for the completion)",
                param=max_param,
                code="context_length_exceeded",
            )
        return max_tokens

    def sampling_params(self, *, max_tokens: int, structured: dict | None = None, max_temperature: float = 2.0,
                        **fields) -> SamplingParams:
        """Build and validate SamplingParams. None-valued fields take the server's sampling
        defaults (the model's generation_config.json or the neutral values, --generation-config),
        else SamplingParams' own. max_temperature: the API's bound on the request's temperature (OpenAI 2,
        Anthropic 1; check_temperature)."""
        check_temperature(fields.get("temperature"), max_temperature)
        logit_bias = fields.pop("logit_bias", None)
        kwargs = {**self.config.sampling_defaults.values(), **{k: v for k, v in fields.items() if v is not None}}
        if kwargs.get("top_k") == -1:
            kwargs["top_k"] = 0
        params = SamplingParams(max_tokens=max_tokens, structured=structured, **kwargs)
        if logit_bias:
            params.logit_bias = self.logit_bias(logit_bias)
        if "seed" in kwargs and not -(2**63) <= kwargs["seed"] < 2**63:
            raise bad_request("seed must fit in 64 bits", param="seed")
        for tid in params.stop_token_ids:
            if not 0 <= tid < self.vocab_size:
                raise bad_request(f"stop_token_ids holds {brief(str(tid))}, outside the vocabulary",
                                  param="stop_token_ids")
        try:
            params.validate()
        except InvalidRequest as exc:
            raise bad_request(str(exc), param=exc.param) from None
        return params

    def logit_bias(self, raw: dict) -> dict[int, float]:
        """OpenAI logit_bias (token id as a string -> bias in [-100, 100]) -> {id: bias}; else 400.

        A key is ASCII digits only: int() would also read " 5", "+5", "5_0" and non-ASCII digits
        such as "٥", so a key no other server takes would bias some token here. Digits past the
        vocabulary's width are out of range without int() (which refuses over 4300 digits)."""
        out: dict[int, float] = {}
        width = len(str(self.vocab_size))
        for key, value in raw.items():
            if not isinstance(key, str) or not _TOKEN_ID.fullmatch(key):
                shown = brief(repr(key))
                raise bad_request(f"logit_bias key {shown} is not a token id (a decimal number of ASCII digits)",
                                  param="logit_bias", code="invalid_value")
            digits = key.lstrip("0") or "0"
            if len(digits) > width or int(digits) >= self.vocab_size:
                shown = brief(digits)
                raise bad_request(f"logit_bias key {shown} is outside the vocabulary [0, {self.vocab_size})",
                                  param="logit_bias")
            tid = int(digits)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not -100 <= value <= 100:
                raise bad_request(f"logit_bias value for token {tid} must be a number in [-100, 100]",
                                  param="logit_bias")
            out[tid] = float(value)
        return out

    async def check_schemas(self, items: list[SchemaToCheck]) -> None:
        """Every JSON Schema of a request (tools, response format): limits, validity, and for
        response formats whether the grammar engine can enforce them; a 400 for the first that fails."""
        if items:
            await self.schemas.check(items)

    # ---- tokenizer work, off the event loop ------------------------------------------------------
    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _off_loop_checks(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._check_pool, fn, *args)

    async def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. A text far beyond the context is refused (400) after tokenizing
        growing prefixes of it, never the whole: tokenizing 30 MB takes about a minute on the one
        tokenizer thread, which would stall every other request.
        """
        if len(text) <= 4 * self.max_model_len:
            return await self._off_loop(
                lambda: list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens)))
        return await self._off_loop(self._encode_bounded, text, add_special_tokens)

    def _encode_bounded(self, text: str, add_special_tokens: bool) -> list[int]:
        limit = self.max_model_len + 64  # slack: a cut through a word or special token adds a few
        k = 4 * self.max_model_len
        while k < len(text):
            n = len(self.tokenizer.encode(text[:k], add_special_tokens=add_special_tokens))
            if n > limit:
                raise bad_request(
                    f"This model's maximum context length is {self.max_model_len} tokens; the prompt is longer "
                    f"({n} tokens in its first {k} characters, of {len(text)})",
                    code="context_length_exceeded",
                )
            k *= 4
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """400 naming the first id outside the vocabulary (`param`[index]). min and max first, so a
        valid list costs two C-speed passes; callers bound its length by the context before."""
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            i, t = next((i, t) for i, t in enumerate(ids) if not 0 <= t < self.vocab_size)
            raise bad_request(f"token {brief(str(t))} is outside the vocabulary (size {self.vocab_size})",
                              param=f"{param}[{i}]")

    async def decode(self, ids: list[int]) -> str:
        """The text of token ids (special tokens kept), on the tokenizer thread."""
        return await self._off_loop(lambda: self.tokenizer.decode(ids, skip_special_tokens=False))

    async def render_chat(
        self, messages: list[dict], tools: list[dict] | None, template_kwargs: dict | None,
        add_generation_prompt: bool = True,
    ) -> str:
        """Apply the chat template; a template that refuses the conversation is a 400."""
        if len(messages) >= self.max_model_len:  # each message renders to at least one token
            raise bad_request(
                f"{len(messages)} messages cannot fit in this model's context of {self.max_model_len} tokens",
                param="messages", code="context_length_exceeded",
            )
        kwargs = dict(template_kwargs or {})
        if "chat_template" in kwargs:
            # apply_chat_template would render the client's Jinja instead of the model's: unbounded
            # loops and allocations on the shared tokenizer thread
            raise bad_request("chat_template_kwargs may not replace the model's chat template",
                              param="chat_template_kwargs.chat_template")
        for reserved in ("messages", "tools", "add_generation_prompt", "tokenize", "conversation"):
            kwargs.pop(reserved, None)

        def render() -> str:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
            )

        try:
            text = await self._off_loop(render)
        except APIError:
            raise
        except Exception as exc:  # jinja errors, raise_exception() in templates, bad kwargs
            raise bad_request(f"chat template could not render these messages: {exc}", param="messages") from None
        if not isinstance(text, str):
            raise bad_request("chat template did not produce text", param="messages")
        return text

    # ---- runs -------------------------------------------------------------------------------------
    def forced_text(self, plan: ToolPlan | None) -> str:
        """Text appended to the rendered prompt so the model starts the forced tool call."""
        if plan is None or not (plan.parse and plan.force):
            return ""
        return self.tool_parser_cls(plan.functions).forced_prefix(plan.forced_name)

    def make_run(
        self,
        request_id: str,
        prompt_text: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        index: int = 0,
        stop: list[str] | None = None,
        plan: ToolPlan | None = None,
        reasoning: bool = True,
        thinking_budget: int | None = None,
        id_prefix: str = "call_",
        endpoint: str = "chat",
    ) -> ChoiceRun:
        tools = None
        forced = ""
        if plan is not None and plan.parse:
            tools = self.tool_parser_cls(plan.functions, id_prefix=id_prefix, max_calls=plan.max_calls,
                                         unique_calls=plan.force)
            forced = self.forced_text(plan)
        parser = None
        if reasoning and self.reasoning_enabled and not forced:
            parser = ReasoningParser(prompt_opens_reasoning=prompt_text.rstrip().endswith("<think>"))
        if forced and params.structured is None:
            # a forced call's arguments follow its tool's schema (served unconstrained if the
            # schema has features the grammar engine cannot compile)
            grammar = tools.forced_grammar(plan.forced_name, lambda t: lark_marker(self.tokenizer, t))
            if grammar:
                params.structured = {"type": "lark", "grammar": grammar, "best_effort": True}
        if parser is not None and params.structured is not None and not prompt_text.rstrip().endswith("</think>"):
            # the constrained answer may come after a think block (already open, or the model's
            # choice); a prompt ending in a closed block has thinking switched off
            params.structured = {**params.structured, "reasoning": "open" if parser.in_reasoning else "optional"}
        budget = thinking_budget if thinking_budget is not None else self.config.thinking_budget
        return ChoiceRun(
            self, request_id, prompt_ids, params, index=index, stop=stop, reasoning=parser, tools=tools,
            forced_text=forced, thinking_budget=budget if parser is not None else None, endpoint=endpoint,
        )

    async def start_runs(self, runs: list[ChoiceRun]) -> None:
        """Submit every run; on any refusal abort those already started and raise a 4xx/503.
        Once all are accepted, later failures are no longer the request's content's doing."""
        started = []
        held = reservation.get()
        try:
            for run in runs:
                if held is not None:
                    # the slot moves from the reservation to the engine's count with no await in
                    # between: AsyncEngine.add_request registers the request before its first
                    # await, so no other request sees it counted twice (a spurious 429 at the
                    # limit) or not at all (an overshoot)
                    self.release(held, 1)
                await run.start()
                started.append(run)
        except BaseException as exc:
            for run in started:
                run.abort()
            if isinstance(exc, InvalidRequest):
                raise bad_request(str(exc), param=exc.param) from None
            if isinstance(exc, (EngineShutdown, EngineDead)):
                raise APIError(503, str(exc), code="engine_unavailable") from None
            raise
        reached_engine.set(True)
