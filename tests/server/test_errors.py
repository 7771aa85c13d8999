"""Every bad request is a 4xx with the OpenAI error body (never a 500), plus auth/limits/faults."""

import threading

import httpx
import openai
import pytest

from server_harness import start_server

MSG = [{"role": "user", "content": "hi"}]


def _body_ok(body, status_code):
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def _raises(exc_type, fn, **kwargs):
    with pytest.raises(exc_type) as e:
        fn(**kwargs)
    return _body_ok(e.value.body if "error" in (e.value.body or {}) else {"error": e.value.body}, e.value.status_code)


def _bad_chat(client, **kwargs):
    """A chat completion the server must refuse with a 400 in OpenAI's error shape."""
    return _raises(openai.BadRequestError, client.chat.completions.create, model="scripted", **kwargs)


def test_malformed_json_and_non_objects(server):
    for raw in (b"{bad json", b"", b"[1, 2]", b'"text"'):
        r = httpx.post(server.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, raw
        _body_ok(r.json(), 400)


def test_wrong_types(client):
    err = _bad_chat(client, messages=MSG, max_tokens="ten")
    assert err["param"] == "max_tokens"
    err = _bad_chat(client, messages=[{"role": "robot", "content": "x"}])
    assert err["param"].startswith("messages")
    _bad_chat(client, messages=MSG, stop=5)


def test_unknown_model_is_404(client):
    err = _raises(openai.NotFoundError, client.chat.completions.create, model="gpt-17", messages=MSG)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    _raises(openai.NotFoundError, client.completions.create, model="gpt-17", prompt="x")
    _raises(openai.NotFoundError, client.responses.create, model="gpt-17", input="x")


def test_context_limits(client):
    long = "word " * 5000
    err = _bad_chat(client, messages=[{"role": "user", "content": long}])
    assert err["code"] == "context_length_exceeded"
    err = _bad_chat(client, messages=MSG, max_tokens=5000)
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
    _raises(openai.BadRequestError, client.completions.create, model="scripted", prompt="x", max_tokens=10**6)


@pytest.mark.parametrize("field,value", [
    ("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("min_p", 2), ("presence_penalty", 3), ("frequency_penalty", -9),
    ("repetition_penalty", 0), ("top_k", -5), ("n", 0), ("max_tokens", 0), ("max_tokens", -3),
    ("logit_bias", {"5": 101}), ("logit_bias", {"five": 1}), ("logit_bias", {"99999999": 1}), ("logit_bias", {"-1": 1}),
])
def test_invalid_sampling_values(client, field, value):
    err = _bad_chat(client, messages=MSG, extra_body={field: value})
    assert err["param"] == field


def test_invalid_logprobs(client):
    _bad_chat(client, messages=MSG, logprobs=True, top_logprobs=50)
    _bad_chat(client, messages=MSG, top_logprobs=2)


@pytest.mark.parametrize("tool", [
    {"type": "function", "function": {"name": "bad name!", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}},
    {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}},
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "city"}}},
    {"type": "retrieval"},
])
def test_invalid_tool_schema(client, tool):
    err = _bad_chat(client, messages=MSG, tools=[tool])
    assert err["param"].startswith("tools")


def test_tool_choice_errors(client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    _bad_chat(client, messages=MSG, tools=tools,
            tool_choice={"type": "function", "function": {"name": "g"}})
    _bad_chat(client, messages=MSG, tool_choice="required")


def test_empty_or_unsupported_messages(client):
    err = _bad_chat(client, messages=[])
    assert err["param"] == "messages"
    # a system message alone is valid (OpenAI and vLLM answer it): test_valid_requests.py
    _raises(openai.BadRequestError, client.chat.completions.create, model="scripted",
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    _raises(openai.BadRequestError, client.responses.create, model="scripted", input=[])


def test_invalid_response_format(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "banana"}}}
    err = _bad_chat(client, messages=MSG, response_format=bad)
    assert "schema" in err["message"]


def test_a_chat_template_in_chat_template_kwargs_is_refused(server, client):
    """chat_template_kwargs reach apply_chat_template as keywords, so a `chat_template` there would
    replace the model's template with the client's Jinja: a few nested loops over range(100000) or
    a string repeated 10**10 times hold the one tokenizer thread (every request waits behind it)
    or exhaust memory. It is a 400 on every route that renders chat_template_kwargs."""
    hostile = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    err = _bad_chat(client, messages=MSG, extra_body={"chat_template_kwargs": {"chat_template": hostile}})
    assert err["param"] == "chat_template_kwargs.chat_template"
    r = httpx.post(server.url + "/tokenize", json={"messages": MSG, "chat_template_kwargs": {"chat_template": hostile}},
                   timeout=10)
    assert r.status_code == 400 and _body_ok(r.json(), 400)["param"] == "chat_template_kwargs.chat_template"
    ok = client.chat.completions.create(model="scripted", messages=MSG, max_tokens=4,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert ok.choices[0].message.content is not None


def test_unknown_route_and_method(server):
    r = httpx.post(server.url + "/v1/nothing", json={})
    assert r.status_code == 404 and _body_ok(r.json(), 404)
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and _body_ok(r.json(), 405)


def test_api_key(tokenizer):
    with start_server(tokenizer, api_key="s3cret") as s:
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.body["type"] == "authentication_error"
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.models.list().data[0].id == "scripted"
        assert httpx.post(s.url + "/v1/chat/completions", json={}).status_code == 401
        assert httpx.get(s.url + "/health").status_code == 200  # health stays open for probes
        import anthropic

        a = anthropic.Anthropic(base_url=s.url, api_key="s3cret", max_retries=0)
        assert a.messages.count_tokens(model="scripted", messages=MSG).input_tokens > 0
        with pytest.raises(anthropic.AuthenticationError):
            refused = anthropic.Anthropic(base_url=s.url, api_key="nope", max_retries=0)
            refused.messages.count_tokens(model="scripted", messages=MSG)


def test_body_too_large(tokenizer):
    with start_server(tokenizer, max_body_bytes=4096) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:
            c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "x" * 10000}])
        assert e.value.status_code == 413
        chunked = httpx.post(s.url + "/v1/chat/completions", content=iter([b"{" + b" " * 5000 + b"}"]))
        assert chunked.status_code == 413


def test_queue_full_gives_429_with_retry_after(tokenizer):
    with start_server(tokenizer, core_kwargs={"max_num_seqs": 1, "step_delay_s": 0.02}, max_queue=0) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        stream = c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "Tell me a story"}],
                                           max_tokens=200, stream=True)
        next(iter(stream))  # the only slot is taken
        with pytest.raises(openai.RateLimitError) as e:
            c.chat.completions.create(model="scripted", messages=MSG)
        assert e.value.response.headers["retry-after"] == "1"
        assert e.value.body["code"] == "queue_full"
        stream.close()


def test_engine_fault_fails_only_its_request(server, client):
    results = {}

    def other():
        messages = [{"role": "user", "content": "Tell me a story"}]
        results["other"] = client.chat.completions.create(model="scripted", messages=messages, max_tokens=40)

    t = threading.Thread(target=other)
    t.start()
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "TRIGGER_FAULT"}])
    assert "scripted fault" in e.value.body["message"] and e.value.body["code"] == "engine_error"
    chunks, fault = [], [{"role": "user", "content": "TRIGGER_FAULT"}]
    with pytest.raises(openai.APIError, match="scripted fault"):  # the client raises on the in-stream error event
        for c in client.chat.completions.create(model="scripted", messages=fault, stream=True):
            chunks.append(c)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["error"]
    t.join()
    assert results["other"].choices[0].finish_reason == "length"
    assert client.chat.completions.create(model="scripted", messages=MSG).choices[0].finish_reason == "stop"


def test_unexpected_exception_becomes_clean_500(tokenizer):
    with start_server(tokenizer) as s:
        ctx = s.app.state.ctx

        async def broken(*a, **k):
            raise RuntimeError("surprise")

        ctx.encode = broken
        r = httpx.post(s.url + "/v1/chat/completions", json={"model": "scripted", "messages": MSG})
        assert r.status_code == 500
        err = _body_ok(r.json(), 500)
        assert err["type"] == "server_error" and "Traceback" not in r.text


def test_content_exception_before_the_engine_is_a_400_logged_in_one_line(tokenizer, caplog):
    """The last-resort net: a TypeError or RecursionError escaping the checks while a request is
    read (before the engine has it) is the content's doing, so 400, one log line, no traceback;
    past the engine such exceptions stay 500 (test above)."""
    with start_server(tokenizer) as s:
        ctx = s.app.state.ctx

        def deep(depth=0):
            return deep(depth + 1)

        for exc, code in ((TypeError("unhashable"), "invalid_request"), (None, "too_deep")):
            async def broken(*a, exc=exc, **k):
                if exc is None:
                    deep()
                raise exc

            ctx.encode = broken
            caplog.clear()
            r = httpx.post(s.url + "/v1/chat/completions", json={"model": "scripted", "messages": MSG})
            assert r.status_code == 400 and "Traceback" not in r.text
            err = _body_ok(r.json(), 400)
            assert err["code"] == code and err["type"] == "invalid_request_error" and "unhashable" not in err["message"]
            records = [rec for rec in caplog.records if rec.name == "tiermoe.server"]
            assert len(records) == 1 and records[0].exc_info is None and "\n" not in records[0].getMessage()
            assert "request refused" in records[0].getMessage()


def test_a_prompt_list_past_the_queue_is_refused_before_tokenizing(tokenizer, monkeypatch):
    """/v1/completions counts a prompt list against the queue before tokenizing it: a list the
    server cannot take is a 429 at once, not after seconds of tokenizing every prompt on the one
    tokenizer thread. A list it can take is tokenized and served as before."""
    with start_server(tokenizer, core_kwargs={"max_num_seqs": 2}, max_queue=1) as s:  # room for 3
        encoded = []
        real_encode = tokenizer.encode

        def spy(text, *args, **kwargs):
            encoded.append(text)
            return real_encode(text, *args, **kwargs)

        monkeypatch.setattr(tokenizer, "encode", spy)
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        prompts = [f"prompt {i} " + "word " * 500 for i in range(4)]
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model="scripted", prompt=prompts, max_tokens=2)
        err = _body_ok(e.value.body if "error" in e.value.body else {"error": e.value.body}, 429)
        assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
        assert e.value.response.headers["retry-after"] == "1"
        assert not any(p in encoded for p in prompts)
        with pytest.raises(openai.RateLimitError):  # n counts too: 2 prompts x 2 choices
            c.completions.create(model="scripted", prompt=prompts[:2], n=2, max_tokens=2)
        assert not any(p in encoded for p in prompts)
        r = c.completions.create(model="scripted", prompt=prompts[:3], max_tokens=2)
        assert [ch.index for ch in r.choices] == [0, 1, 2] and r.usage.prompt_tokens > 1500
        assert all(p in encoded for p in prompts[:3])


@pytest.mark.parametrize("key", [" 5", "5 ", "+5", "-0", "5.0", "0x5", "5_0", "1e2", "5\n", "", "٥", "５", "²", "٣٢"])
def test_logit_bias_keys_are_ascii_digits_only(client, key):
    """OpenAI's logit_bias keys are token ids in decimal. int() also reads signs, spaces,
    underscores and non-ASCII digits ("٥" is 5), so such keys once biased a token here; they
    are a 400 naming logit_bias on chat and completions alike."""
    for create, kwargs in ((client.chat.completions.create, {"messages": MSG}),
                           (client.completions.create, {"prompt": "hi"})):
        err = _raises(openai.BadRequestError, create, model="scripted", max_tokens=2, logit_bias={key: 1}, **kwargs)
        assert err["param"] == "logit_bias" and err["type"] == "invalid_request_error"
        assert err["code"] == "invalid_value" and "\n" not in err["message"] and "not a token id" in err["message"]


def test_logit_bias_keys_in_range_and_values_in_bounds(client):
    for bias in ({"5": 1}, {"0005": -100}, {"0": 100, "7": 0.5}):
        r = client.chat.completions.create(model="scripted", messages=MSG, max_tokens=2, logit_bias=bias)
        assert r.choices[0].finish_reason in ("stop", "length")
    err = _bad_chat(client, messages=MSG, logit_bias={"9" * 5000: 1})  # int() refuses 4300+ digits
    assert "outside the vocabulary" in err["message"] and len(err["message"]) < 120
    for value in (100.5, -101, 1e300):
        assert _bad_chat(client, messages=MSG, logit_bias={"5": value})["param"] == "logit_bias"
