"""`bench stream-rate`: even delivery passes, the half-speed-then-flush defect fails."""

from __future__ import annotations

import pytest

from tiermoe.bench.stream_rate import delivery_bins, delivery_verdict

from .conftest import load, run_bench
from .scripted_server import Behaviour, serve

ARGS = ["--max-tokens", "60", "--tail-seconds", "0.02", "--bin-seconds", "0.1"]


@pytest.mark.parametrize("burst, rc_want, verdict", [(False, 0, "PASS"), (True, 1, "FAIL")])
def test_stream_rate_end_to_end(burst, rc_want, verdict, tmp_path, capsys):
    out = tmp_path / "sr.json"
    with serve(Behaviour(decode_s_per_token=0.02, natural_len=50, burst=burst)) as url:
        rc, text = run_bench(["stream-rate", "--url", url, *ARGS, "--out", str(out)], capsys)
    assert rc == rc_want, text
    assert text.startswith(verdict)
    r = load(out)
    assert r["kind"] == "tiermoe.bench.stream-rate" and r["verdict"] == verdict
    assert r["completion_tokens"] == 50 and r["events"] == 50
    assert r["timeline"][-1][1] == r["total_chars"]
    assert sum(b["events"] for b in r["bins"]) == 50
    if burst:  # half the text arrives in the final flush
        assert r["fraction_in_tail"] >= 0.45 and r["fraction_by_midpoint"] < 0.40
    else:
        assert r["fraction_by_midpoint"] >= 0.40 and r["fraction_in_tail"] <= 0.10
        assert 20 < r["per_stream_tok_s"] < 55  # paced at 20 ms/token


def test_verdict_rule():
    even = [(1.0 + 0.05 * i, 4) for i in range(200)]  # 10 s, even
    assert delivery_verdict(even)["pass"]
    burst = [(1.0 + 0.1 * i, 4) for i in range(50)] + [(6.0, 200)]  # half in one flush at the end
    v = delivery_verdict(burst)
    assert not v["pass"] and v["fraction_in_tail"] == pytest.approx((200 + 9 * 4) / 400)  # flush + 9 events after t=5
    late_start = [(1.0 + 0.05 * i, 1 if i < 100 else 7) for i in range(200)]  # slow first half
    v = delivery_verdict(late_start)
    assert not v["pass"] and v["fraction_by_midpoint"] < 0.40
    assert not delivery_verdict([])["pass"]


def test_bins_count_events_per_second():
    arrivals = [(0.5 + 0.1 * i, 3) for i in range(25)]  # 10 events/s for 2.5 s
    bins = delivery_bins(arrivals, 1.0, 1.0)
    assert [b["events"] for b in bins] == [10, 10, 5]
    assert bins[0]["tok_s"] == pytest.approx(10.0)
