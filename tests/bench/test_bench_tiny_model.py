"""Every HTTP bench command against the project's server running a tiny random CPU model.

The tiny model is random, so gate answers are wrong (only load must pass); what is checked is
that each command runs end to end on real model output, writes valid JSON, and that a panel
scored against its own reference agrees at every position it can align.
"""

from __future__ import annotations

import pytest

from tiermoe.bench.gates import GATE_NAMES

from .conftest import load, run_bench
from .scripted_server import serve

pytest.importorskip("tiermoe.server.app")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_url(tiny_dir):
    from tiermoe.engine.async_engine import AsyncEngine
    from tiermoe.engine.build import build_engine_core
    from tiermoe.server.app import create_app

    core = build_engine_core(str(tiny_dir("qwen3_moe")), device="cpu", max_model_len=1024, max_num_seqs=4)
    app = create_app(AsyncEngine(core), served_model_name="tiny", max_model_len=1024)
    with serve(app=app, lifespan="on") as url:
        yield url


def test_tiny_model_all_commands(tiny_url, tmp_path, capsys):
    f = {name: str(tmp_path / f"{name}.json") for name in ("sweep", "stream", "gates", "panel", "score")}
    common = ["--url", tiny_url, "--seed", "0"]
    rc, text = run_bench(
        [
            "sweep",
            *common,
            "--prefill-sizes",
            "64,128",
            "--reps",
            "1",
            "--concurrency",
            "1,2,4",
            "--max-tokens",
            "8",
            "--long-prompt",
            "256",
            "--out",
            f["sweep"],
        ],
        capsys,
    )
    assert rc == 0, text
    s = load(f["sweep"])
    assert s["model"] == "tiny" and s["max_model_len"] == 1024
    assert all(p["median_tok_s"] > 0 and len(p["runs"]) == 1 for p in s["prefill"])
    assert [d["concurrency"] for d in s["decode"]] == [1, 2, 4]
    assert all(st["completion_tokens"] == 8 for d in s["decode"] for st in d["rounds"][0]["streams"])
    assert s["long_prompt_c1"]["prompt_tokens"] >= 256

    rc, text = run_bench(["stream-rate", *common, "--max-tokens", "32", "--out", f["stream"]], capsys)
    st = load(f["stream"])
    assert rc == (0 if st["verdict"] == "PASS" else 1) and st["completion_tokens"] == 32
    assert st["timeline"][-1][1] == st["total_chars"] > 0

    rc, text = run_bench(["gates", *common, "--max-tokens", "16", "--speed-window", "1", "--out", f["gates"]], capsys)
    g = load(f["gates"])
    assert [x["name"] for x in g["gates"]] == list(GATE_NAMES)
    assert g["gates"][0]["verdict"] == "PASS"  # load; a random model answers the rest wrongly
    assert g["gates"][4]["evidence"]["window"] == 1024  # context gate read max_model_len
    assert rc == (0 if g["verdict"] == "PASS" else 1)

    rc, text = run_bench(["panel", "make", *common, "--max-tokens", "6", "--out", f["panel"]], capsys)
    assert rc == 0, text
    rc, text = run_bench(["panel", "score", *common, "--panel", f["panel"], "--out", f["score"]], capsys)
    assert rc == 0, text
    r = load(f["score"])
    assert r["positions"] + r["positions_misaligned"] == 48
    assert r["positions"] > 0 and r["top1_agreement"] == 1.0 and r["mean_kl"] < 1e-6
    assert r["greedy_exact_fraction"] == 1.0

    rc, text = run_bench(["report", *f.values(), "--out", str(tmp_path / "r.md")], capsys)
    assert rc == 0, text
