"""One choice of one request: engine tokens -> text -> stop strings -> reasoning -> tool calls.

Every endpoint (chat, completions, responses, messages) drives its choices through
`ChoiceRun`, which yields `Delta`s and keeps the final tallies (text, reasoning, tool calls,
usage, finish reason). The layers, each incremental:

  RequestOutput.new_token_ids
    -> IncrementalDetokenizer   (no split UTF-8 characters, special tokens hidden)
    -> StopStringMatcher        (stop strings never leak; a match aborts the engine request)
    -> ReasoningParser          (<think>...</think> -> reasoning; optional)
    -> ToolParser               (family format -> OpenAI tool-call deltas; optional)

Thinking budget: once the reasoning has used `thinking_budget` tokens the engine request is
aborted and resubmitted with the generated tokens plus "\n</think>\n\n" appended to the
prompt. The engine's prefix cache makes the resubmission cheap; the client sees one stream.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator

from tiermoe.protocol import SamplingParams, TokenLogprob
from tiermoe.server.detokenize import IncrementalDetokenizer
from tiermoe.server.reasoning import CONTENT, REASONING, ReasoningParser
from tiermoe.server.stop_strings import StopStringMatcher
from tiermoe.server.text_buffer import TextBuffer
from tiermoe.server.tool_parsers import ToolCallDelta, ToolParser

if TYPE_CHECKING:
    from tiermoe.server.context import ServerContext

CLOSE_THINK = "\n</think>\n\n"


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # set on the last delta only

    def empty(self) -> bool:
        return not (self.reasoning or self.content or self.tool_calls or self.logprobs or self.finish_reason)


class ChoiceRun:
    def __init__(
        self,
        ctx: "ServerContext",
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        index: int = 0,
        stop: list[str] | None = None,
        reasoning: ReasoningParser | None = None,
        tools: ToolParser | None = None,
        forced_text: str = "",
        thinking_budget: int | None = None,
        endpoint: str = "chat",
    ):
        self.ctx = ctx
        self.request_id = request_id
        self.index = index
        self.prompt_ids = prompt_ids
        self.params = params
        self.endpoint = endpoint
        self._detok = IncrementalDetokenizer(ctx.tokenizer, ctx.hidden_ids, prompt_ids)
        self._stop = StopStringMatcher(stop or [])
        self.reasoning = reasoning
        self.tools = tools
        self._forced_text = forced_text
        self._forced_deltas: list[ToolCallDelta] = []
        self.thinking_budget = thinking_budget
        self._engine_id = request_id
        self._segment = 0
        self._stream = None
        self._done = False
        # tallies
        self._visible = TextBuffer()  # all visible text after stop handling (before reasoning/tool split)
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # when params.prompt_logprobs is set
        self.prompt_tokens = len(prompt_ids)
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.reasoning_tokens = 0
        self.finish_reason: str | None = None
        self.stop_matched: str | None = None
        self.error: str | None = None
        self.error_code: str | None = None  # protocol.STORE_CODES: the expert store failed (a 503)
        self._prior_tokens = 0  # completion tokens of earlier segments (thinking budget)
        self.t_submit = time.monotonic()
        self.t_first: float | None = None
        self._t_last: float | None = None
        # per-request timeout (loop clock); past it the engine request is aborted
        self.timeout_s: float | None = ctx.config.request_timeout_s
        self._deadline = asyncio.get_running_loop().time() + self.timeout_s if self.timeout_s else None
        self.timed_out = False

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Submit to the engine; raises InvalidRequest / EngineShutdown before any output."""
        self._stream = await self.ctx.engine.add_request(self._engine_id, self.prompt_ids, self.params)
        if self._forced_text and self.tools is not None:
            # the prompt already holds the call's opening; what it announces (the forced
            # call's id and name) goes out with the first delta
            _, self._forced_deltas = self.tools.feed(self._forced_text)

    def abort(self) -> None:
        """Stop this choice (client gone, or the request failed elsewhere); idempotent."""
        if not self._done:
            self._done = True
            self.ctx.engine.abort(self._engine_id)
            if self.finish_reason is None:
                self.finish_reason = "abort"
                self.ctx.metrics.observe_finish(self)

    @property
    def text(self) -> str:
        """All visible text after stop handling, before the reasoning / tool split (text_buffer.py:
        appended per token, joined when read)."""
        return self._visible.value

    @property
    def reasoning_text(self) -> str:
        return self.reasoning.reasoning_text if self.reasoning else ""

    @property
    def content(self) -> str:
        if self.tools is not None:
            return self.tools.content
        return self.reasoning.content_text if self.reasoning else self.text

    # ---- the stream ----------------------------------------------------------------------------
    async def deltas(self) -> AsyncIterator[Delta]:
        try:
            while not self._done:
                if self._deadline is None:
                    out = await self._stream.__anext__()
                else:
                    try:
                        async with asyncio.timeout_at(self._deadline):
                            out = await self._stream.__anext__()
                    except TimeoutError:
                        yield self._time_out()
                        return
                now = time.monotonic()
                delta = Delta(tool_calls=self._forced_deltas)
                self._forced_deltas = []
                if out.prompt_tokens and self._segment == 0:
                    self.prompt_tokens = out.prompt_tokens
                    self.cached_tokens = out.cached_tokens
                if out.prompt_logprobs is not None and self._segment == 0:
                    self.prompt_logprobs = out.prompt_logprobs
                if out.new_token_ids:
                    self._timing(now, len(out.new_token_ids))
                    over = self._accept(out.new_token_ids, out.logprobs, delta)
                    if over:
                        await self._close_reasoning(delta)
                        if not delta.empty():
                            yield delta
                        continue
                # the core's running count, or our own if the core does not keep one
                self.completion_tokens = max(
                    self.completion_tokens, self._prior_tokens + out.completion_tokens, len(self.token_ids)
                )
                if self.stop_matched is not None or (self.tools is not None and self.tools.repeated):
                    # a stop string, or a forced turn repeating a call (tool_parsers/base.py): done
                    self.ctx.engine.abort(self._engine_id)
                    self._finish("stop", delta)
                elif out.finished:
                    if out.finish_reason == "error":
                        self.error, self.error_code = out.error or "engine error", out.error_code
                    self._finish(out.finish_reason or "stop", delta)
                if not delta.empty():
                    yield delta
        finally:
            if not self._done:
                self.abort()

    def _time_out(self) -> Delta:
        """The request ran past the server's --request-timeout: abort it, finish with an error."""
        self.ctx.engine.abort(self._engine_id)
        self.timed_out = True
        self.error = f"request timed out after {self.timeout_s:g} s (server --request-timeout)"
        delta = Delta()
        self._finish("error", delta)
        return delta

    def _accept(self, ids: list[int], logprobs: list[TokenLogprob] | None, delta: Delta) -> bool:
        """Feed new tokens through the layers; True when the thinking budget ran out.

        While the reasoning parser has not reached the answer, tokens go one at a time, so
        reasoning tokens are counted exactly and the budget cuts at the right token (tokens
        the engine produced past the cut are dropped; the resubmission replaces them).
        """
        i = 0
        while i < len(ids):
            parser = self.reasoning
            per_token = parser is not None and parser.state != CONTENT and self.stop_matched is None
            j = i + 1 if per_token else len(ids)
            before = parser.state if parser is not None else None
            self.token_ids.extend(ids[i:j])
            if logprobs:
                self.logprobs.extend(logprobs[i:j])
                delta.logprobs.extend(logprobs[i:j])
            self._text(self._detok.push(ids[i:j]), delta)
            if per_token and (before == REASONING or parser.state == REASONING):
                self.reasoning_tokens += j - i
                if self._over_budget():
                    return True
            i = j
        return False

    def _timing(self, now: float, n: int) -> None:
        if self.t_first is None:
            self.t_first = now
            self.ctx.metrics.observe_ttft(now - self.t_submit)
        elif self._t_last is not None:
            self.ctx.metrics.observe_itl((now - self._t_last) / n)
        self._t_last = now

    def _text(self, text: str, delta: Delta) -> None:
        if not text:
            return
        visible, matched = self._stop.push(text)
        if matched is not None:
            self.stop_matched = matched
        self._route(visible, delta)

    def _route(self, text: str, delta: Delta) -> None:
        if not text:
            return
        self._visible.append(text)
        if self.reasoning is not None:
            r, text = self.reasoning.feed(text)
            delta.reasoning += r
        self._to_tools(text, delta)

    def _to_tools(self, text: str, delta: Delta) -> None:
        if not text:
            return
        if self.tools is None:
            delta.content += text
            return
        content, calls = self.tools.feed(text)
        delta.content += content
        delta.tool_calls += calls

    def _finish(self, reason: str, delta: Delta) -> None:
        """Flush every layer in order and record the finish reason."""
        self._done = True
        if self.stop_matched is None:
            tail, matched = self._stop.push(self._detok.flush())
            if matched is not None:
                self.stop_matched = matched
                reason = "stop"
            else:
                tail += self._stop.flush()
            self._route(tail, delta)
        if self.reasoning is not None:
            r, c = self.reasoning.finish()
            delta.reasoning += r
            self._to_tools(c, delta)
        if self.tools is not None:
            c, calls = self.tools.finish()
            delta.content += c
            delta.tool_calls += calls
            if self.tools.calls and reason == "stop":
                reason = "tool_calls"
        self.finish_reason = reason
        delta.finish_reason = reason
        self.ctx.metrics.observe_finish(self)

    # ---- thinking budget ---------------------------------------------------------------------
    def _over_budget(self) -> bool:
        return (
            self.thinking_budget is not None
            and self.reasoning is not None
            and self.reasoning.in_reasoning
            and self.reasoning_tokens >= self.thinking_budget
        )

    async def _close_reasoning(self, delta: Delta) -> None:
        """Abort, then resubmit with the reasoning closed by force."""
        self.ctx.engine.abort(self._engine_id)
        forced = self.ctx.tokenizer.encode(CLOSE_THINK, add_special_tokens=False)
        self._text(self._detok.push(forced), delta)
        self.token_ids.extend(forced)
        self._prior_tokens = len(self.token_ids)
        self.completion_tokens = self._prior_tokens
        params = SamplingParams(**{k: getattr(self.params, k) for k in SamplingParams.__dataclass_fields__})
        params.prompt_logprobs = None  # the first segment already delivered them
        if params.structured is not None:  # the think block is closed now: the answer comes next
            params.structured = {k: v for k, v in params.structured.items() if k != "reasoning"}
        if params.max_tokens is not None:
            left = params.max_tokens - self._prior_tokens
            if left < 1:
                self._finish("length", delta)
                return
            params.max_tokens = left
        params.min_tokens = max(0, params.min_tokens - self._prior_tokens)  # both count this segment's tokens
        if params.seed is not None:
            params.seed += 1
        self._segment += 1
        self._engine_id = f"{self.request_id}.t{self._segment}"
        prompt = self.prompt_ids + self.token_ids
        if len(prompt) >= self.ctx.max_model_len:
            self._finish("length", delta)
            return
        try:
            self._stream = await self.ctx.engine.add_request(self._engine_id, prompt, params)
        except Exception as exc:  # refused (shutting down, or the core's own limits)
            self.error = f"could not continue after the thinking budget: {exc}"
            self._finish("error", delta)
