"""POST /v1/chat/completions and POST /v1/completions (OpenAI wire format)."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tiermoe.protocol import GRAMMAR_ERROR, STORE_CODES, TokenLogprob
from tiermoe.server.chat import constraint_schemas, openai_messages, plan_tools
from tiermoe.server.context import ServerContext
from tiermoe.server.errors import bad_request
from tiermoe.server.generation import ChoiceRun, Delta
from tiermoe.server.handling import parse_body, run_endpoint
from tiermoe.server.limits import check_stop_strings
from tiermoe.server.protocol import ChatCompletionRequest, CompletionRequest
from tiermoe.server.streaming import EventStream, drain, merged, sse, until_disconnect
from tiermoe.server.structured import format_schemas, structured_spec

FORMAT_SCHEMA = "response_format.json_schema.schema"  # where chat and completions requests put a schema


def _format_spec(rf) -> dict | None:
    """The sampler spec of a chat or completions request's response_format (None: plain text)."""
    if rf is None:
        return None
    return structured_spec(rf.type, rf.json_schema.schema_ if rf.json_schema else None, "response_format",
                           FORMAT_SCHEMA)


def register(app) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run_endpoint(request, chat)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run_endpoint(request, complete)


def _sampling_fields(req) -> dict:
    if req.stream_options is not None and not req.stream:  # as OpenAI and vLLM: options of a stream not asked for
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options",
                          code="invalid_value")
    return dict(
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens, logit_bias=req.logit_bias,
    )


def usage_dict(runs: list[ChoiceRun]) -> dict:
    prompt = runs[0].prompt_tokens if runs else 0
    completion = sum(r.completion_tokens for r in runs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": runs[0].cached_tokens if runs else 0},
        "completion_tokens_details": {"reasoning_tokens": sum(r.reasoning_tokens for r in runs)},
    }


def _token_key(ctx: ServerContext, as_ids: bool):
    """How a token is named in logprobs: its text, or "token_id:N" (vLLM's return_tokens_as_token_ids)."""
    return (lambda tid: f"token_id:{tid}") if as_ids else ctx.token_texts.text


def _chat_logprobs(ctx: ServerContext, items: list[TokenLogprob], top_n: int, as_ids: bool = False) -> dict:
    texts = ctx.token_texts
    key = _token_key(ctx, as_ids)

    def entry(tid: int, lp: float) -> dict:
        return {"token": key(tid), "logprob": lp, "bytes": list(texts.bytes(tid))}

    return {
        "content": [
            {**entry(it.token_id, it.logprob), "top_logprobs": [entry(t, lp) for t, lp in it.top[:top_n]]}
            for it in items
        ]
    }


# ---- chat ------------------------------------------------------------------------------------


async def chat(request: Request, ctx: ServerContext) -> Response:
    req: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest)
    ctx.check_model(req.model)
    stops = check_stop_strings(req.stop, "stop")
    if req.functions or req.function_call is not None:
        raise bad_request("functions and function_call (deprecated by OpenAI) are not supported; send the same "
                          "definitions as tools ({\"type\": \"function\", \"function\": ...}) and tool_choice",
                          param="functions" if req.functions else "function_call", code="unsupported_parameter")
    messages = openai_messages(req.messages)
    choice = req.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = {"name": choice.function.name}
    plan = plan_tools([t.function.model_dump(exclude_none=True) for t in req.tools or []], choice, can_parse=True)
    if req.parallel_tool_calls is False:
        plan.max_calls = 1
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs: true", param="top_logprobs")
    both = req.max_tokens is not None and req.max_completion_tokens is not None
    if both and req.max_tokens != req.max_completion_tokens:
        raise bad_request("max_tokens and max_completion_tokens disagree", param="max_completion_tokens")
    # OpenAI: max_completion_tokens replaces max_tokens; absent (null) means the remaining context,
    # and 0 or less is refused for both (check_context), never read as "no limit"
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    spec = _format_spec(req.response_format)
    await ctx.check_schemas(constraint_schemas(plan, spec, "response_format", FORMAT_SCHEMA))
    template_kwargs = dict(req.chat_template_kwargs or {})
    budget = req.thinking_budget
    if budget is None and "thinking_budget" in template_kwargs:
        budget = template_kwargs["thinking_budget"]
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise bad_request("chat_template_kwargs.thinking_budget must be an integer >= 0",
                              param="chat_template_kwargs.thinking_budget")
    ctx.admit(req.n)

    prompt_text = await ctx.render_chat(messages, plan.template_tools, template_kwargs)
    prompt_text += ctx.forced_text(plan)
    prompt_ids = await ctx.encode(prompt_text)
    max_tokens = ctx.check_context(len(prompt_ids), requested, "messages", max_param)
    top_n = req.top_logprobs or 0
    as_ids = req.return_tokens_as_token_ids
    rid = ctx.new_id("chatcmpl-")
    runs = []
    for i in range(req.n):
        params = ctx.sampling_params(
            max_tokens=max_tokens, structured=spec, logprobs=top_n if req.logprobs else None, **_sampling_fields(req)
        )
        if params.seed is not None:
            params.seed += i
        runs.append(
            ctx.make_run(f"{rid}-{i}", prompt_text, prompt_ids, params, index=i, stop=stops, plan=plan,
                         thinking_budget=budget)
        )
    await ctx.start_runs(runs)
    created = int(time.time())
    if req.stream:
        include_usage, continuous = _usage_options(req.stream_options)
        return EventStream(_chat_stream(ctx, rid, created, runs, top_n, include_usage, as_ids, continuous),
                           on_close=lambda: [r.abort() for r in runs])
    await until_disconnect(request, drain(runs))
    choices = []
    for run in runs:
        _check_structured(ctx, spec, run)
        content = run.content if (run.content or not run.tools or not run.tools.calls) else None
        message: dict = {"role": "assistant", "content": content}
        if run.reasoning_text:
            message["reasoning_content"] = run.reasoning_text
        if run.tools is not None and run.tools.calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in run.tools.calls
            ]
        choices.append({
            "index": run.index,
            "message": message,
            "logprobs": _chat_logprobs(ctx, run.logprobs, top_n, as_ids) if run.params.logprobs is not None else None,
            "finish_reason": _finish(run),
        })
    body = {"id": rid, "object": "chat.completion", "created": created, "model": ctx.model_name, "choices": choices,
            "usage": usage_dict(runs)}
    return JSONResponse(body)


def _usage_options(options) -> tuple[bool, bool]:
    """(include_usage, continuous): the final usage chunk, and vLLM's continuous_usage_stats (every
    chunk carries the usage so far; only together with include_usage, as in vLLM)."""
    include = bool(options and options.include_usage)
    return include, include and bool(options.continuous_usage_stats)


def _finish(run: ChoiceRun) -> str:
    return "stop" if run.finish_reason in (None, "abort") else run.finish_reason


def _check_structured(ctx: ServerContext, spec: dict | None, run: ChoiceRun) -> None:
    """Queue the output's format check (a metric; off the event loop, see output_check.py)."""
    if spec is not None and run.finish_reason != "length":
        ctx.outputs.submit(spec, run.content, run.request_id)


async def _chat_stream(ctx: ServerContext, rid: str, created: int, runs: list[ChoiceRun], top_n: int,
                       include_usage: bool, as_ids: bool = False, continuous: bool = False):
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name}

    def chunk(index: int, delta: dict, finish=None, logprobs=None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        extra = {"usage": usage_dict(runs) if continuous else None} if include_usage else {}
        return sse({**base, "choices": [choice], **extra})

    try:
        for run in runs:
            yield chunk(run.index, {"role": "assistant", "content": ""})
        async for run, d in merged(runs):
            event = from_delta(ctx, run, d, chunk, top_n, as_ids)
            if event:
                yield event
            if d.finish_reason == "error":
                yield in_band_error(run)
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage_dict(runs)})
        yield "data: [DONE]\n\n"
    finally:
        for run in runs:
            run.abort()


def in_band_error(run: ChoiceRun) -> str:
    """The SSE error event sent when a stream fails after its headers went out (engine error,
    expert store failure or request timeout), on chat and completions alike."""
    if run.error_code in STORE_CODES:
        return sse({"error": {"message": f"expert store: {run.error}", "type": "service_unavailable",
                              "param": None, "code": run.error_code}})
    if run.error_code == GRAMMAR_ERROR:
        return sse({"error": {"message": f"the response format cannot be enforced: {run.error}",
                              "type": "invalid_request_error", "param": None, "code": "unsupported_schema"}})
    return sse({"error": {"message": run.error or "engine error", "type": "server_error", "param": None,
                          "code": "request_timeout" if run.timed_out else "engine_error"}})


def from_delta(ctx: ServerContext, run: ChoiceRun, d: Delta, chunk, top_n: int, as_ids: bool = False) -> str:
    """One Delta -> the SSE chunk(s) OpenAI clients expect."""
    delta: dict = {}
    if d.reasoning:
        delta["reasoning_content"] = d.reasoning
    if d.content:
        delta["content"] = d.content
    if d.tool_calls:
        calls = []
        for tc in d.tool_calls:
            item: dict = {"index": tc.index}
            if tc.id is not None:
                item.update(id=tc.id, type="function", function={"name": tc.name, "arguments": tc.arguments})
            else:
                item["function"] = {"arguments": tc.arguments}
            calls.append(item)
        delta["tool_calls"] = calls
    wants_logprobs = d.logprobs and run.params.logprobs is not None
    logprobs = _chat_logprobs(ctx, d.logprobs, top_n, as_ids) if wants_logprobs else None
    finish = _finish(run) if d.finish_reason else None
    if not delta and logprobs is None and finish is None:
        return ""
    return chunk(run.index, delta, finish, logprobs)


# ---- completions -----------------------------------------------------------------------------


def _prompt_list(ctx: ServerContext, prompt) -> list[str | list[int]]:
    """The prompts of a completions request, without tokenizing or reading any of them.

    O(number of prompts), never O(tokens): an id list longer than the context is refused by its
    length alone (a 20 MB body holds 10 million ids, and walking them on the event loop stalled
    every stream for seconds); the ids themselves are range-checked in `_prompts`.
    pydantic has already typed the union, so the first element tells an id list from a list."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise bad_request("prompt is empty", param="prompt")
    for p in prompts:
        if not isinstance(p, str) and len(p) >= ctx.max_model_len:
            ctx.check_context(len(p), None, "prompt", "max_tokens")  # raises context_length_exceeded
    return prompts


async def _prompts(ctx: ServerContext, prompts: list[str | list[int]]) -> list[tuple[str, list[int]]]:
    """(text, token ids) of each prompt: text prompts are tokenized and id prompts decoded on the
    tokenizer thread (a decode of a context's worth of ids takes milliseconds that the event loop
    streaming other clients' tokens should not pay); id prompts are range-checked first, in place
    (min and max of a list the context bounds)."""
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            ids = await ctx.encode(p, add_special_tokens=True)
            out.append((p, ids))
        else:
            ctx.check_token_ids(p, f"prompt[{i}]")
            out.append((await ctx.decode(p), list(p)))
    return out


def _completion_logprobs(ctx: ServerContext, ids: list[int], items: list[TokenLogprob | None], top_n: int,
                         offset: int, as_ids: bool = False) -> dict:
    """Legacy completions logprobs for tokens `ids`; an item of None (the first prompt token under
    echo) has a null logprob and null top_logprobs. Offsets advance by each token's text."""
    texts = ctx.token_texts
    key = _token_key(ctx, as_ids)
    tokens, lps, tops, offsets = [], [], [], []
    for tid, it in zip(ids, items):
        tokens.append(key(tid))
        lps.append(it.logprob if it is not None else None)
        tops.append(({key(t): lp for t, lp in it.top[:top_n]} or None) if it is not None else None)
        offsets.append(offset)
        offset += len(texts.text(tid))
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _echo_choice(ctx: ServerContext, run: ChoiceRun, text: str, ids: list[int], as_ids: bool) -> tuple[dict, int]:
    """The chunk that opens a choice streamed with echo: its prompt, with the prompt's logprobs
    when asked (the run has them from its first engine output); and the text offset at which the
    generated tokens' logprobs go on, as in the non-streamed answer."""
    lp, end = None, 0
    if run.params.logprobs is not None:
        items: list[TokenLogprob | None] = list(run.prompt_logprobs or [None] * len(ids))
        lp = _completion_logprobs(ctx, ids, items, run.params.logprobs or 0, 0, as_ids)
        end = sum(len(ctx.token_texts.text(t)) for t in ids)
    return {"index": run.index, "text": text, "logprobs": lp, "finish_reason": None}, end


def _choice_logprobs(ctx: ServerContext, run: ChoiceRun, prompt_ids: list[int], echo: bool, as_ids: bool,
                     score_only: bool) -> dict | None:
    """A finished choice's logprobs; with echo they start with the prompt's (OpenAI legacy semantics)."""
    if run.params.logprobs is None:
        return None
    top_n = run.params.logprobs or 0
    items: list[TokenLogprob | None] = [] if score_only else list(run.logprobs)
    ids = [it.token_id for it in items]
    if echo:  # a core without prompt logprobs leaves them null
        ids, items = list(prompt_ids) + ids, list(run.prompt_logprobs or [None] * len(prompt_ids)) + items
    return _completion_logprobs(ctx, ids, items, top_n, 0, as_ids)


async def complete(request: Request, ctx: ServerContext) -> Response:
    req: CompletionRequest = await parse_body(request, CompletionRequest)
    ctx.check_model(req.model)
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    stops = check_stop_strings(req.stop, "stop")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of other than n is not supported", param="best_of")
    # echo with max_tokens 0 scores the prompt only (one token is generated and dropped)
    if req.max_tokens is None:
        # an explicit null is the default, as when the field is left out (OpenAI: 16), never "up
        # to the end of the context" (which kept a client waiting minutes for 8,000 tokens)
        req.max_tokens = CompletionRequest.model_fields["max_tokens"].default
    score_only = req.echo and req.max_tokens == 0
    if score_only and req.stream:
        raise bad_request("echo with max_tokens 0 (scoring the prompt) is not supported with stream; send it "
                          "without stream", param="echo")
    as_ids = req.return_tokens_as_token_ids
    spec = _format_spec(req.response_format)
    await ctx.check_schemas(format_schemas(spec, FORMAT_SCHEMA))
    # Admission is counted from the list alone, so a list the queue cannot take is refused before
    # any of it is tokenized (a long list of long prompts holds the one tokenizer thread for
    # seconds); the slots stay reserved while it is tokenized (ServerContext.admit).
    listed = _prompt_list(ctx, req.prompt)
    ctx.admit(req.n * len(listed))
    prompts = await _prompts(ctx, listed)
    rid = ctx.new_id("cmpl-")
    runs = []
    for p_idx, (text, ids) in enumerate(prompts):
        max_tokens = ctx.check_context(len(ids), 1 if score_only else req.max_tokens, "prompt", "max_tokens")
        for i in range(req.n):
            params = ctx.sampling_params(max_tokens=max_tokens, structured=spec, logprobs=req.logprobs,
                                         **_sampling_fields(req))
            if req.echo and req.logprobs is not None:
                params.prompt_logprobs = req.logprobs
            if params.seed is not None:
                params.seed += i
            k = p_idx * req.n + i
            runs.append(ctx.make_run(f"{rid}-{k}", text, ids, params, index=k, stop=stops, reasoning=False,
                                     endpoint="completions"))
    await ctx.start_runs(runs)
    created = int(time.time())
    base = {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name}
    if req.stream:
        include_usage, continuous = _usage_options(req.stream_options)

        async def events():
            offsets = {r.index: 0 for r in runs}
            echoed: set[int] = set()
            try:
                async for run, d in merged(runs):
                    if req.echo and run.index not in echoed:  # the choice's first chunk: its prompt
                        echoed.add(run.index)
                        choice, offsets[run.index] = _echo_choice(ctx, run, *prompts[run.index // req.n], as_ids)
                        yield sse({**base, "choices": [choice]})
                    lp = None
                    if d.logprobs and run.params.logprobs is not None:
                        lp = _completion_logprobs(ctx, [it.token_id for it in d.logprobs], d.logprobs,
                                                  run.params.logprobs or 0, offsets[run.index], as_ids)
                    offsets[run.index] += len(d.content)
                    if d.content or d.finish_reason or lp:
                        finish = _finish(run) if d.finish_reason else None
                        choice = {"index": run.index, "text": d.content, "logprobs": lp, "finish_reason": finish}
                        running = {"usage": _completion_usage(runs, prompts, req.n)} if continuous else {}
                        yield sse({**base, "choices": [choice], **running})
                    if d.finish_reason == "error":  # as on chat: say why, in band
                        yield in_band_error(run)
                if include_usage:
                    yield sse({**base, "choices": [], "usage": _completion_usage(runs, prompts, req.n)})
                yield "data: [DONE]\n\n"
            finally:
                for r in runs:
                    r.abort()

        return EventStream(events(), on_close=lambda: [r.abort() for r in runs])
    await until_disconnect(request, drain(runs))
    choices = []
    for run in runs:
        _check_structured(ctx, spec, run)
        prompt_text, prompt_ids = prompts[run.index // req.n]
        prefix = prompt_text if req.echo else ""
        lp = _choice_logprobs(ctx, run, prompt_ids, req.echo, as_ids, score_only)
        text = prefix + ("" if score_only else run.content)
        finish = "length" if score_only and run.finish_reason != "error" else _finish(run)
        choices.append({"index": run.index, "text": text, "logprobs": lp, "finish_reason": finish})
    return JSONResponse({**base, "choices": choices, "usage": _completion_usage(runs, prompts, req.n, score_only)})


def _completion_usage(runs: list[ChoiceRun], prompts: list[tuple[str, list[int]]], n: int,
                      score_only: bool = False) -> dict:
    """Usage of a completions request, streamed or not: each prompt counted once (its n choices
    read it once), cached tokens likewise from each prompt's first choice."""
    usage = usage_dict(runs)
    if score_only:
        usage["completion_tokens"] = 0
    usage["prompt_tokens"] = sum(len(ids) for _, ids in prompts)
    usage["prompt_tokens_details"]["cached_tokens"] = sum(r.cached_tokens for r in runs if r.index % n == 0)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return usage
