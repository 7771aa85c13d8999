"""The overload script, short: 4x --max-num-seqs clients against `tiermoe serve --scripted`
with a small queue, so the server must turn clients away with 429 + Retry-After while every
admitted stream completes, and its memory comes back to the baseline."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from reliability_util import ENV, ROOT, ServeProcess


@pytest.mark.slow
def test_overload_short(tmp_path):
    out = tmp_path / "overload.json"
    with ServeProcess(["--scripted", "--scripted-step-delay", "0.004", "--max-num-seqs", "2", "--max-queue", "2",
                       "--log-level", "warning"]) as server:
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "overload.py"), "--url", server.url, "--max-num-seqs", "2",
                            "--duration", "6", "--settle", "5", "--warmup", "2", "--json", str(out)],
                           capture_output=True, text=True, env=ENV, timeout=120)
        assert server.proc.poll() is None, server.stderr[-2000:]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["clients"] == 8 and report["server_pid"] == server.proc.pid
    assert report["other_errors"] == 0 and report["completed"] > 20
    assert report["rejected_429"] > 0 and set(report["retry_after_values"]) == {"1"}
    assert report["finish_reasons"] == {"length": report["completed"]}
    assert report["latency_s"]["p99"] < 5
    rss = report["rss_mb"]
    assert rss["after"] - rss["baseline"] <= rss["tolerance"] and rss["peak"] >= rss["baseline"]
    assert report["health_after"] == 200 and report["passed"]
