"""`bench lane`: one table row per (kind, threads, tokens) beside the host read GB/s of the same
run, the JSON result, records from a packed store, and one-line errors for bad input."""

from __future__ import annotations

import pytest

from .conftest import load, run_bench

TINY = ["--hidden", "64", "--inter", "32", "--group-size", "32", "--pool-gb", "0.0005", "--seconds", "0.02",
        "--experts", "2"]


def test_table_and_json(tmp_path, capsys):
    out = tmp_path / "lane.json"
    rc, text = run_bench(["lane", *TINY, "--kinds", "int4,bf16", "--threads", "1", "--tokens", "1,3",
                          "--out", str(out)], capsys)
    assert rc == 0, text
    r = load(out)
    assert r["kind"] == "tiermoe.bench.lane" and r["shape"] == {"hidden": 64, "inter": 32, "group_size": 32}
    assert [(row["kind"], row["threads"], row["tokens"]) for row in r["rows"]] == [
        ("int4", 1, 1), ("int4", 1, 3), ("bf16", 1, 1), ("bf16", 1, 3)]
    for row in r["rows"]:
        assert row["gbs"] > 0 and row["ms_per_expert"] > 0 and row["host_read_gbs"] == r["host_read_gbs"]["1"]
        assert row["share_of_host"] == pytest.approx(row["gbs"] / row["host_read_gbs"])
    assert "lane GB/s" in text and text.count("int4 ") == 2


def test_records_from_a_store(tiny_dir, tmp_path_factory, capsys):
    from testkit.stores import pack_tiny

    store = pack_tiny(tiny_dir, tmp_path_factory, "glm4_moe", quant="int8", group_size=32)[1]
    rc, text = run_bench(["lane", "--store", str(store), "--threads", "1", "--tokens", "2", "--seconds", "0.02",
                          "--experts", "2"], capsys)
    assert rc == 0, text
    assert "int8 " in text


@pytest.mark.parametrize("argv,msg", [(["--kinds", "fp8"], "--kinds"), (["--threads", "0"], "--threads"),
                                      (["--tokens", "x"], "--tokens"), (["--inter", "30"], "group-size")])
def test_bad_input_is_one_line_exit_2(argv, msg, capsys):
    rc, text = run_bench(["lane", *TINY, *argv], capsys)
    assert rc == 2 and msg in text
