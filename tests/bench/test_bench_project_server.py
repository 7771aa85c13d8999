"""`bench sweep` and `bench gates` against the project's own server (scripted engine core)."""

from __future__ import annotations

import pytest

from .conftest import load, run_bench
from .scripted_server import serve

pytest.importorskip("tiermoe.server.app")


@pytest.fixture(scope="module")
def project_url():
    from tiermoe.engine.async_engine import AsyncEngine
    from tiermoe.engine.scripted import ScriptedEngineCore
    from tiermoe.server.app import create_app

    core = ScriptedEngineCore(max_model_len=4096, max_num_seqs=8, step_delay_s=0.002)
    app = create_app(AsyncEngine(core), served_model_name="scripted", max_model_len=4096)
    with serve(app=app, lifespan="on") as url:
        yield url


def test_sweep_against_project_server(project_url, tmp_path, capsys):
    out = tmp_path / "sweep.json"
    rc, text = run_bench(
        [
            "sweep",
            "--url",
            project_url,
            "--prefill-sizes",
            "64,256",
            "--reps",
            "3",
            "--max-tokens",
            "16",
            "--long-prompt",
            "512",
            "--out",
            str(out),
        ],
        capsys,
    )
    assert rc == 0, text
    r = load(out)
    assert r["model"] == "scripted" and r["max_model_len"] == 4096
    assert r["config"]["prefill_endpoint"] == "completions"
    for row in r["prefill"]:
        assert abs(row["prompt_tokens"] - row["target_tokens"]) <= max(2, 0.02 * row["target_tokens"])
        assert all(run["token_count_source"] == "usage" and run["tok_s"] > 0 for run in row["runs"])
    for d in r["decode"]:
        streams = d["rounds"][0]["streams"]
        assert len(streams) == d["concurrency"]
        assert all(s["completion_tokens"] == 16 for s in streams)
        assert d["aggregate_tok_s"] > 0 and d["per_stream_tok_s"] > 0
    assert r["long_prompt_c1"]["prompt_tokens"] >= 512


def test_gates_against_project_server(project_url, tmp_path, capsys):
    out = tmp_path / "gates.json"
    rc, text = run_bench(
        ["gates", "--url", project_url, "--speed-window", "1", "--speed-min", "50", "--out", str(out)], capsys
    )
    r = load(out)
    assert rc == 0, [(g["name"], g["reason"]) for g in r["gates"]]
    assert r["passed"] == 6


def test_stream_rate_passes_against_project_server(tmp_path, capsys):
    """The delivery rule on the real server: a 600-token story at ~50 tok/s (12 s) must arrive
    evenly (>= 40 % by the midpoint, <= 10 % in the last second), i.e. no end-of-answer burst."""
    from tiermoe.engine.async_engine import AsyncEngine
    from tiermoe.engine.scripted import ScriptedEngineCore
    from tiermoe.server.app import create_app

    core = ScriptedEngineCore(max_model_len=4096, max_num_seqs=4, step_delay_s=0.02)
    app = create_app(AsyncEngine(core), served_model_name="scripted", max_model_len=4096)
    out = tmp_path / "stream.json"
    with serve(app=app, lifespan="on") as url:
        rc, text = run_bench(["stream-rate", "--url", url, "--max-tokens", "600", "--out", str(out)], capsys)
    assert rc == 0, text
    r = load(out)
    assert r["verdict"] == "PASS", r
    assert r["fraction_by_midpoint"] >= 0.40 and r["fraction_in_tail"] <= 0.10


def test_tokenize_body_read_by_project_server(project_url):
    """Our /tokenize reads the client's two-dialect body at once: same ids as its own body, no retry."""
    import asyncio
    import json

    from tiermoe.bench import client as http

    sent: list[dict] = []

    async def record(req) -> None:
        sent.append(json.loads(req.content))

    async def go():
        async with http.make_client(project_url) as c:
            own = await http.post_json(c, "/tokenize", {"model": "scripted", "prompt": "Hello there, world"})
            c.event_hooks["request"] = [record]
            return own, await http.token_ids(c, "scripted", "Hello there, world", special=True)

    own, ids = asyncio.run(go())
    assert ids == own["tokens"] and len(ids) == own["count"] > 0
    assert len(sent) == 1 and sent[0]["content"] == sent[0]["prompt"]
