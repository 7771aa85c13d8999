"""`bench report`: real result files of every kind -> markdown tables and PNG plots."""

from __future__ import annotations

import asyncio

import pytest

from tiermoe.store.floor import decode_floor
from tiermoe.bench.gates import GatesConfig, run_gates
from tiermoe.bench.panel import PanelMakeConfig, make_panel
from tiermoe.bench.panel_score import PanelScoreConfig, score_panel
from tiermoe.bench.results import envelope, write_json
from tiermoe.bench.stream_rate import StreamRateConfig, run_stream_rate
from tiermoe.bench.sweep import SweepConfig, run_sweep

from .conftest import run_bench

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def results(tmp_path_factory, right_url):
    d = tmp_path_factory.mktemp("results")
    sweep = SweepConfig(
        url=right_url, prefill_sizes=[32, 64], reps=1, concurrency=[1, 2], max_tokens=6, long_prompt_tokens=64
    )
    files = {}
    files["sweep_a"] = asyncio.run(run_sweep(sweep))
    files["sweep_b"] = asyncio.run(run_sweep(sweep))
    files["stream"] = asyncio.run(run_stream_rate(StreamRateConfig(url=right_url, tail_seconds=0.005)))
    files["gates"] = asyncio.run(run_gates(GatesConfig(url=right_url, speed_window_s=0.5, speed_min_tok_s=50)))
    panel = asyncio.run(make_panel(PanelMakeConfig(url=right_url, max_tokens=4)))
    files["panel"] = panel
    files["score"] = asyncio.run(score_panel(PanelScoreConfig(url=right_url, panel=panel)))
    files["floor"] = envelope("floor", **decode_floor(13.4e6, 8, 42, fractions={"gpu": 0.385, "ram": 0.615}))
    paths = {}
    for name, r in files.items():
        paths[name] = str(d / f"{name}.json")
        write_json(r, paths[name])
    return paths


def test_report_markdown_and_plots(results, tmp_path, capsys):
    md = tmp_path / "docs" / "results.md"
    plots = tmp_path / "docs" / "plots"
    argv = ["report", *results.values(), "--out", str(md), "--plots-dir", str(plots), "--title", "CPU smoke"]
    rc, text = run_bench(argv, capsys)
    assert rc == 0, text
    body = md.read_text()
    assert body.startswith("## CPU smoke")
    for heading in (
        "Sweep comparison",
        "Speed sweep",
        "Stream delivery",
        "Acceptance gates: PASS (6/6)",
        "Quality panel (teacher-forced)",
        "Quality panel reference",
        "Decode floor",
    ):
        assert heading in body, heading
    assert "Command: `tiermoe" in body or "Command: `" in body
    assert "| C2 |" in body and "C1 / floor" in body  # floor given: C1 rates as a share of it
    c1 = next(line for line in body.splitlines() if line.startswith("| C1 |"))
    assert c1.endswith(" % |")
    assert "| 1.000 | 0.0000 |" in body  # same model: top-1 1.0, KL 0
    for stem in ("sweep_a", "sweep_b", "stream"):
        png = plots / f"{stem}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC
        assert f"](plots/{stem}.png)" in body  # linked relative to the markdown file
    rc, _ = run_bench(["report", results["floor"], "--out", str(md), "--append"], capsys)
    assert rc == 0
    again = md.read_text()
    assert again.startswith(body) and again.count("Decode floor") == 2


def test_report_to_stdout_and_errors(results, tmp_path, capsys):
    rc, text = run_bench(["report", results["gates"]], capsys)
    assert rc == 0 and "| speed | PASS |" in text
    bad = tmp_path / "x.json"
    bad.write_text('{"kind": "something-else"}')
    rc, text = run_bench(["report", str(bad)], capsys)
    assert rc == 2 and "unknown result kind" in text
    rc, text = run_bench(["report", str(tmp_path / "missing.json")], capsys)
    assert rc == 2 and "no such file" in text


def test_report_carries_tier_counters_and_plots_them(tmp_path, capsys):
    """A sweep taken against a server with tier counters: the decode table gets slot hits / misses /
    CPU-lane experts per token beside each rate, the plot gains the tier panel and, with a floor
    result, the C1-over-floor panel (the figure is wider for it)."""
    from PIL import Image

    from .scripted_server import Behaviour, serve

    with serve(Behaviour(tier_rates=(30, 6))) as url:
        sweep = asyncio.run(run_sweep(SweepConfig(url=url, prefill_sizes=[32], reps=1, concurrency=[1, 2],
                                                  max_tokens=6, long_prompt_tokens=0)))
    paths = [str(tmp_path / "sweep.json"), str(tmp_path / "floor.json")]
    write_json(sweep, paths[0])
    write_json(envelope("floor", **decode_floor(13.4e6, 8, 42, fractions={"gpu": 0.385, "ram": 0.615})), paths[1])
    md = tmp_path / "r.md"
    rc, text = run_bench(["report", paths[0], "--out", str(md), "--plots-dir", str(tmp_path / "p")], capsys)
    assert rc == 0, text
    body = md.read_text()
    assert "slot hits / token" in body and "| 30.0 | 6.0 | 0.0 |" in body
    with Image.open(tmp_path / "p" / "sweep.png") as im:
        narrow = im.size[0]
    rc, text = run_bench(["report", *paths, "--out", str(md), "--plots-dir", str(tmp_path / "q")], capsys)
    assert rc == 0, text
    with Image.open(tmp_path / "q" / "sweep.png") as im:
        assert im.size[0] > narrow  # the floor panel joined the tier panel
