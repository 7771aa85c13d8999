"""`bench panel make|score`: the panel records the reference exactly; scoring matches an
independent teacher-forced computation on the scripted model, in both forcing modes."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from tiermoe.bench.panel import PanelMakeConfig, kl_over_reference, make_panel
from tiermoe.bench.results import write_json

from .conftest import load, run_bench
from .scripted_server import Behaviour, next_logprobs, serve, teacher_forced_oracle, tokenize


@pytest.fixture(scope="module")
def panel_file(tmp_path_factory, right_url):
    out = tmp_path_factory.mktemp("panel") / "panel.json"
    write_json(asyncio.run(make_panel(PanelMakeConfig(url=right_url, max_tokens=10))), str(out))
    return out


def test_panel_make_records_reference(panel_file):
    p = load(panel_file)
    assert p["kind"] == "tiermoe.bench.panel" and p["top_logprobs_returned"] == 20
    assert p["has_token_ids"] is False  # this server has no return_tokens_as_token_ids
    assert len(p["items"]) == 8
    b = Behaviour()
    for it in p["items"]:
        assert len(it["tokens"]) == len(it["top"]) == len(it["logprobs"]) == 10
        ctx = tokenize(it["prompt"])
        for i, tok in enumerate(it["tokens"]):
            dist = next_logprobs(ctx, b, i)
            assert it["top"][i][0][0] == tok == dist[0][0]  # greedy = argmax
            assert [t for t, _ in it["top"][i]] == [t for t, _ in dist[:20]]
            assert it["logprobs"][i] == pytest.approx(dist[0][1])
            ctx.append(tok)
        assert it["offsets"][0] == 0 and it["text"] == "".join(it["tokens"])


@pytest.mark.parametrize("mode", ["auto", "per-position"])
def test_score_same_model_is_perfect(panel_file, right_url, mode, tmp_path, capsys):
    out = tmp_path / "score.json"
    rc, text = run_bench(
        ["panel", "score", "--url", right_url, "--panel", str(panel_file), "--mode", mode, "--out", str(out)], capsys
    )
    assert rc == 0, text
    r = load(out)
    assert r["kind"] == "tiermoe.bench.panel-score"
    assert r["teacher_forcing"] == (["echo"] if mode == "auto" else ["per-position"])
    assert r["positions"] == 80 and r["top1_agreement"] == 1.0
    assert r["mean_kl"] == pytest.approx(0.0, abs=1e-9)
    assert r["greedy_match_fraction"] == 1.0 and r["greedy_exact_fraction"] == 1.0


def test_score_different_model_matches_oracle(panel_file, tmp_path, capsys):
    b = Behaviour(noise=4.0, has_echo=False)  # echo refused: auto falls back to per-position
    out = tmp_path / "score.json"
    with serve(b) as url:
        rc, text = run_bench(["panel", "score", "--url", url, "--panel", str(panel_file), "--out", str(out)], capsys)
    assert rc == 0, text
    r = load(out)
    top1, kl = teacher_forced_oracle(load(panel_file), b)
    assert r["teacher_forcing"] == ["per-position"]
    assert r["alignment_checked"] and r["positions_misaligned"] == 0 and r["positions"] == 80
    assert r["top1_agreement"] == pytest.approx(top1) and 0 < top1 < 1
    assert r["mean_kl"] == pytest.approx(kl) and kl > 0.01
    assert r["greedy_match_fraction"] < 1.0


def test_token_id_teacher_forcing(tmp_path, capsys):
    """A server that gives ids: the panel records them and scoring feeds exact id prefixes."""
    panel_path, score_path = tmp_path / "panel.json", tmp_path / "score.json"
    with serve(Behaviour(has_token_ids=True)) as ref_url:
        rc, text = run_bench(["panel", "make", "--url", ref_url, "--max-tokens", "6", "--out", str(panel_path)], capsys)
        assert rc == 0 and "with token ids" in text
        rc, text = run_bench(
            [
                "panel",
                "score",
                "--url",
                ref_url,
                "--panel",
                str(panel_path),
                "--mode",
                "token-ids",
                "--out",
                str(score_path),
            ],
            capsys,
        )
        assert rc == 0, text
    panel, r = load(panel_path), load(score_path)
    it = panel["items"][0]
    assert panel["has_token_ids"] and len(it["token_ids"]) == len(it["tokens"]) == len(it["top_ids"]) == 6
    assert len(it["prompt_ids"]) == len(tokenize(it["prompt"]))
    assert r["teacher_forcing"] == ["token-ids"] and r["positions"] == 48
    assert r["top1_agreement"] == 1.0 and r["mean_kl"] == pytest.approx(0.0, abs=1e-9)
    assert r["greedy_exact_fraction"] == 1.0
    # the same id-keyed panel scored on a server without ids falls back to text forcing
    b = Behaviour(noise=4.0)
    with serve(b) as url:
        rc, text = run_bench(
            ["panel", "score", "--url", url, "--panel", str(panel_path), "--out", str(score_path)], capsys
        )
    assert rc == 0, text
    r = load(score_path)
    assert r["teacher_forcing"] == ["echo"]
    assert r["top1_agreement"] == pytest.approx(teacher_forced_oracle(panel, b)[0])
    with serve(b) as url:
        rc, text = run_bench(
            ["panel", "score", "--url", url, "--panel", str(panel_path), "--mode", "token-ids"], capsys
        )
    assert rc == 2 and "return_tokens_as_token_ids" in text


def test_kl_over_reference():
    ref = [["a", math.log(0.5)], ["b", math.log(0.25)], ["c", math.log(0.25)]]
    assert kl_over_reference(ref, ref) == pytest.approx(0.0)
    test = [["b", math.log(0.5)], ["a", math.log(0.25)], ["c", math.log(0.25)]]
    want = 0.5 * math.log(0.5 / 0.25) + 0.25 * math.log(0.25 / 0.5)
    assert kl_over_reference(ref, test) == pytest.approx(want)
    # a reference token missing from the scored top-k gets the scored k-th logprob
    test2 = [["a", math.log(0.6)], ["b", math.log(0.2)]]
    q = [0.6, 0.2, 0.2]
    want2 = sum(p * math.log(p / (x / sum(q))) for p, x in zip([0.5, 0.25, 0.25], q))
    assert kl_over_reference(ref, test2) == pytest.approx(want2)


def test_prompts_file_and_errors(right_url, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "x", "prompt": "Hello there"}) + "\n" + json.dumps("Second one") + "\n")
    out = tmp_path / "panel.json"
    rc, text = run_bench(
        ["panel", "make", "--url", right_url, "--prompts", str(prompts), "--max-tokens", "3", "--out", str(out)], capsys
    )
    assert rc == 0, text
    assert [it["id"] for it in load(out)["items"]] == ["x", "p1"]
    bad = tmp_path / "bad.json"
    bad.write_text('[{"text": "no prompt key"}]')
    rc, text = run_bench(["panel", "make", "--url", right_url, "--prompts", str(bad), "--out", str(out)], capsys)
    assert rc == 2 and "needs a non-empty 'prompt'" in text
    bad.write_text('{"kind": "tiermoe.bench.sweep"}')
    rc, text = run_bench(["panel", "score", "--url", right_url, "--panel", str(bad)], capsys)
    assert rc == 2 and "not a panel" in text
