"""Every failure becomes a clean JSON body: OpenAI's shape, or Anthropic's on /v1/messages.

OpenAI:    {"error": {"message", "type", "param", "code"}}
Anthropic: {"type": "error", "error": {"type", "message"}}

Bad input is always a 4xx. Only a genuine server fault is a 5xx, and even then the body is
one of the shapes above (never a traceback or an HTML page).
"""

from __future__ import annotations

import json
import logging
import re

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from tiermoe.errors import UserError
from tiermoe.protocol import InvalidRequest

log = logging.getLogger("tiermoe.server")

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


class APIError(Exception):
    """An HTTP error with its message, the offending parameter and a machine-readable code."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def brief(text: str, width: int = 40) -> str:
    """A client's value shown in an error message, cut to `width` characters: a JSON integer may
    have thousands of digits, a key or a schema number any length."""
    return text if len(text) <= width else text[: width - 3] + "..."


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(status: int, message: str, param: str | None, code: str | None, anthropic: bool) -> dict:
    if anthropic:
        # Anthropic's body has no `param`: the field goes in front of the message (as the Anthropic API
        # writes "messages.1.content.0: ..."), or "tool_result content must be text" leaves a client with
        # twenty tool results to guess which one
        if param and param not in message:
            message = f"{param}: {message}"
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    kind = _OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(path: str, err: APIError) -> JSONResponse:
    body = error_body(err.status, err.message, err.param, err.code, is_anthropic_path(path))
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def sse_error_event(path: str, message: str, status: int = 500, code: str | None = None) -> str:
    """An error reported inside a stream that has already started (headers are sent)."""
    if is_anthropic_path(path):
        return "event: error\ndata: " + json.dumps(error_body(status, message, None, code, True)) + "\n\n"
    return "data: " + json.dumps(error_body(status, message, None, code, False)) + "\n\n"


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list|dict)$|[\[\]]|^[A-Z]")


def _loc_to_param(loc: tuple) -> str | None:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(item, str) and not _UNION_TAG.search(item):
            parts.append(("." if parts else "") + item)
    return "".join(parts) or None


def from_validation_error(exc: ValidationError) -> APIError:
    """Pydantic errors -> one 400 naming the first offending field (or malformed JSON)."""
    errors = exc.errors(include_url=False)
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(f"request body is not valid JSON: {first.get('msg')}", code="invalid_json")
    if first.get("type") == "model_type" and not first.get("loc"):
        return bad_request("request body must be a JSON object", code="invalid_json")
    param = _loc_to_param(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        return bad_request(f"missing required field '{param}'", param=param, code="missing_field")
    detail = f"invalid value for '{param}': {msg}" if param else msg
    code = "invalid_type" if first.get("type", "").endswith("_type") else "invalid_value"
    return bad_request(detail, param=param, code=code)


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception raised while handling a request to an APIError."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValidationError):
        return from_validation_error(exc)
    if isinstance(exc, InvalidRequest):
        return bad_request(str(exc), param=exc.param)
    if isinstance(exc, UserError):
        return bad_request(str(exc))
    if isinstance(exc, RecursionError):  # its traceback is a thousand frames of the same few lines
        log.error("unhandled server error: RecursionError at %s", where(exc))
    else:
        log.error("unhandled server error", exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}", code="internal_error")


# What Python raises when data has the wrong shape, type or size: from code reading a request,
# these mean the request's content was not what the code expected.
CONTENT_ERRORS = (RecursionError, TypeError, ValueError, LookupError, AttributeError, OverflowError)


def content_error(exc: BaseException) -> APIError:
    """An exception raised while reading a request, before it reached the engine: if it is one
    of CONTENT_ERRORS it is the request's doing (only its content and the server's settings were
    involved), so a 400 that names no internals, logged as one line instead of a traceback (a
    deep request makes a deep one). Anything else (an OSError, a failing tokenizer) stays a 500."""
    if isinstance(exc, (APIError, ValidationError, InvalidRequest, UserError)) or not isinstance(exc, CONTENT_ERRORS):
        return to_api_error(exc)
    log.warning("request refused: %s while reading it, at %s", type(exc).__name__, where(exc))
    if isinstance(exc, RecursionError):
        return bad_request("the request is nested too deeply to process", code="too_deep")
    return bad_request(f"the request could not be processed ({type(exc).__name__}); check its fields "
                       f"against the API reference", code="invalid_request")


def where(exc: BaseException) -> str:
    """file:line in function of the innermost frame of `exc`'s traceback."""
    tb = exc.__traceback__
    if tb is None:
        return "(no traceback)"
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return f"{code.co_filename}:{tb.tb_lineno} in {code.co_name}"


def install_handlers(app) -> None:
    """Exception handlers on the FastAPI app: nothing escapes without a proper body."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        msg = errs[0].get("msg", "invalid request") if errs else "invalid request"
        return error_response(request.url.path, bad_request(msg))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        msg = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            msg = f"no route for {request.method} {request.url.path}"
        elif exc.status_code == 405:
            msg = f"method {request.method} is not allowed on {request.url.path}"
        return error_response(request.url.path, APIError(exc.status_code, msg, headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return error_response(request.url.path, to_api_error(exc))
