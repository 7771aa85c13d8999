"""Refusals that say what is wrong: a schema number past 64 bits, a compressed body, a format field by its name."""

import gzip
import json

import httpx
import openai
import pytest

MSG = [{"role": "user", "content": "hi"}]
HUGE = 123456789012345678901234567890


@pytest.mark.parametrize("schema, where", [
    ({"type": "integer", "maximum": HUGE}, "/maximum"),
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": -HUGE}}}, "/properties/n/minimum"),
])
def test_a_schema_number_past_64_bits_names_the_response_format(client, schema, where):
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="scripted", messages=MSG, response_format=fmt)
    err = e.value.body
    assert err["param"] == "response_format.json_schema.schema" and err["code"] == "unsupported_schema"
    assert "64-bit" in err["message"] and str(HUGE)[:20] in err["message"] and "ValueError" not in err["message"]
    assert f" at {where}," in err["message"]


def test_a_forced_tool_with_a_number_past_64_bits_names_the_tool(client):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "maximum": HUGE}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="scripted", messages=MSG, tools=[tool], tool_choice="required")
    assert e.value.body["param"] == "tools[0].parameters" and "64-bit" in e.value.body["message"]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": "scripted", "messages": MSG}),
    ("/v1/messages", {"model": "scripted", "max_tokens": 4, "messages": MSG}),
])
@pytest.mark.parametrize("encoding", ["gzip", "br", "GZIP, deflate"])
def test_a_compressed_body_is_a_415_saying_so(server, path, body, encoding):
    r = httpx.post(server.url + path, content=gzip.compress(json.dumps(body).encode()),
                   headers={"content-type": "application/json", "content-encoding": encoding})
    assert r.status_code == 415
    payload = r.json()
    err = payload["error"]
    if path == "/v1/messages":
        assert payload["type"] == "error" and err["type"] == "invalid_request_error"
    else:
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "unsupported_content_encoding"
    assert "Content-Encoding" in err["message"] and "uncompressed" in err["message"]
    assert encoding.lower()[:4] in err["message"]


def test_identity_encoding_is_read_as_before(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "scripted", "messages": MSG, "max_tokens": 4},
                   headers={"content-encoding": "identity"})
    assert r.status_code == 200


def test_a_format_without_its_schema_names_the_field_of_each_api(client):
    """Each API puts its format elsewhere; the 400 names the field the client sent."""
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="scripted", input="hi", text={"format": {"type": "json_schema", "name": "n"}})
    assert e.value.body["param"] == "text.format.schema" and e.value.body["message"].startswith("text.format ")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="scripted", input="hi", text={"format": {"type": "yaml"}})
    assert e.value.body["param"] == "text.format.type"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="scripted", messages=MSG, response_format={"type": "json_schema"})
    assert e.value.body["param"] == "response_format.json_schema.schema"
    assert e.value.body["message"].startswith("response_format ")
