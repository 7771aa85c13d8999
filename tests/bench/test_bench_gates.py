"""The six gate checkers: all PASS on a model that answers each gate right, all FAIL on one
that answers each wrong, with evidence that shows why."""

from __future__ import annotations

import pytest

from tiermoe.bench.gates import GATE_NAMES

from .conftest import load, run_bench
from .scripted_server import Behaviour, serve

FAST = ["--speed-window", "0.5", "--speed-min", "100", "--seed", "3"]


def test_right_model_passes_all_six(right_url, tmp_path, capsys):
    out = tmp_path / "gates.json"
    rc, text = run_bench(["gates", "--url", right_url, *FAST, "--out", str(out)], capsys)
    assert rc == 0, text
    r = load(out)
    assert r["kind"] == "tiermoe.bench.gates"
    assert [g["name"] for g in r["gates"]] == list(GATE_NAMES)
    assert [g["verdict"] for g in r["gates"]] == ["PASS"] * 6, [g["reason"] for g in r["gates"]]
    assert r["verdict"] == "PASS" and r["passed"] == 6
    ev = {g["name"]: g["evidence"] for g in r["gates"]}
    assert ev["load"]["models"] == ["scripted-tiny"]
    assert ev["chat"]["finish_reason"] == "stop"
    assert ev["reasoning"]["content"] == "391" and ev["reasoning"]["reasoning_chars"] > 0
    assert ev["tools"]["city"] == "Paris" and "17" in ev["tools"]["answer"]
    # window read from /v1/models (4096); prompt sized by /tokenize to 85 % of it
    assert ev["context"]["window"] == 4096
    assert ev["context"]["prompt_tokens"] == pytest.approx(0.85 * 4096, rel=0.03)
    assert ev["context"]["code"] in ev["context"]["answer"]
    assert ev["speed"]["tok_s"] >= 100 and ev["speed"]["token_count_source"] == "usage"
    assert "PASS: 6/6 gates passed" in text


def test_wrong_model_fails_all_six(wrong_url, tmp_path, capsys):
    out = tmp_path / "gates.json"
    rc, text = run_bench(["gates", "--url", wrong_url, *FAST, "--context", "2048", "--out", str(out)], capsys)
    assert rc == 1, text
    r = load(out)
    by = {g["name"]: g for g in r["gates"]}
    assert [g["verdict"] for g in r["gates"]] == ["FAIL"] * 6, [g["reason"] for g in r["gates"]]
    assert r["verdict"] == "FAIL" and r["passed"] == 0
    assert "503" in by["load"]["reason"]
    assert "empty content" in by["chat"]["reason"] and "'length'" in by["chat"]["reason"]
    reasons = by["reasoning"]["reason"]
    assert "reasoning_content is empty" in reasons and "'391' not in content" in reasons and "<think>" in reasons
    assert "London" in by["tools"]["reason"]
    assert by["context"]["evidence"]["window"] == 2048 and "not in the answer" in by["context"]["reason"]
    assert by["speed"]["evidence"]["tok_s"] < 100 and not by["speed"]["evidence"]["stream_ended_in_window"]


def test_tool_result_must_be_used(tmp_path, capsys):
    """The tools gate needs both halves: a right call, then 17 in the answer to the result."""
    from fastapi import Request

    from .scripted_server import build_app

    app = build_app(Behaviour())

    @app.middleware("http")
    async def drop_tool_result(request: Request, call_next):  # the model never sees the result
        if request.url.path == "/v1/chat/completions":
            body = await request.json()
            if body["messages"][-1].get("role") == "tool":
                body["messages"][-1]["content"] = "{}"
                request._body = __import__("json").dumps(body).encode()
        return await call_next(request)

    out = tmp_path / "g.json"
    with serve(app=app) as url:
        rc, text = run_bench(["gates", "--url", url, "--only", "load,tools", "--out", str(out)], capsys)
    assert rc == 1, text
    tools = load(out)["gates"][1]
    assert tools["verdict"] == "FAIL" and "does not use the tool result" in tools["reason"]
    assert tools["evidence"]["city"] == "Paris"


def test_context_gate_needs_a_window(tmp_path, capsys):
    out = tmp_path / "g.json"
    with serve(Behaviour(report_window=False)) as url:
        rc, text = run_bench(["gates", "--url", url, "--only", "context", "--out", str(out)], capsys)
    assert rc == 1
    g = load(out)["gates"][0]
    assert g["verdict"] == "FAIL" and "--context" in g["reason"]


def test_context_gate_needle_at_end(tmp_path, capsys):
    out = tmp_path / "g.json"
    with serve(Behaviour(max_model_len=1024)) as url:
        rc, text = run_bench(
            ["gates", "--url", url, "--only", "context", "--needle-depth", "1", "--out", str(out)], capsys
        )
    assert rc == 0, text
    ev = load(out)["gates"][0]["evidence"]
    assert ev["needle_depth"] == 1.0 and ev["prompt_tokens"] <= 1024


def test_unknown_gate_is_user_error(capsys):
    rc, text = run_bench(["gates", "--only", "chat,vibes"], capsys)
    assert rc == 2 and "vibes" in text
