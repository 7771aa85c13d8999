"""Helpers shared by the reliability tests: in-process servers, `tiermoe serve` subprocesses,
and the error-body shape checks every refusal must pass."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from testkit.servers import ServerThread, free_port

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


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


class ServeProcess:
    """`python -m tiermoe.cli serve ARGS` as a user runs it; waits for /health."""

    def __init__(self, args: list[str], *, env: dict | None = None, startup_s: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "tiermoe.cli", "serve", "--port", str(self.port), *args]
        self.env = {**ENV, **(env or {})}
        self.startup_s = startup_s
        self.proc: subprocess.Popen | None = None
        self._err: list[str] = []

    def start(self) -> "ServeProcess":
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=self.env,
                                     cwd=str(ROOT))
        threading.Thread(target=self._pump, daemon=True).start()
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return self
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server did not become healthy: {self.stderr[-2000:]}")

    def _pump(self) -> None:
        for line in self.proc.stderr:
            self._err.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self._err)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def __enter__(self) -> "ServeProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

