"""OpenAI endpoints through the official `openai` client against a running server."""

import json

import httpx
import pytest

WEATHER = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]


def _user(text):
    return [{"role": "user", "content": text}]


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["scripted"]


def test_chat_non_stream_with_reasoning(client):
    r = client.chat.completions.create(model="scripted", messages=_user("What is 17 * 23? Reply with only the number."))
    msg = r.choices[0].message
    assert msg.content == "391" and r.choices[0].finish_reason == "stop"
    assert "391" in msg.reasoning_content and "<think>" not in msg.content
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.completion_tokens_details.reasoning_tokens > 0


def test_enable_thinking_false(client):
    r = client.chat.completions.create(
        model="scripted", messages=_user("What is 17 * 23?"),
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert r.choices[0].message.content == "391"
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_chat_stream_matches_non_stream_and_usage(client):
    msgs = _user("Name three primary colors, comma separated.")
    whole = client.chat.completions.create(model="scripted", messages=msgs)
    chunks = list(client.chat.completions.create(model="scripted", messages=msgs, stream=True,
                                                 stream_options={"include_usage": True}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content == "Red, yellow, blue"
    assert reasoning == whole.choices[0].message.reasoning_content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_unicode_stream_has_no_replacement_chars(client):
    chunks = list(client.chat.completions.create(model="scripted", messages=_user("UNICODE"), stream=True))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "héllo wörld 世界 🚀 done"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_never_leak(client, stream):
    kwargs = dict(model="scripted", messages=_user("STOP_TEST"), stop=["<|END|>"])
    if stream:
        chunks = client.chat.completions.create(stream=True, **kwargs)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        r = client.chat.completions.create(**kwargs)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"
    assert text == "alpha beta "  # everything before the stop string, nothing of it


def test_max_tokens_and_length(client):
    r = client.chat.completions.create(model="scripted", messages=_user("Tell me a story"), max_completion_tokens=7)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 7


def test_n_choices(client):
    r = client.chat.completions.create(model="scripted", messages=_user("Name three primary colors"), n=3,
                                       temperature=0.7, seed=1)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.message.content == "Red, yellow, blue" for c in r.choices)
    one = client.chat.completions.create(model="scripted", messages=_user("Name three primary colors"))
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_logprobs(client):
    r = client.chat.completions.create(model="scripted", messages=_user("UNICODE"), logprobs=True, top_logprobs=3,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    items = r.choices[0].logprobs.content
    assert len(items) == r.usage.completion_tokens
    assert all(len(i.top_logprobs) == 3 and i.logprob <= 0 for i in items)
    raw = b"".join(bytes(i.bytes) for i in items[:-1])  # the last is the hidden end-of-turn token
    assert raw.decode() == "héllo wörld 世界 🚀 done"


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(client, stream):
    msgs = _user("What is the weather in Paris?")
    if stream:
        calls, finish = {}, None
        for c in client.chat.completions.create(model="scripted", messages=msgs, tools=WEATHER, stream=True):
            if not c.choices:
                continue
            for tc in c.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    entry.update(id=tc.id, name=tc.function.name)
                entry["arguments"] += tc.function.arguments or ""
            finish = c.choices[0].finish_reason or finish
        assert len(calls) == 1 and finish == "tool_calls"
        call = calls[0]
    else:
        r = client.chat.completions.create(model="scripted", messages=msgs, tools=WEATHER)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        tc = r.choices[0].message.tool_calls[0]
        call = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments}
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    follow = msgs + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function",
             "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"temp_c": 17})},
    ]
    r2 = client.chat.completions.create(model="scripted", messages=follow, tools=WEATHER)
    assert "17" in r2.choices[0].message.content and r2.choices[0].finish_reason == "stop"


def test_tool_choice_modes(client):
    msgs = _user("Name three primary colors")  # the script would not call a tool here
    forced = client.chat.completions.create(model="scripted", messages=_user("What is the weather in Paris?"),
                                            tools=WEATHER,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert forced.choices[0].message.tool_calls[0].function.name == "get_weather"
    required = client.chat.completions.create(model="scripted", messages=_user("What is the weather in Paris?"),
                                              tools=WEATHER, tool_choice="required")
    assert json.loads(required.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}
    none = client.chat.completions.create(model="scripted", messages=msgs, tools=WEATHER, tool_choice="none")
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


def test_thinking_budget_closes_reasoning(client):
    full = client.chat.completions.create(model="scripted", messages=_user("THINK_LONG"))
    cut = client.chat.completions.create(model="scripted", messages=_user("THINK_LONG"),
                                         extra_body={"thinking_budget": 8})
    assert full.usage.completion_tokens_details.reasoning_tokens > 50
    assert cut.usage.completion_tokens_details.reasoning_tokens <= 12
    assert cut.choices[0].message.content == "Done thinking." == full.choices[0].message.content
    assert len(cut.choices[0].message.reasoning_content) < len(full.choices[0].message.reasoning_content)


def test_response_format_json_schema(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    r = client.chat.completions.create(model="scripted", messages=_user("Answer in json"),
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "a", "schema": schema}},
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert json.loads(r.choices[0].message.content)["answer"] == "Paris"


def test_completions(client):
    r = client.completions.create(model="scripted", prompt="Tell me a story", max_tokens=6, logprobs=2, echo=True)
    assert r.choices[0].text.startswith("Tell me a story") and r.choices[0].finish_reason == "length"
    # echo: the prompt's tokens come first (OpenAI legacy completions), the first with a null logprob
    assert r.usage.completion_tokens == 6 and len(r.choices[0].logprobs.tokens) == r.usage.prompt_tokens + 6
    assert r.choices[0].logprobs.token_logprobs[0] is None
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="scripted", prompt="Tell me a story", max_tokens=6, stream=True) if c.choices)
    assert r.choices[0].text == "Tell me a story" + streamed
    batch = client.completions.create(model="scripted", prompt=["Tell me a story", "hello"], max_tokens=3)
    assert [c.index for c in batch.choices] == [0, 1]


def test_tokenize_detokenize(server):
    t = httpx.post(server.url + "/tokenize", json={"model": "scripted", "prompt": "hello world"}).json()
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 4096
    d = httpx.post(server.url + "/detokenize", json={"model": "scripted", "tokens": t["tokens"]}).json()
    assert d["prompt"] == "hello world"
    chat = httpx.post(server.url + "/tokenize", json={"messages": _user("hi")}).json()
    assert chat["count"] > 3


def test_responses_text_and_stream(client):
    r = client.responses.create(model="scripted", input="What is 17 * 23?")
    assert r.output_text == "391" and r.usage.output_tokens > 0
    assert r.output[0].type == "reasoning"
    events = list(client.responses.create(model="scripted", input="What is 17 * 23?", stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "391" and events[-1].response.output_text == "391"
    assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.parametrize("prompt, cut_kind", [("THINK_LONG", "reasoning"), ("UNICODE", "message")])
def test_responses_item_cut_by_max_output_tokens_is_incomplete(client, prompt, cut_kind):
    """The item being written when max_output_tokens ends the run says so, in both shapes alike;
    a run cut in its reasoning has no message item."""
    budget = 8 if cut_kind == "reasoning" else 5
    r = client.responses.create(model="scripted", input=prompt, max_output_tokens=budget)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[-1].type == cut_kind and r.output[-1].status == "incomplete"
    assert all(o.status == "completed" for o in r.output[:-1])
    events = list(client.responses.create(model="scripted", input=prompt, max_output_tokens=budget, stream=True))
    assert events[-1].type == "response.incomplete"
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(o.type, o.status) for o in done] == [(o.type, o.status) for o in r.output]
    assert [(o.type, o.status) for o in events[-1].response.output] == [(o.type, o.status) for o in r.output]


def test_responses_tool_round_trip(client):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER[0]["function"]["parameters"]}]
    r = client.responses.create(model="scripted", input="What is the weather in Paris?", tools=tools)
    call = next(o for o in r.output if o.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    events = list(client.responses.create(model="scripted", input="What is the weather in Paris?", tools=tools,
                                          stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}
    r2 = client.responses.create(model="scripted", tools=tools, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 17}'},
    ])
    assert "17" in r2.output_text


def test_health_stats_metrics(server, client):
    client.chat.completions.create(model="scripted", messages=_user("hello"))
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    stats = httpx.get(server.url + "/stats").json()
    assert stats["engine"]["finished"] >= 1 and stats["server"]["generation_tokens"] > 0
    metrics = httpx.get(server.url + "/metrics").text
    for name in ("tiermoe_time_to_first_token_seconds_bucket", "tiermoe_inter_token_latency_seconds_bucket",
                 "tiermoe_requests_total", "tiermoe_generation_tokens_total", "tiermoe_kv_cache_usage_ratio",
                 "tiermoe_requests_waiting"):
        assert name in metrics


def test_stream_n_choices_interleave(client):
    chunks = list(client.chat.completions.create(model="scripted", messages=_user("Name three primary colors"), n=2,
                                                 stream=True,
                                                 extra_body={"chat_template_kwargs": {"enable_thinking": False}}))
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == {0: "Red, yellow, blue", 1: "Red, yellow, blue"}


def test_glm_tool_format_round_trip(tokenizer):
    import openai

    from server_harness import start_server

    with start_server(tokenizer, core_kwargs={"tool_format": "glm"}) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        calls = {}
        for ch in c.chat.completions.create(model="scripted", messages=_user("What is the weather in Paris?"),
                                            tools=WEATHER, stream=True):
            for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
                entry = calls.setdefault(tc.index, {"name": None, "arguments": ""})
                entry["name"] = tc.function.name or entry["name"]
                entry["arguments"] += tc.function.arguments or ""
        assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Paris"}
        r = c.chat.completions.create(model="scripted", messages=_user("What is the weather in Paris?"), tools=WEATHER,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert r.choices[0].message.tool_calls[0].function.arguments == '{"city": "Paris"}'


def test_cors_off_by_default(server):
    preflight = {"Origin": "http://evil.example", "Access-Control-Request-Method": "GET"}
    r = httpx.options(server.url + "/v1/models", headers=preflight)
    assert "access-control-allow-origin" not in r.headers


def test_named_tool_choice_streams_the_forced_call(client):
    calls = {}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for ch in client.chat.completions.create(model="scripted", messages=_user("What is the weather in Paris?"),
                                             tools=WEATHER, tool_choice=named, stream=True):
        for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                entry.update(id=tc.id, name=tc.function.name)
            entry["arguments"] += tc.function.arguments or ""
    assert calls[0]["id"] and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
