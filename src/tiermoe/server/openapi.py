"""The OpenAPI document served at /openapi.json, with real request-body schemas.

Routes read their bodies themselves (`handling.parse_body`: strict pydantic on the raw
bytes, so a wrong type is a 400 in the API's own error shape, not FastAPI's 422), which
leaves FastAPI's generated document without request bodies. This module adds them from the
same pydantic models the routes validate with, plus the error bodies every route may return,
so clients and API fuzzers (schemathesis) see what the server really accepts.
"""

from __future__ import annotations

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from tiermoe.server import anthropic_protocol, protocol

# path -> the model its POST body is validated against
REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": protocol.ChatCompletionRequest,
    "/v1/completions": protocol.CompletionRequest,
    "/v1/responses": protocol.ResponsesRequest,
    "/v1/messages": anthropic_protocol.MessagesRequest,  # output_config, output_format: the routes' own models
    "/v1/messages/count_tokens": anthropic_protocol.CountTokensRequest,
    "/tokenize": protocol.TokenizeRequest,
    "/detokenize": protocol.DetokenizeRequest,
}

_OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}
# statuses any route may answer besides 200 (auth, size, queue, shutdown, engine faults)
_ERROR_STATUSES = {
    "400": "bad request (malformed JSON, wrong types, values out of range, context exceeded, a JSON schema past "
           "the server's limits)",
    "401": "missing or invalid API key",
    "404": "unknown model",
    "408": "the request body did not arrive within the server's body timeout (the connection is closed)",
    "413": "request body too large",
    "415": "a compressed request body (Content-Encoding other than identity)",
    "429": "queue, connection or per-client connection limit reached; see Retry-After",
    "500": "the engine failed this request",
    "503": "shutting down or engine unavailable",
    "504": "the request ran past the server's request timeout",
}


def build_openapi(app) -> dict:
    """FastAPI's document for `app`, with request bodies and error responses filled in."""
    from fastapi.openapi.utils import get_openapi

    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    keys, defs = models_json_schema(
        [(m, "validation") for m in REQUEST_MODELS.values()], ref_template="#/components/schemas/{model}"
    )
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(defs.get("$defs", {}))
    schemas["OpenAIError"] = _OPENAI_ERROR
    schemas["AnthropicError"] = _ANTHROPIC_ERROR
    for path, ops in doc.get("paths", {}).items():
        error_ref = "AnthropicError" if path.startswith("/v1/messages") else "OpenAIError"
        for method, op in ops.items():
            model = REQUEST_MODELS.get(path) if method == "post" else None
            if model is not None:
                op["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": keys[(model, "validation")]}},
                }
            responses = op.setdefault("responses", {})
            for status, text in _ERROR_STATUSES.items():
                responses.setdefault(status, {
                    "description": text,
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{error_ref}"}}},
                })
            if model is not None and path not in ("/tokenize", "/detokenize", "/v1/messages/count_tokens"):
                ok = responses.setdefault("200", {"description": "Successful Response"})
                ok.setdefault("content", {}).setdefault("text/event-stream", {"schema": {"type": "string"}})
    return doc


def install(app) -> None:
    """Serve the filled-in document (built once, on first request) as app.openapi()."""
    cache: dict = {}

    def openapi() -> dict:
        if "doc" not in cache:
            cache["doc"] = build_openapi(app)
        return cache["doc"]

    app.openapi = openapi
