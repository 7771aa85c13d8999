"""`tiermoe serve` as a user runs it: startup, SIGTERM drain, one-line errors, no torch in the server."""

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from tiermoe.errors import UserError
from tiermoe.server.cli import _served_name, register

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_modules_do_not_import_torch():
    code = ("import sys; import tiermoe.server.app, tiermoe.server.cli, tiermoe.engine.async_engine, "
            "tiermoe.server.detokenize, tiermoe.protocol; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def _serve_parser():
    """Only the serve subcommand (the full CLI imports every subsystem, torch included)."""
    parser = argparse.ArgumentParser(prog="tiermoe")
    register(parser.add_subparsers())
    return parser


def test_port_in_use_is_one_line_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        args = _serve_parser().parse_args(["serve", "--scripted", "--port", str(port)])
        with pytest.raises(UserError, match="cannot listen on 127.0.0.1"):
            args.handler(args)


def test_missing_model_path_is_one_line_error(tmp_path):
    args = _serve_parser().parse_args(["serve", str(tmp_path / "nope")])
    with pytest.raises(UserError, match="does not exist"):
        args.handler(args)


def test_engine_build_error_on_the_engine_thread_is_one_line_error(tiny_dir):
    """The core is built on the engine thread; what fails there still ends `serve` with one line."""
    args = _serve_parser().parse_args(["serve", str(tiny_dir("deepseek_v3")), "--port", str(_free_port()),
                                       "--device", "cpu", "--decode-attention", "paged"])
    with pytest.raises(UserError, match="--decode-attention paged: only grouped-query attention"):
        args.handler(args)


def test_served_name_defaults():
    parser = _serve_parser()
    assert _served_name(parser.parse_args(["serve", "/models/GLM-5.3-Flash/"])) == "GLM-5.3-Flash"
    assert _served_name(parser.parse_args(["serve"])) == "smollm2-135m-instruct"
    assert _served_name(parser.parse_args(["serve", "x", "--served-model-name", "glm"])) == "glm"
    # a Hugging Face repo id is served under its id, as vLLM does
    assert _served_name(parser.parse_args(["serve", "HuggingFaceTB/SmolLM2-135M-Instruct"])) == \
        "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.slow
def test_serve_scripted_then_sigterm_drains_in_flight_stream():
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tiermoe.cli", "serve", "--scripted", "--port", str(port), "--api-key", "k",
         "--scripted-step-delay", "0.01", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        assert client.models.list().data[0].id == "scripted"
        result = {}

        def consume():
            text, finish = "", None
            messages = [{"role": "user", "content": "Tell me a story"}]
            for ch in client.chat.completions.create(model="scripted", messages=messages, max_tokens=60, stream=True):
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
                    finish = ch.choices[0].finish_reason or finish
            result.update(text=text, finish=finish)

        t = threading.Thread(target=consume)
        t.start()
        time.sleep(0.15)  # the stream is under way
        proc.send_signal(signal.SIGTERM)
        t.join(30)
        rc = proc.wait(30)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert result.get("finish") == "length" and len(result["text"]) > 100  # ran to completion while draining
    assert rc == 0
    assert f"listening on http://127.0.0.1:{port}" in err
