"""Fixtures: a real uvicorn server on a free port, in a background thread, per engine setup."""

from __future__ import annotations

import pytest
from testkit.servers import ServerThread

from tiermoe.engine.async_engine import AsyncEngine
from tiermoe.engine.scripted import ScriptedEngineCore, ScriptedReply, default_script
from tiermoe.models.tiny_tokenizer import build_tokenizer


LONG_REASONING = " ".join(f"step {i}." for i in range(60))


def script(prompt: str):
    """The test model: default_script plus a few prompts that exercise server paths."""
    if "TRIGGER_FAULT" in prompt:
        return ScriptedReply(content="this will break " * 5, fail_after=3)
    if "THINK_LONG" in prompt:
        return ScriptedReply(content="Done thinking.", reasoning=LONG_REASONING)
    if "UNICODE" in prompt:
        return ScriptedReply(content="héllo wörld 世界 🚀 done")
    if "STOP_TEST" in prompt:
        return ScriptedReply(content="alpha beta <|END|> gamma delta")
    return default_script(prompt)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


def start_server(tokenizer, *, core_kwargs=None, **app_kwargs) -> ServerThread:
    from tiermoe.server.app import create_app

    core_kwargs = dict(core_kwargs or {})
    core_kwargs.setdefault("script", script)
    core = ScriptedEngineCore(tokenizer=tokenizer, **core_kwargs)
    engine = AsyncEngine(core)
    app_kwargs.setdefault("served_model_name", "scripted")
    app = create_app(engine, **app_kwargs)
    server = ServerThread(app)
    server.core = core
    server.engine = engine
    return server


@pytest.fixture(scope="session")
def server(tokenizer):
    """The shared server: scripted hermes core, 4096-token context, short steps."""
    with start_server(tokenizer, core_kwargs={"max_model_len": 4096, "max_num_seqs": 32, "step_delay_s": 0.001},
                      max_model_len=4096) as s:
        yield s


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="session")
def anthropic_client(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=30)
