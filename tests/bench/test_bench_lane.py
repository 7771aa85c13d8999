"""`bench lane`: one table row per (kind, threads, tokens) beside the host read GB/s of the same
run, int3 (and the other kinds) beside int4, the JSON result, records from a packed store, and
one-line errors for bad input."""

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


def test_int3_beside_int4(tmp_path, capsys):
    """Two rounds (--repeat): still one row per cell, the fastest round's, and int3 compared with int4."""
    out = tmp_path / "lane.json"
    rc, text = run_bench(["lane", *TINY, "--kinds", "int4,int3", "--threads", "1", "--tokens", "1,2", "--repeat", "2",
                          "--out", str(out)], capsys)
    assert rc == 0, text
    r = load(out)
    assert r["repeat"] == 2
    assert [(row["kind"], row["tokens"]) for row in r["rows"]] == [("int4", 1), ("int4", 2), ("int3", 1), ("int3", 2)]
    assert all(row["kernel"].startswith(("native-", "torch")) and row["gbs"] > 0 for row in r["rows"])
    rows = {(row["kind"], row["tokens"]): row for row in r["rows"]}
    assert [(v["kind"], v["threads"], v["tokens"]) for v in r["versus_int4"]] == [("int3", 1, 1), ("int3", 1, 2)]
    for v in r["versus_int4"]:
        mine, base = rows[("int3", v["tokens"])], rows[("int4", v["tokens"])]
        assert v["ms_per_expert"] == mine["ms_per_expert"] and v["int4_ms_per_expert"] == base["ms_per_expert"]
        assert v["ms_ratio"] == pytest.approx(mine["ms_per_expert"] / base["ms_per_expert"])
        assert v["share_of_host"] == mine["share_of_host"] and v["int4_share_of_host"] == base["share_of_host"]
    assert "ms vs int4" in text and text.count("int3 ") == 4  # two table rows, two comparison rows


@pytest.mark.parametrize("quant", ["int8", "int3"])
def test_records_from_a_store(tiny_dir, tmp_path_factory, capsys, quant):
    from testkit.stores import pack_tiny

    store = pack_tiny(tiny_dir, tmp_path_factory, "glm4_moe", quant=quant, group_size=32)[1]
    rc, text = run_bench(["lane", "--store", str(store), "--threads", "1", "--tokens", "2", "--seconds", "0.02",
                          "--experts", "2"], capsys)
    assert rc == 0, text
    assert f"{quant} " in text


@pytest.mark.parametrize("argv,msg", [(["--kinds", "fp8"], "--kinds"), (["--threads", "0"], "--threads"),
                                      (["--tokens", "x"], "--tokens"), (["--inter", "30"], "group-size"),
                                      (["--repeat", "0"], "--repeat"), (["--item-rows", "x"], "--item-rows"),
                                      (["--item-rows", "16:0"], "--item-rows"), (["--ahead-rows", "-1"], "--ahead-rows"),
                                      (["--prefetch-hint", "4"], "--prefetch-hint"), (["--busy", "-1"], "--busy"),
                                      (["--set-up", "c"], "--set-up")])
def test_bad_input_is_one_line_exit_2(argv, msg, capsys):
    rc, text = run_bench(["lane", *TINY, *argv], capsys)
    assert rc == 2 and msg in text and "lane GB/s" not in text  # before the table's header


def test_tunings_and_a_busy_core(tmp_path, capsys):
    """Each tuning is its own row (labelled), with one spinning process beside the lane."""
    out = tmp_path / "lane.json"
    rc, text = run_bench(["lane", *TINY, "--kinds", "int4", "--threads", "1", "--tokens", "1", "--item-rows",
                          "16:16,4:2", "--ahead-rows", "0,2", "--prefetch-hint", "3", "--busy", "1", "--out", str(out)],
                         capsys)
    assert rc == 0, text
    r = load(out)
    labels = [row["tuning"] for row in r["rows"]]
    assert r["busy"] == 1 and labels == ["16:16 ahead 0 hint 3", "16:16 ahead 2 hint 3", "4:2 ahead 0 hint 3",
                                         "4:2 ahead 2 hint 3"]
    assert all(row["gbs"] > 0 for row in r["rows"]) and "4:2 ahead 2 hint 3" in text


def test_set_ups_side_by_side(tmp_path, capsys):
    """--set-up compiled,python: one row each, labelled; the compiled set-up (the mailbox's path) is the default."""
    out = tmp_path / "lane.json"
    rc, text = run_bench(["lane", *TINY, "--kinds", "int4", "--threads", "1", "--tokens", "2",
                          "--set-up", "compiled,python", "--out", str(out)], capsys)
    assert rc == 0, text
    rows = load(out)["rows"]
    assert [r["set_up"] for r in rows] == ["compiled", "python"]
    assert all(r["us_per_call"] > 0 for r in rows)
    assert "compiled" in text and "python" in text
    rc, text = run_bench(["lane", *TINY, "--kinds", "int4", "--threads", "1", "--tokens", "1", "--out", str(out)],
                         capsys)
    assert rc == 0 and [r["set_up"] for r in load(out)["rows"]] == ["compiled"]
