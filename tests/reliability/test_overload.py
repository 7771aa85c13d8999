"""The overload script, short: 4x --max-num-seqs clients against `tiermoe serve --scripted`
with a small queue, so the server must turn clients away with 429 + Retry-After while every
admitted stream completes, and its memory comes back to the baseline."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from reliability_util import ROOT, ServeProcess


def _overload_module():
    spec = importlib.util.spec_from_file_location("overload_script", ROOT / "scripts" / "overload.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_overload_short(tmp_path):
    out = tmp_path / "overload.json"
    overload = _overload_module()
    with ServeProcess(["--scripted", "--scripted-step-delay", "0.004", "--max-num-seqs", "2", "--max-queue", "2",
                       "--log-level", "warning"]) as server:
        rc = overload.main(["--url", server.url, "--max-num-seqs", "2", "--duration", "4", "--settle", "5",
                            "--warmup", "2", "--json", str(out)])
        assert server.proc.poll() is None, server.stderr[-2000:]
    report = json.loads(out.read_text())
    assert rc == 0, report
    assert report["clients"] == 8 and report["server_pid"] == server.proc.pid
    assert report["other_errors"] == 0 and report["completed"] > 10
    assert report["rejected_429"] > 0 and set(report["retry_after_values"]) == {"1"}
    assert report["finish_reasons"] == {"length": report["completed"]}
    assert report["latency_s"]["p99"] < 5
    rss = report["rss_mb"]
    assert rss["after"] - rss["baseline"] <= rss["tolerance"] and rss["peak"] >= rss["baseline"]
    assert report["health_after"] == 200 and report["passed"]
