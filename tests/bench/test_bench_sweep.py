"""`bench sweep` against scripted servers: JSON shape, the protocol's arithmetic, fallbacks."""

from __future__ import annotations

import pytest

from tiermoe.bench.client import StreamEvent, StreamResult
from tiermoe.bench.results import parse_sizes
from tiermoe.errors import UserError

from .conftest import load, run_bench
from .scripted_server import Behaviour, serve


def test_sweep_json_and_rates(right_url, tmp_path, capsys):
    out = tmp_path / "sweep.json"
    argv = [
        "sweep",
        "--url",
        right_url,
        "--prefill-sizes",
        "64,128",
        "--reps",
        "3",
        "--concurrency",
        "1,2,4",
        "--max-tokens",
        "12",
        "--long-prompt",
        "256",
        "--seed",
        "1",
        "--out",
        str(out),
    ]
    rc, text = run_bench(argv, capsys)
    assert rc == 0, text
    r = load(out)
    assert r["kind"] == "tiermoe.bench.sweep" and r["version"] == 1
    assert r["model"] == "scripted-tiny" and r["max_model_len"] == 4096
    assert r["command"].startswith("tiermoe bench sweep")
    assert r["config"]["prefill_endpoint"] == "completions"
    assert [p["target_tokens"] for p in r["prefill"]] == [64, 128]
    for row in r["prefill"]:
        assert len(row["runs"]) == 3
        for run in row["runs"]:
            # sized through /tokenize to within 2 %, counted by the server's usage
            assert abs(run["prompt_tokens"] - row["target_tokens"]) <= max(1, 0.02 * row["target_tokens"])
            assert run["token_count_source"] == "usage"
            # the scripted server sleeps 2e-5 s per prompt token before the first token
            assert run["ttft_s"] >= run["prompt_tokens"] * 2e-5
            assert run["tok_s"] == pytest.approx(run["prompt_tokens"] / run["ttft_s"])
        assert row["median_tok_s"] == sorted(x["tok_s"] for x in row["runs"])[1]
    assert [d["concurrency"] for d in r["decode"]] == [1, 2, 4]
    for d in r["decode"]:
        (rnd,) = d["rounds"]
        assert len(rnd["streams"]) == d["concurrency"]
        assert all(s["completion_tokens"] == 12 and s["finish_reason"] == "length" for s in rnd["streams"])
        assert rnd["completion_tokens"] == 12 * d["concurrency"]
        assert d["aggregate_tok_s"] == pytest.approx(rnd["completion_tokens"] / rnd["wall_s"])
        # paced at 2 ms/token (500 tok/s); wide bounds: a busy machine delays and bunches events
        assert 20 < d["per_stream_tok_s"] < 2000
    lc = r["long_prompt_c1"]
    assert lc["prompt_tokens"] >= 256 and lc["completion_tokens"] == 12
    assert "decode C4" in text and "prefill" in text


def test_sweep_natural_end(right_url, tmp_path, capsys):
    out = tmp_path / "s.json"
    rc, text = run_bench(
        [
            "sweep",
            "--url",
            right_url,
            "--prefill-sizes",
            "32",
            "--reps",
            "1",
            "--concurrency",
            "1",
            "--long-prompt",
            "0",
            "--out",
            str(out),
        ],
        capsys,
    )
    assert rc == 0, text
    r = load(out)
    stream = r["decode"][0]["rounds"][0]["streams"][0]
    assert stream["completion_tokens"] == 24 and stream["finish_reason"] == "stop"  # the toy model's EOS
    assert r["long_prompt_c1"] is None


def test_sweep_falls_back_to_chat_and_estimate(tmp_path, capsys):
    b = Behaviour(has_tokenize=False, has_completions=False)
    out = tmp_path / "s.json"
    with serve(b) as url:
        rc, text = run_bench(
            [
                "sweep",
                "--url",
                url,
                "--prefill-sizes",
                "200",
                "--reps",
                "1",
                "--concurrency",
                "2",
                "--max-tokens",
                "4",
                "--long-prompt",
                "0",
                "--out",
                str(out),
            ],
            capsys,
        )
    assert rc == 0, text
    r = load(out)
    assert r["config"]["prefill_endpoint"] == "chat"
    run = r["prefill"][0]["runs"][0]
    assert run["token_count_source"] == "usage" and run["prompt_tokens"] > 50  # estimated size, real count


def test_sweep_without_stream_options(tmp_path, capsys):
    out = tmp_path / "s.json"
    with serve(Behaviour(reject_stream_options=True)) as url:
        rc, text = run_bench(
            [
                "sweep",
                "--url",
                url,
                "--prefill-sizes",
                "64",
                "--reps",
                "1",
                "--concurrency",
                "2",
                "--max-tokens",
                "5",
                "--long-prompt",
                "0",
                "--out",
                str(out),
            ],
            capsys,
        )
    assert rc == 0, text
    r = load(out)
    run = r["prefill"][0]["runs"][0]
    assert run["token_count_source"] == "tokenize" and abs(run["prompt_tokens"] - 64) <= 1
    streams = r["decode"][0]["rounds"][0]["streams"]
    assert all(s["token_count_source"] == "events" and s["completion_tokens"] == 5 for s in streams)


def test_unreachable_server_is_one_line(capsys):
    rc, text = run_bench(["sweep", "--url", "http://127.0.0.1:9", "--prefill-sizes", "8", "--reps", "1"], capsys)
    assert rc == 2
    assert "cannot connect" in text and "Traceback" not in text


def test_parse_sizes():
    assert parse_sizes("8k,32k", "x") == [8192, 32768]
    assert parse_sizes("256, 512", "x") == [256, 512]
    with pytest.raises(UserError):
        parse_sizes("8q", "x")
    with pytest.raises(UserError):
        parse_sizes("0", "x")


def test_per_stream_rate_uses_first_and_last_token():
    res = StreamResult(events=[StreamEvent(t=0.1)] + [StreamEvent(t=1.0 + 0.1 * i, text="x") for i in range(11)])
    res.usage = {"completion_tokens": 11}
    assert res.ttft == pytest.approx(1.0)
    assert res.per_stream_rate() == pytest.approx(10 / 1.0)


def test_sweep_records_tier_counters_per_decode_token(tmp_path, capsys):
    """Each decode row carries the slot hits and misses per decode token read from /stats around it."""
    out = tmp_path / "s.json"
    with serve(Behaviour(tier_rates=(30, 6))) as url:
        argv = f"sweep --url {url} --prefill-sizes 32 --reps 1 --concurrency 1,2 --max-tokens 8 --long-prompt 0"
        rc, text = run_bench([*argv.split(), "--out", str(out)], capsys)
    assert rc == 0, text
    for row in load(out)["decode"]:
        tiers = row["tiers_per_token"]
        assert tiers["decode_tokens"] == 8 * row["concurrency"]
        assert tiers["slot_hits"] == pytest.approx(30) and tiers["slot_misses"] == pytest.approx(6)
    assert "30.0 slot hits, 6.0 misses" in text
    assert all(row["tiers_per_token"]["static_bound"] is None for row in load(out)["decode"])


def test_sweep_prints_the_statistics_bound_beside_the_hits(tmp_path, capsys):
    """A server given routing statistics reports the static placement's slot hits; each decode line prints them."""
    out = tmp_path / "s.json"
    with serve(Behaviour(tier_rates=(30, 6), static_bound=28.25)) as url:
        argv = f"sweep --url {url} --prefill-sizes 32 --reps 1 --concurrency 1 --max-tokens 4 --long-prompt 0"
        rc, text = run_bench([*argv.split(), "--out", str(out)], capsys)
    assert rc == 0, text
    assert load(out)["decode"][0]["tiers_per_token"]["static_bound"] == 28.25
    assert "30.0 slot hits (static placement by the statistics: 28.2), 6.0 misses" in text


def test_sweep_without_stats_has_no_tier_counters(right_url, tmp_path, capsys):
    out = tmp_path / "s.json"
    argv = f"sweep --url {right_url} --prefill-sizes 32 --reps 1 --concurrency 1 --max-tokens 4 --long-prompt 0"
    rc, text = run_bench([*argv.split(), "--out", str(out)], capsys)
    assert rc == 0, text
    assert load(out)["decode"][0]["tiers_per_token"] is None and "slot hits" not in text


def test_prompt_sizing_survives_a_server_that_refuses_long_texts():
    """A server that refuses to count a text longer than its window (tiermoe's /tokenize does) must
    still get a prompt sized by its own count, not by the character estimate (which came out 2.6x too
    long for a tokenizer with many tokens per word)."""
    import asyncio
    import random

    from tiermoe.bench.prompts import sized_random_text

    async def count(text: str) -> int | None:  # 3 tokens a word; refuses more than 5000
        n = 3 * len(text.split())
        return None if n > 5000 else n

    text, n, source = asyncio.run(sized_random_text(random.Random(1), 4096, count))
    assert source == "tokenize" and abs(n - 4096) <= 82 and n == 3 * len(text.split())


def test_prompt_sizing_reaches_the_target_when_words_are_many_tokens():
    """A tokenizer that spends one token per character cannot be hit within one token by whole
    words (a word is ~7 tokens); the character bisection must land within the tolerance (2 %, at least one token) for any seed."""
    import asyncio
    import random

    from tiermoe.bench.prompts import sized_random_text

    async def count(text: str) -> int | None:
        return len(text)

    for seed in range(20):
        for target in (64, 256, 1000):
            text, n, source = asyncio.run(sized_random_text(random.Random(seed), target, count))
            assert source == "tokenize" and n == len(text) and abs(n - target) <= max(1, 0.02 * target), (seed, target, n)


def test_decode_prompts_random_words_are_another_mix(right_url, tmp_path, capsys):
    """--decode-prompts random asks each stream to continue 60 seeded random words (other routed
    experts than story requests): longer prompts, recorded in the config, same seed same words."""
    import random

    from tiermoe.bench.sweep import decode_prompt

    assert decode_prompt("story", 1, random.Random(0)).startswith("Write a story")
    a, b = decode_prompt("random", 0, random.Random(5)), decode_prompt("random", 0, random.Random(5))
    assert a == b and a.startswith("Continue this list of words:") and len(a.split()) > 60
    assert a != decode_prompt("random", 0, random.Random(6))
    lengths = {}
    for kind in ("story", "random"):
        out = tmp_path / f"{kind}.json"
        argv = ["sweep", "--url", right_url, "--prefill-sizes", "64", "--reps", "1", "--concurrency", "1,2",
                "--max-tokens", "4", "--long-prompt", "0", "--seed", "3", "--decode-prompts", kind, "--out", str(out)]
        rc, text = run_bench(argv, capsys)
        assert rc == 0, text
        r = load(out)
        assert r["config"]["decode_prompts"] == kind
        lengths[kind] = [s["prompt_tokens"] for d in r["decode"] for s in d["rounds"][0]["streams"]]
    assert max(lengths["story"]) < 40 < 60 < min(lengths["random"])
    with pytest.raises(SystemExit) as exc:  # argparse refuses another kind (exit 2)
        run_bench(["sweep", "--url", right_url, "--decode-prompts", "code"], capsys)
    assert exc.value.code == 2
