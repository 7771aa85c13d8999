"""`bench floor` / decode_floor: the digest's worked example and the lane arithmetic."""

from __future__ import annotations

import pytest

from tiermoe.store.floor import Bandwidths, decode_floor, fraction_of_floor, parse_bytes, parse_tier_map
from tiermoe.errors import UserError

from .conftest import load, run_bench

INT4 = 13.4e6  # GLM-5.3-Flash routed expert at int4 with group-128 scales
MISS = 1 - 0.385  # static top-33 per layer covers 38.5 % of picks


def test_worked_example_pcie_cpu_and_both():
    pcie = decode_floor(INT4, 8, 42, fractions={"gpu": 0.385, "ram": MISS})
    assert pcie["picks_per_token"] == 336 and pcie["reads_per_token"]["ram"] == pytest.approx(206.6, abs=0.1)
    assert pcie["bound"] == "pcie" and pcie["moe_ms"] == pytest.approx(50.4, abs=0.5)  # "about 50 ms"
    cpu = decode_floor(INT4, 8, 42, fractions={"gpu": 0.385, "cpu": MISS})
    assert cpu["bound"] == "cpu" and 50 < cpu["moe_ms"] < 56  # "about 51 ms"
    both = decode_floor(INT4, 8, 42, fractions={"gpu": 0.385, "ram": MISS}, balance_host=True)
    assert 25 <= both["floor_ms"] <= 30 and 33 <= both["tok_s"] <= 40  # "a floor near 33-40 tok/s"
    assert both["lanes"]["pcie"]["ms"] == pytest.approx(both["lanes"]["cpu"]["ms"])  # both lanes finish together
    assert both["host_split"]["pcie_share_of_host_reads"] == pytest.approx(55 / 106)


def test_hits_disk_bound_and_non_moe():
    f = decode_floor(9.44e6, 8, 42, hits={"gpu": 120, "ram": 175, "disk": 23}, non_moe_ms=10.0)
    assert f["bound"] == "disk"
    assert f["lanes"]["disk"]["ms"] == pytest.approx(23 * 9.44e6 / 1.6e9 * 1e3)
    assert f["lanes"]["pcie"]["bytes_per_token"] == pytest.approx((175 + 23) * 9.44e6)  # disk reads cross PCIe too
    assert f["floor_ms"] == pytest.approx(f["lanes"]["disk"]["ms"] + 10.0)
    assert f["tok_s"] == pytest.approx(1e3 / f["floor_ms"])
    assert fraction_of_floor(f["tok_s"] / 2, f) == pytest.approx(0.5)


def test_shared_host_bandwidth_lane():
    bw = Bandwidths(host_gbs=74.0)
    f = decode_floor(INT4, 8, 42, fractions={"ram": 0.5, "cpu": 0.5}, bandwidths=bw)
    assert f["lanes"]["host"]["bytes_per_token"] == pytest.approx(336 * INT4)
    assert f["bound"] == "host"


def test_input_errors():
    with pytest.raises(UserError):
        decode_floor(INT4, 8, 42)
    with pytest.raises(UserError):
        decode_floor(INT4, 8, 42, fractions={"gpu": 0.7, "ram": 0.6})
    with pytest.raises(UserError):
        parse_tier_map("vram=3", "--hits")
    assert parse_bytes("9MiB") == 9 * 2**20 and parse_bytes("13.4MB") == pytest.approx(13.4e6)
    with pytest.raises(UserError):
        parse_bytes("13 parsecs")


def test_floor_cli(tmp_path, capsys):
    out = tmp_path / "floor.json"
    rc, text = run_bench(
        [
            "floor",
            "--bytes-per-expert",
            "13.4MB",
            "--top-k",
            "8",
            "--moe-layers",
            "42",
            "--fractions",
            "gpu=0.385,ram=0.615",
            "--balance-host",
            "--non-moe-ms",
            "2",
            "--measured-tok-s",
            "20",
            "--out",
            str(out),
        ],
        capsys,
    )
    assert rc == 0, text
    r = load(out)
    assert r["kind"] == "tiermoe.bench.floor" and r["bound"] in ("pcie", "cpu")
    assert r["floor_ms"] == pytest.approx(r["moe_ms"] + 2)
    assert r["fraction_of_floor"] == pytest.approx(20 / r["tok_s"])
    assert "<- bound" in text and "of the floor" in text
    rc, text = run_bench(
        ["floor", "--bytes-per-expert", "1MB", "--top-k", "8", "--moe-layers", "4", "--fractions", "gpu=2"], capsys
    )
    assert rc == 2 and "add up to" in text
