"""The bench group through the real `tiermoe` dispatcher, and extra modules joining it."""

from __future__ import annotations

import argparse
import sys

from tiermoe.bench import cli as bench_cli


def test_bench_floor_through_main(capsys):
    from tiermoe.cli import main

    rc = main(
        [
            "bench",
            "floor",
            "--bytes-per-expert",
            "9.44MB",
            "--top-k",
            "8",
            "--moe-layers",
            "42",
            "--hits",
            "gpu=120,ram=175,disk=23",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "<- bound" in out and '"bound": "disk"' in out


def test_extra_modules_register_and_missing_are_skipped(tmp_path, monkeypatch):
    pkg = tmp_path / "benchextra_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "decode.py").write_text(
        "def register(sub):\n    p = sub.add_parser('decode')\n    p.set_defaults(handler=lambda args: 7)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(bench_cli, "BENCH_EXTRA_MODULES", ("benchextra_pkg.decode", "benchextra_pkg.moe_gpu"))
    parser = argparse.ArgumentParser()
    bench_cli.register(parser.add_subparsers())
    args = parser.parse_args(["bench", "decode"])
    assert args.handler(args) == 7
    sys.modules.pop("benchextra_pkg.decode", None)
    sys.modules.pop("benchextra_pkg", None)


def test_default_extra_modules_include_the_in_process_benchmarks():
    import importlib

    assert {"tiermoe.bench.decode", "benchmarks.moe_gpu"} <= set(bench_cli.BENCH_EXTRA_MODULES)
    for name in bench_cli.BENCH_EXTRA_MODULES:  # every listed module exists and registers
        assert callable(importlib.import_module(name).register)


def test_bench_decode_says_whether_graphs_ran():
    """`bench decode` prints whether its steps replayed decode graphs (its figures mean little without)."""
    from tiermoe.bench.decode import describe_graphs

    assert describe_graphs(None) == "decode CUDA graphs: off (eager steps)"
    assert "failed (recording batch size 1 failed" in describe_graphs({"failed": "recording batch size 1 failed"})
    assert describe_graphs({"captured_batch_sizes": [1, 4], "replays": 130, "failed": None}) == (
        "decode CUDA graphs: batch sizes [1, 4] recorded, 130 replays")


def test_bench_decode_prints_how_the_tiers_served_each_figure(tiny_dir, tmp_path, capsys):
    """On a packed store each tok/s line carries the slot hits and misses per decode token, as `bench sweep`'s do,
    and the JSON row the same counts (the decode tokens of its round only, not the warm-up's)."""
    import json

    from tiermoe.cli import main
    from tiermoe.store.pack import pack

    store = tmp_path / "store"
    pack(str(tiny_dir("glm4_moe")), str(store), quant="bf16", progress=False)
    out = tmp_path / "decode.json"
    rc = main(["bench", "decode", "--model", str(store), "--device", "cpu", "--dtype", "float32", "--batch-sizes",
               "1,2", "--tokens", "6", "--gpu-expert-gb", "0", "--no-direct-io", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    lines = [line for line in text.splitlines() if line.startswith("decode batch")]
    assert len(lines) == 2 and all("slot hits" in line and "misses" in line for line in lines), lines
    for row in json.loads(out.read_text())["results"]:
        tiers = row["tiers_per_token"]
        assert tiers["decode_tokens"] == row["tokens"]  # a decode forward for every token after the prefill's
        assert tiers["slot_hits"] + tiers["slot_misses"] > 0
