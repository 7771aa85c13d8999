"""`tiermoe plan --disk-gbs auto|GBS`: the bound's disk lane at the disk's own read rate, measured
on the store's experts.bin (read only, as the disk tier reads it) when some experts live only on
disk, or given."""

import pytest

from tiermoe.cli import main
from tiermoe.store.disk import measure_read_gbs
from tiermoe.store.planner import build_plan
from tiermoe.store.records import load_manifest

TINY_HOST_GB = 1e-9  # no expert fits in host RAM: every one lives only on disk


@pytest.fixture
def bf16_store(packed_bf16):
    return packed_bf16[0]  # 2 MoE layers x 8 bf16 experts


def test_measure_read_gbs_reads_records_spread_over_the_file(bf16_store):
    m = load_manifest(bf16_store)
    rec = m.records[0].length
    gbs, nbytes, mode = measure_read_gbs(m.experts_path, m.records, max_bytes=3 * rec, threads=2)
    assert gbs > 0 and nbytes == 3 * rec and mode in ("O_DIRECT", "buffered")
    _, everything, _ = measure_read_gbs(m.experts_path, m.records, max_bytes=1 << 40)
    assert everything == sum(r.length for r in m.records)  # capped by the store, not by max_bytes


def test_a_given_disk_rate_sets_the_bound_disk_lane(bf16_store):
    m = load_manifest(bf16_store)
    plan = build_plan(m, device="cpu", gpu_expert_gb=0, host_expert_gb=TINY_HOST_GB, disk_gbs=3.2)
    assert plan.n_disk == len(m.records)
    disk_bytes = plan.hits_per_token["disk"] * m.record_bytes
    assert plan.floor_s["disk"] == pytest.approx(disk_bytes / 3.2e9)
    slower = build_plan(m, device="cpu", gpu_expert_gb=0, host_expert_gb=TINY_HOST_GB, disk_gbs=0.8)
    assert slower.floor_s["disk"] == pytest.approx(4 * plan.floor_s["disk"])


def test_plan_measures_the_disk_only_when_experts_live_there(bf16_store, capsys):
    assert main(["plan", str(bf16_store), "--device", "cpu", "--host-expert-gb", str(TINY_HOST_GB)]) == 0
    out = capsys.readouterr().out
    assert "note: disk: " in out and "GB/s measured now" in out and str(bf16_store) in out
    assert main(["plan", str(bf16_store), "--device", "cpu"]) == 0  # all in host RAM: nothing to measure
    assert "measured now" not in capsys.readouterr().out
    assert main(["plan", str(bf16_store), "--device", "cpu", "--host-expert-gb", str(TINY_HOST_GB),
                 "--disk-gbs", "2.5"]) == 0  # given: not measured
    assert "measured now" not in capsys.readouterr().out


@pytest.mark.parametrize("value", ["0", "-1", "fast", "nan", "inf"])
def test_a_bad_disk_rate_is_one_error_line_and_exit_2(bf16_store, capsys, value):
    with pytest.raises(SystemExit) as exc:
        main(["plan", str(bf16_store), "--disk-gbs", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--disk-gbs" in err and "not auto or a rate in GB/s above 0" in err and "Traceback" not in err


def test_a_failed_disk_measurement_is_a_note_and_the_plan_still_prints(bf16_store, capsys, monkeypatch):
    from tiermoe.store import disk
    from tiermoe.store.disk import StoreIOError

    def failing(*_, **__):
        raise StoreIOError("I/O error reading layer 0 expert 0 (errno 5)")

    monkeypatch.setattr(disk, "measure_read_gbs", failing)
    assert main(["plan", str(bf16_store), "--device", "cpu", "--host-expert-gb", str(TINY_HOST_GB)]) == 0
    out = capsys.readouterr().out
    assert "note: disk: not measured (I/O error reading layer 0 expert 0 (errno 5)); 1.6 GB/s assumed" in out
    assert "decode upper bound" in out
