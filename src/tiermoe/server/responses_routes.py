"""POST /v1/responses (OpenAI Responses API: text, reasoning, function tools; stateless).

Input items map onto chat messages: message items by role, function_call items onto the
assistant's tool_calls, function_call_output items onto tool messages. Output is a list of
items (reasoning, message, function_call); streaming emits the documented event sequence
(response.created ... response.completed) with a running sequence_number.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tiermoe.server.chat import constraint_schemas, plan_tools, text_content
from tiermoe.server.context import ServerContext
from tiermoe.server.errors import bad_request
from tiermoe.server.generation import ChoiceRun
from tiermoe.server.handling import parse_body, run_endpoint
from tiermoe.server.protocol import ResponsesRequest
from tiermoe.server.streaming import EventStream, drain, merged, sse, until_disconnect
from tiermoe.server.limits import loads
from tiermoe.server.structured import structured_spec
from tiermoe.server.text_buffer import TextBuffer


def register(app) -> None:
    @app.post("/v1/responses")
    async def responses(request: Request):
        return await run_endpoint(request, create_response)


def to_chat(req: ResponsesRequest) -> list[dict]:
    messages: list[dict] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        return messages
    if not req.input:
        raise bad_request("input must not be empty", param="input")
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        param = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"invalid role {role!r}", param=f"{param}.role")
            content = item.get("content")
            if not isinstance(content, (str, list)):
                raise bad_request("message content must be a string or a list of parts", param=f"{param}.content")
            for part in content if isinstance(content, list) else []:
                if not isinstance(part, dict):
                    raise bad_request("content parts must be objects", param=f"{param}.content")
            text = text_content(content, f"{param}.content", assistant=role == "assistant")
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            name, args = item.get("name"), item.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(args, str):
                raise bad_request("function_call needs a name and arguments string", param=param)
            call_id = _optional_str(item, "call_id", param) or f"call_{i}"
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": _args(args, param)}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            elif messages and messages[-1]["role"] == "assistant":
                messages[-1]["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = text_content(output, f"{param}.output") if isinstance(output, list) else None
            if output is None:
                raise bad_request("function_call_output needs an output string", param=f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": _optional_str(item, "call_id", param), "content": output})
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(f"input item type {kind!r} is not supported", param=f"{param}.type")
    return messages


def _optional_str(item: dict, key: str, param: str) -> str | None:
    value = item.get(key)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"{key} must be a string", param=f"{param}.{key}")
    return value


def _args(text: str, param: str) -> dict:
    try:
        value = loads(text or "{}")
    except ValueError:
        raise bad_request("function_call arguments must be a JSON object", param=f"{param}.arguments") from None
    if not isinstance(value, dict):
        raise bad_request("function_call arguments must be a JSON object", param=f"{param}.arguments")
    return value


def _tool_choice(choice):
    if choice is None or isinstance(choice, str):
        if choice not in (None, "auto", "none", "required"):
            raise bad_request(f"invalid tool_choice {choice!r}", param="tool_choice")
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"name": choice["name"]}
    raise bad_request("tool_choice must be auto, none, required or {type: function, name}", param="tool_choice")


def _response(ctx: ServerContext, rid: str, created: int, req: ResponsesRequest, run: ChoiceRun | None,
              output: list, status: str) -> dict:
    usage = None
    incomplete = None
    if run is not None and status != "in_progress":
        usage = {
            "input_tokens": run.prompt_tokens, "input_tokens_details": {"cached_tokens": run.cached_tokens},
            "output_tokens": run.completion_tokens, "output_tokens_details": {"reasoning_tokens": run.reasoning_tokens},
            "total_tokens": run.prompt_tokens + run.completion_tokens,
        }
        if run.finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "model": ctx.model_name,
        "output": output, "usage": usage, "incomplete_details": incomplete, "error": None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        "temperature": req.temperature, "top_p": req.top_p, "tool_choice": req.tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []], "text": _text_config(req),
        "reasoning": req.reasoning.model_dump(exclude_none=True) if req.reasoning else None,
        "truncation": "disabled", "store": False, "previous_response_id": None,
    }


def _text_config(req: ResponsesRequest) -> dict:
    """The request's text configuration as the response echoes it (the OpenAI API does): the format
    asked for (plain text when none) and any other keys given, such as verbosity."""
    text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text else {}
    return {**text, "format": text.get("format") or {"type": "text"}}


def _items(ctx: ServerContext, run: ChoiceRun) -> list[dict]:
    """The output items of a finished run, as the stream's `response.output_item.done` events give
    them: the item being written when max_output_tokens cut the run is "incomplete", and a run cut
    in its reasoning has no message item (the stream never opened one)."""
    items: list[dict] = []
    if run.reasoning_text:
        items.append({"type": "reasoning", "id": ctx.new_id("rs_"), "summary": [],
                      "content": [{"type": "reasoning_text", "text": run.reasoning_text}], "status": "completed"})
    calls = run.tools.calls if run.tools else []
    if run.content or not (calls or items):
        items.append(_message_item(ctx.new_id("msg_"), run.content, "completed"))
    for call in calls:
        items.append({"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
                      "name": call.name, "arguments": call.arguments, "status": "completed"})
    if run.finish_reason == "length" and items:
        items[-1]["status"] = "incomplete"
    return items


def _message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


async def create_response(request: Request, ctx: ServerContext) -> Response:
    req: ResponsesRequest = await parse_body(request, ResponsesRequest)
    ctx.check_model(req.model)
    if req.previous_response_id:
        raise bad_request("previous_response_id is not supported: this server stores no responses; send the full input",
                          param="previous_response_id")
    if req.background:  # answered at once instead, a client would poll GET /v1/responses/{id}, which does not exist
        raise bad_request("background mode is not supported: this server stores no responses to poll; "
                          "send the request without it (or stream it)", param="background")
    functions = []
    for i, tool in enumerate(req.tools or []):
        if tool.type != "function" or not tool.name:
            raise bad_request(f"tool type {tool.type!r} is not supported (function tools only)",
                              param=f"tools[{i}].type")
        parameters = tool.parameters or {"type": "object", "properties": {}}
        functions.append({"name": tool.name, "description": tool.description or "", "parameters": parameters})
    plan = plan_tools(functions, _tool_choice(req.tool_choice), can_parse=True)
    if req.parallel_tool_calls is False:
        plan.max_calls = 1
    fmt = req.text.format if req.text and req.text.format else None
    spec = structured_spec(fmt.type, fmt.schema_, "text.format", "text.format.schema") if fmt else None
    await ctx.check_schemas(constraint_schemas(plan, spec, "text.format", "text.format.schema"))
    kwargs = {}
    if req.reasoning and req.reasoning.effort in ("none", "minimal"):
        kwargs["enable_thinking"] = False
    ctx.admit(1)
    text = await ctx.render_chat(to_chat(req), plan.template_tools, kwargs) + ctx.forced_text(plan)
    ids = await ctx.encode(text)
    max_tokens = ctx.check_context(len(ids), req.max_output_tokens, "input", "max_output_tokens")
    params = ctx.sampling_params(max_tokens=max_tokens, structured=spec, temperature=req.temperature, top_p=req.top_p)
    rid = ctx.new_id("resp_")
    run = ctx.make_run(rid, text, ids, params, plan=plan, endpoint="responses")
    await ctx.start_runs([run])
    created = int(time.time())
    if req.stream:
        return EventStream(_stream(ctx, rid, created, req, run), on_close=run.abort)
    await until_disconnect(request, drain([run]))
    return JSONResponse(_response(ctx, rid, created, req, run, _items(ctx, run), "completed"))


async def _stream(ctx: ServerContext, rid: str, created: int, req: ResponsesRequest, run: ChoiceRun):
    seq = 0
    output: list[dict] = []
    # the item being written; its text kept as pieces (text_buffer.py: appends to a dict entry copy it whole)
    cur: dict = {"kind": None, "item": None, "text": TextBuffer(), "tool": None}

    def ev(kind: str, **fields) -> str:
        nonlocal seq
        seq += 1
        return sse({"type": kind, "sequence_number": seq - 1, **fields}, kind)

    def close(status: str = "completed") -> str:
        item, kind = cur["item"], cur["kind"]
        if item is None:
            return ""
        idx = len(output)
        out = ""
        text = cur["text"].value
        if kind == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            out += ev("response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0,
                      text=text)
        elif kind == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            out += ev("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                      text=text, logprobs=[])
            out += ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0, part=part)
        elif kind == "function_call":
            item["arguments"] = text
            out += ev("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                      arguments=text, name=item["name"])
        item["status"] = status  # "incomplete": max_output_tokens cut it
        out += ev("response.output_item.done", output_index=idx, item=item)
        output.append(item)
        cur.update(kind=None, item=None, text=TextBuffer(), tool=None)
        return out

    def open_item(kind: str, item: dict) -> str:
        out = close()
        cur.update(kind=kind, item=item, text=TextBuffer())
        idx = len(output)
        out += ev("response.output_item.added", output_index=idx, item=dict(item))
        if kind == "message":
            out += ev("response.content_part.added", item_id=item["id"], output_index=idx, content_index=0,
                      part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        return out

    try:
        yield ev("response.created", response=_response(ctx, rid, created, req, run, [], "in_progress"))
        yield ev("response.in_progress", response=_response(ctx, rid, created, req, run, [], "in_progress"))
        async for _, d in merged([run]):
            out = ""
            if d.reasoning:
                if cur["kind"] != "reasoning":
                    reasoning = {"type": "reasoning", "id": ctx.new_id("rs_"), "summary": [], "status": "in_progress"}
                    out += open_item("reasoning", reasoning)
                cur["text"].append(d.reasoning)
                out += ev("response.reasoning_text.delta", item_id=cur["item"]["id"], output_index=len(output),
                          content_index=0, delta=d.reasoning)
            if d.content:
                if cur["kind"] != "message":
                    out += open_item("message", _message_item(ctx.new_id("msg_"), None, "in_progress"))
                cur["text"].append(d.content)
                out += ev("response.output_text.delta", item_id=cur["item"]["id"], output_index=len(output),
                          content_index=0, delta=d.content, logprobs=[])
            for tc in d.tool_calls:
                if tc.id is not None:
                    call = {"type": "function_call", "id": "fc_" + tc.id.removeprefix("call_"), "call_id": tc.id,
                            "name": tc.name, "arguments": "", "status": "in_progress"}
                    out += open_item("function_call", call)
                    cur["tool"] = tc.index
                if tc.arguments and cur["tool"] == tc.index:
                    cur["text"].append(tc.arguments)
                    out += ev("response.function_call_arguments.delta", item_id=cur["item"]["id"],
                              output_index=len(output), delta=tc.arguments)
            if d.finish_reason:
                out += close("incomplete" if d.finish_reason == "length" else "completed")
            if out:
                yield out
        if run.finish_reason == "error":
            error = {"code": run.error_code or "server_error", "message": run.error or "engine error"}
            yield ev("response.failed", response={**_response(ctx, rid, created, req, run, output, "failed"),
                                                  "error": error})
        else:
            final = _response(ctx, rid, created, req, run, output, "completed")
            yield ev("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)
    finally:
        run.abort()
