"""POST /v1/messages and /v1/messages/count_tokens (Anthropic Messages API).

Anthropic blocks are mapped onto the same chat-template inputs as OpenAI messages: tool_use
blocks become assistant tool_calls, tool_result blocks become tool messages, `thinking`
controls enable_thinking and the thinking budget. Errors on these paths use Anthropic's
error body (errors.py chooses the shape by path).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tiermoe.protocol import GRAMMAR_ERROR
from tiermoe.server.anthropic_protocol import CountTokensRequest, MessagesRequest, check_tools, output_spec
from tiermoe.server.chat import constraint_schemas, plan_tools
from tiermoe.server.context import ServerContext
from tiermoe.server.errors import bad_request
from tiermoe.server.generation import ChoiceRun
from tiermoe.server.handling import parse_body, run_endpoint
from tiermoe.server.limits import check_stop_strings
from tiermoe.server.streaming import EventStream, drain, merged, sse, until_disconnect


def register(app) -> None:
    @app.post("/v1/messages")
    async def messages(request: Request):
        return await run_endpoint(request, create_message)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        return await run_endpoint(request, count)


def _block_text(block, param: str) -> str:
    if block.type == "text" and isinstance(block.text, str):
        return block.text
    if block.type == "text":  # not "type 'text' is not supported": the block lacks its text
        raise bad_request("a text block needs a string 'text'", param=f"{param}.text")
    raise bad_request(f"content block of type {block.type!r} is not supported here (text only)", param=param)


def _tool_result_text(block, param: str) -> str:
    content = (block.model_extra or {}).get("content", "")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise bad_request("tool_result content must be text", param=f"{param}.content[{j}]")
        return "".join(parts)
    raise bad_request("tool_result content must be a string or text blocks", param=f"{param}.content")


def _append_turn(out: list[dict], msg: dict) -> None:
    """Append a user or assistant turn; one after a turn of the same role is folded into it.

    The Anthropic API combines consecutive user or assistant messages into one turn, so clients send
    them (a reminder beside a question, tool results then a follow-up). Rendered as separate turns they
    would be a conversation the client did not send, and a template that insists on alternating roles
    would refuse it. Folded, they read as one message holding both block lists (text joined as a
    message's blocks are, tool calls kept in order)."""
    last = out[-1] if out else None
    if last is None or last["role"] != msg["role"]:
        out.append(msg)
        return
    last["content"] += msg["content"]
    if msg.get("tool_calls"):
        last["tool_calls"] = last.get("tool_calls", []) + msg["tool_calls"]


def to_chat(req) -> tuple[list[dict], list[dict], object]:
    """Anthropic request -> (OpenAI-style messages, function definitions, tool_choice)."""
    if not req.messages:
        raise bad_request("messages must contain at least one message", param="messages")
    out: list[dict] = []
    if req.system is not None:
        if isinstance(req.system, str):
            system = req.system
        else:
            system = "".join(_block_text(b, f"system[{i}]") for i, b in enumerate(req.system))
        if system:
            out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        if not m.content and not (m.role == "assistant" and i == len(req.messages) - 1):
            # Anthropic's rule: an empty turn says nothing and would be dropped or rendered as a turn the
            # client did not write; only a final empty assistant message has a meaning (a new turn)
            raise bad_request("all messages must have non-empty content except for the optional final "
                              "assistant message", param=f"messages[{i}].content")
        if isinstance(m.content, str):
            _append_turn(out, {"role": m.role, "content": m.content})
            continue
        texts, calls = [], []
        for j, block in enumerate(m.content):
            param = f"messages[{i}].content[{j}]"
            extra = block.model_extra or {}
            if block.type == "tool_result" and m.role == "user":
                tool_use_id = extra.get("tool_use_id")
                if tool_use_id is not None and not isinstance(tool_use_id, str):
                    raise bad_request("tool_result tool_use_id must be a string", param=f"{param}.tool_use_id")
                out.append({"role": "tool", "tool_call_id": tool_use_id, "content": _tool_result_text(block, param)})
            elif block.type == "tool_use" and m.role == "assistant":
                if not isinstance(extra.get("name"), str) or not isinstance(extra.get("input", {}), dict) \
                        or not isinstance(extra.get("id", ""), (str, type(None))):
                    raise bad_request("tool_use needs a name, an input object and a string id", param=param)
                calls.append({"id": extra.get("id") or f"toolu_{i}_{j}", "type": "function",
                              "function": {"name": extra["name"], "arguments": extra.get("input", {})}})
            elif block.type in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # earlier reasoning is not replayed into the prompt
            else:
                texts.append(_block_text(block, param))
        if texts or calls:
            msg: dict = {"role": m.role, "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            _append_turn(out, msg)
    check_tools(req.tools)
    functions = [{"name": t.name, "description": t.description or "", "parameters": t.input_schema}
                 for t in req.tools or []]
    choice = None
    if req.tool_choice is not None:
        tc = req.tool_choice
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(tc.type)
        if tc.type == "tool":
            if not tc.name:
                raise bad_request("tool_choice of type 'tool' needs a name", param="tool_choice.name")
            choice = {"name": tc.name}
    return out, functions, choice


def _template_kwargs(req) -> tuple[dict, int | None]:
    thinking = req.thinking
    if thinking is None:
        return {}, None
    if thinking.type == "disabled":
        return {"enable_thinking": False}, None
    return {"enable_thinking": True}, thinking.budget_tokens


def _prefill(req, messages: list[dict]) -> str | None:
    """The text of a final assistant message the answer must continue (Anthropic's prefill), or None.

    The message stays last in `messages`, to be rendered open (continue_final_message). An empty
    one is dropped (a plain new turn), one holding tool_use blocks is a finished turn and is
    rendered as such. Trailing whitespace is refused as Anthropic refuses it: the model would
    continue after a space it would otherwise have written itself, within its next token."""
    if req.messages[-1].role != "assistant" or not messages or messages[-1]["role"] != "assistant" \
            or messages[-1].get("tool_calls"):
        return None
    text = messages[-1]["content"]
    if not text:
        messages.pop()
        return None
    if text != text.rstrip():
        raise bad_request("final assistant content cannot end with trailing whitespace",
                          param=f"messages[{len(req.messages) - 1}].content")
    return text


async def _prompt(ctx: ServerContext, req) -> tuple[str, list[int], object, dict | None, bool]:
    """(prompt text, its ids, the tool plan, the structured-output spec, whether it continues a prefill)."""
    messages, functions, choice = to_chat(req)
    plan = plan_tools(functions, choice, can_parse=True)
    spec, format_param = output_spec(req)
    schemas = constraint_schemas(plan, spec, format_param, f"{format_param}.schema")  # its 400s first
    kwargs, _ = _template_kwargs(req)
    prefill = _prefill(req, messages)  # its own 400s, too, come before the schemas' compile below
    if prefill is not None and plan.force:
        raise bad_request("an assistant prefill cannot be combined with tool_choice 'any' or 'tool' "
                          "(a forced tool call is itself written into the assistant turn)", param="messages")
    if prefill is not None and spec is not None:
        raise bad_request(f"an assistant prefill cannot be combined with {format_param} "
                          "(the answer must be the schema's JSON from its first character)", param="messages")
    # a forced call (tool_choice any / tool) is generated under its schema's grammar: one the engine cannot
    # compile is a 400 now, as on the OpenAI routes, not an unconstrained run with made-up arguments
    await ctx.check_schemas(schemas)
    if req.tool_choice is not None and req.tool_choice.disable_parallel_tool_use:
        plan.max_calls = 1
    if prefill is None:
        text = await ctx.render_chat(messages, plan.template_tools, kwargs) + ctx.forced_text(plan)
        return text, await ctx.encode(text), plan, spec, False
    text = await ctx.render_chat(messages, plan.template_tools, {**kwargs, "continue_final_message": True},
                                 add_generation_prompt=False)
    return text, await ctx.encode(text), plan, None, True


async def count(request: Request, ctx: ServerContext) -> Response:
    req = await parse_body(request, CountTokensRequest)
    ctx.check_model(req.model)
    _, ids, *_ = await _prompt(ctx, req)
    return JSONResponse({"input_tokens": len(ids)})


def _stop_reason(run: ChoiceRun) -> str:
    if run.finish_reason == "tool_calls":
        return "tool_use"
    if run.finish_reason == "length":
        return "max_tokens"
    if run.stop_matched is not None:
        return "stop_sequence"
    return "end_turn"


def _usage(run: ChoiceRun) -> dict:
    return {"input_tokens": run.prompt_tokens - run.cached_tokens, "output_tokens": run.completion_tokens,
            "cache_read_input_tokens": run.cached_tokens, "cache_creation_input_tokens": 0}


async def create_message(request: Request, ctx: ServerContext) -> Response:
    req: MessagesRequest = await parse_body(request, MessagesRequest)
    ctx.check_model(req.model)
    if req.max_tokens < 1:
        raise bad_request("max_tokens must be at least 1", param="max_tokens")
    stops = check_stop_strings(req.stop_sequences, "stop_sequences")
    ctx.admit(1)
    text, ids, plan, spec, prefilled = await _prompt(ctx, req)
    max_tokens = ctx.check_context(len(ids), req.max_tokens, "messages", "max_tokens")
    _, budget = _template_kwargs(req)
    params = ctx.sampling_params(max_tokens=max_tokens, structured=spec, max_temperature=1,
                                 temperature=req.temperature, top_p=req.top_p, top_k=req.top_k)
    mid = ctx.new_id("msg_")
    # a prefill is answer text: what follows it is answer too, never a think block to split off
    run = ctx.make_run(mid, text, ids, params, stop=stops, plan=plan, thinking_budget=budget,
                       reasoning=not prefilled, id_prefix="toolu_", endpoint="messages")
    await ctx.start_runs([run])
    if req.stream:
        return EventStream(_stream(ctx, mid, run), on_close=run.abort)
    await until_disconnect(request, drain([run]))
    if spec is not None and run.finish_reason != "length":
        ctx.outputs.submit(spec, run.content, run.request_id)  # the format re-check (a metric)
    content: list[dict] = []
    if run.reasoning_text:
        content.append({"type": "thinking", "thinking": run.reasoning_text, "signature": ""})
    if run.content:
        content.append({"type": "text", "text": run.content})
    for call in run.tools.calls if run.tools else []:
        content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments_dict()})
    body = {"id": mid, "type": "message", "role": "assistant", "model": ctx.model_name, "content": content,
            "stop_reason": _stop_reason(run), "stop_sequence": run.stop_matched, "usage": _usage(run)}
    return JSONResponse(body)


async def _stream(ctx: ServerContext, mid: str, run: ChoiceRun):
    """Anthropic SSE: message_start, content blocks (thinking / text / tool_use), message_delta,
    message_stop; or, on a failure after the headers went out, an `error` event that ends it."""
    state = {"index": -1, "kind": None, "tool": None}

    def open_block(kind: str, block: dict) -> str:
        events = close_block()
        state["index"] += 1
        state["kind"] = kind
        start = {"type": "content_block_start", "index": state["index"], "content_block": block}
        return events + sse(start, "content_block_start")

    def close_block() -> str:
        if state["kind"] is None:
            return ""
        events = ""
        if state["kind"] == "thinking":
            events += sse({"type": "content_block_delta", "index": state["index"],
                           "delta": {"type": "signature_delta", "signature": ""}}, "content_block_delta")
        state["kind"] = None
        state["tool"] = None
        return events + sse({"type": "content_block_stop", "index": state["index"]}, "content_block_stop")

    def delta(payload: dict) -> str:
        return sse({"type": "content_block_delta", "index": state["index"], "delta": payload}, "content_block_delta")

    def message_start() -> str:
        # sent with the first output, once the engine has said how much of the prompt it read
        # from cache: the usage here then means what the final message_delta's does
        state["started"] = True
        usage = {**_usage(run), "output_tokens": 0}
        start = {"id": mid, "type": "message", "role": "assistant", "model": ctx.model_name, "content": [],
                 "stop_reason": None, "stop_sequence": None, "usage": usage}
        return sse({"type": "message_start", "message": start}, "message_start")

    state["started"] = False
    try:
        async for _, d in merged([run]):
            out = "" if state["started"] else message_start()
            if d.reasoning:
                if state["kind"] != "thinking":
                    out += open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out += delta({"type": "thinking_delta", "thinking": d.reasoning})
            if d.content:
                if state["kind"] != "text":
                    out += open_block("text", {"type": "text", "text": ""})
                out += delta({"type": "text_delta", "text": d.content})
            for tc in d.tool_calls:
                if tc.id is not None:
                    out += open_block("tool_use", {"type": "tool_use", "id": tc.id, "name": tc.name, "input": {}})
                    state["tool"] = tc.index
                if tc.arguments and state["tool"] == tc.index:
                    out += delta({"type": "input_json_delta", "partial_json": tc.arguments})
            if d.finish_reason:
                out += close_block()
                if d.finish_reason == "error":
                    # an error event ends an Anthropic stream: no message_delta / message_stop after it
                    kind = "invalid_request_error" if run.error_code == GRAMMAR_ERROR else "api_error"
                    error = {"type": kind, "message": run.error or "engine error"}
                    yield out + sse({"type": "error", "error": error}, "error")
                    return
            if out:
                yield out
        usage = _usage(run)
        stop = {"stop_reason": _stop_reason(run), "stop_sequence": run.stop_matched}
        yield ("" if state["started"] else message_start()) + sse(
            {"type": "message_delta", "delta": stop,
             "usage": {"output_tokens": usage["output_tokens"], "input_tokens": usage["input_tokens"],
                       "cache_read_input_tokens": usage["cache_read_input_tokens"],
                       "cache_creation_input_tokens": 0}}, "message_delta")
        yield sse({"type": "message_stop"}, "message_stop")
    finally:
        run.abort()

