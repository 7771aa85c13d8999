"""Helpers shared by the reliability tests: in-process servers, `tiermoe serve` subprocesses,
and the error-body shape checks every refusal must pass."""

from __future__ import annotations

from pathlib import Path

import httpx

from testkit.cli_server import CliServer
from testkit.servers import ServerThread, free_port  # noqa: F401 (free_port: re-exported to the tests)

ROOT = Path(__file__).resolve().parents[2]


def scripted_server(*, max_model_len: int = 1024, max_num_seqs: int = 8, step_delay_s: float = 0.0, script=None,
                    **app_kwargs) -> ServerThread:
    """A ScriptedEngineCore behind the real app (real tokenizer, real continuous batching)."""
    from tiermoe.engine.async_engine import AsyncEngine
    from tiermoe.engine.scripted import ScriptedEngineCore
    from tiermoe.models.tiny_tokenizer import build_tokenizer
    from tiermoe.server.app import create_app

    core = ScriptedEngineCore(script, tokenizer=build_tokenizer(), max_model_len=max_model_len,
                              max_num_seqs=max_num_seqs, step_delay_s=step_delay_s)
    engine = AsyncEngine(core)
    app_kwargs.setdefault("served_model_name", "scripted")
    app_kwargs.setdefault("max_model_len", max_model_len)
    server = ServerThread(create_app(engine, **app_kwargs), log_level="error")
    server.core, server.engine = core, engine
    return server


def served_like_the_cli(server: ServerThread) -> ServerThread:
    """The same server run with the uvicorn configuration of `tiermoe serve` (connections.py: its
    h11 protocol with the header deadline, the keep-alive timeout) instead of the test default."""
    import uvicorn

    from tiermoe.server.connections import uvicorn_config

    server.server = uvicorn.Server(uvicorn_config(server.app, host="127.0.0.1", port=server.port, log_level="error",
                                                  graceful_timeout_s=5))
    return server


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def header(response, name: str) -> str:
    """A response header from httpx (str values) or schemathesis (list values) responses."""
    for key, value in response.headers.items():
        if key.lower() == name:
            return value[0] if isinstance(value, list) else value
    return ""


SAFETY_NET = ("the request could not be processed", "the request is nested too deeply")


def assert_error_body(path: str, response) -> dict:
    """The body of an error response has the API's own shape (OpenAI, or Anthropic on
    /v1/messages*), a non-empty message, JSON content type, no traceback, and comes from an
    explicit check rather than the last-resort net for exceptions."""
    assert header(response, "content-type").startswith("application/json"), (path, response.headers)
    text = response.text
    assert "Traceback" not in text and 'File "' not in text, text[:500]
    body = response.json()
    if is_anthropic(path):
        assert body.get("type") == "error", body
        err = body["error"]
        assert set(err) == {"type", "message"}, body
    else:
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, body
        assert err["param"] is None or isinstance(err["param"], str)
        assert err["code"] is None or isinstance(err["code"], str)
    assert isinstance(err["message"], str) and err["message"], body
    assert isinstance(err["type"], str) and err["type"], body
    # refused by an explicit check: the last-resort 400 of handling.run_endpoint means a value went unchecked
    assert not err["message"].startswith(SAFETY_NET), body
    return err


def healthy(url: str, timeout: float = 10.0) -> bool:
    """/health answers 200 and a trivial chat request completes."""
    r = httpx.get(url + "/health", timeout=timeout)
    if r.status_code != 200:
        return False
    r = httpx.post(url + "/v1/chat/completions", timeout=timeout,
                   json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
    return r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")


class ServeProcess(CliServer):
    """`python -m tiermoe.cli serve ARGS` as a user runs it from the repository root; waits for
    /health. `start` and `stop` (the exit status) beside the context manager."""

    def __init__(self, args: list[str], *, env: dict | None = None, startup_s: float = 120.0):
        super().__init__(args, env or {}, startup_s, cwd=str(ROOT))

    def start(self) -> "ServeProcess":
        return self.__enter__()

    def stop(self) -> int:
        self.__exit__()
        return self.proc.returncode

