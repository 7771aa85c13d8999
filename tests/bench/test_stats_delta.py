"""scripts/stats_delta.py, the per-sweep counters docs/results.md cites, on a recorded pair of /stats snapshots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RAW = ROOT / "docs" / "data" / "real-routing-2026-12-04"


def delta(tag: str) -> dict:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "stats_delta.py"),
                           str(RAW / f"stats-before-glm-synthetic-0.11-{tag}.json"),
                           str(RAW / f"stats-glm-synthetic-0.11-{tag}.json")],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_the_lane_rate_and_counters_of_a_fast_sweep():
    out = delta("fast")
    assert out["decode_tokens"] == 634
    assert out["cpu_lane.experts"] == {"total": 33512, "per_decode_token": 52.86}
    assert out["cpu_lane_gbs"] == 81.47  # weight bytes over busy seconds in the window, not the server's life
    assert "disk_bytes_over_wait_s_gbs" not in out  # no disk tier in this server


def test_the_disk_tier_counters_of_a_disk_sweep():
    out = delta("exact-device_cache_on___host_share_0.4")
    assert out["device_cache.disk_tier.decode_reads"]["per_decode_token"] == 22.57
    assert out["device_cache.disk_tier.prefetch_wasted"]["total"] == 0
    assert out["disk_bytes_over_wait_s_gbs"] == 4.55  # read-ahead's bytes over requests' waits: not a disk rate
    assert out["disk_bytes_over_wait_s_gbs_server_life"] == 2.52
    assert out["cpu_lane_gbs"] is None  # exact mode: no lane
