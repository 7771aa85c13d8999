"""Speculative-decoding counters on /metrics: a real server on the tiny glm5_next with MTP
drafting on, scraped over HTTP after greedy requests; the series equal the engine's own counters."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from testkit.servers import ServerThread


@pytest.fixture(scope="module")
def drafting_server(tiny_dir):
    from tiermoe.engine.async_engine import AsyncEngine
    from tiermoe.engine.build import build_engine_core
    from tiermoe.server.app import create_app

    core = build_engine_core(str(tiny_dir("glm5_next")), device="cpu", dtype="float32", max_model_len=256,
                             max_num_seqs=4, options={"num_speculative_tokens": 2})
    app = create_app(AsyncEngine(core), served_model_name="tiny", max_model_len=256)
    with ServerThread(app) as server:
        yield server, core


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a Prometheus text exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _greedy(http, prompt: list[int], n: int) -> tuple[list[int], str]:
    """The model's greedy continuation, ids and text (a logprobs request: never drafted)."""
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0,
                                           "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]], choice["text"]


def _script_drafts(core, truth: dict[tuple, list[int]]) -> None:
    """Replace the random MTP head's drafts with the true next tokens, the second one made wrong
    at every other verify step, so acceptances at both positions and rejections all happen
    (the real catch-up and drafting still run; verification is the engine's own)."""
    spec = core.runner.spec
    real, count = spec.prepare, [0]

    def prepare(items):
        drafts = real(items)
        for i, d in drafts.items():
            req = items[i][0]
            t, o = truth[tuple(req.prompt_ids)], len(req.output_ids)
            drafts[i] = [t[o + j] if (j == 0 or count[0] % 2) else (t[o + j] + 1) % 500 for j in range(len(d))]
            count[0] += 1
        return drafts

    spec.prepare = prepare


def test_spec_decode_counters_on_metrics(drafting_server):
    server, core = drafting_server
    prompts = [[5, 17, 33, 8, 120, 64, 9], [300, 41, 7, 250, 11]]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        plain = {tuple(p): _greedy(http, p, 12) for p in prompts}
        truth = {key: ids + [0] * 3 for key, (ids, _) in plain.items()}
        assert "speculative" not in core.stats() or core.stats()["speculative"]["verify_steps"] == 0
        _script_drafts(core, truth)
        for p in prompts:
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 0,
                                                   "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
            assert r.json()["choices"][0]["text"] == plain[tuple(p)][1]
        scrape = http.get("/metrics")
    assert scrape.status_code == 200
    got = _samples(scrape.text)
    spec = core.stats()["speculative"]  # idle engine: the same numbers the scrape saw
    assert 0 < spec["accepted"] < spec["drafted"] and spec["verify_steps"] > 0
    assert got[("tiermoe_spec_decode_num_drafts_total", ())] == spec["verify_steps"]
    assert got[("tiermoe_spec_decode_num_draft_tokens_total", ())] == spec["drafted"]
    assert got[("tiermoe_spec_decode_num_accepted_tokens_total", ())] == spec["accepted"]
    assert got[("tiermoe_spec_decode_num_emitted_tokens_total", ())] == spec["emitted"] \
        == spec["accepted"] + spec["verify_steps"]
    per_pos = [got[("tiermoe_spec_decode_num_accepted_tokens_per_pos_total", (("position", str(j)),))]
               for j in range(2)]
    # the first draft is always right; the second at every other verify step only
    assert per_pos[0] == spec["verify_steps"] and 0 < per_pos[1] < per_pos[0]
    assert sum(per_pos) == spec["accepted"]
    assert got[("tiermoe_spec_decode_num_speculative_tokens", ())] == 2
    assert got[("tiermoe_spec_decode_draft_acceptance_rate", ())] == pytest.approx(spec["accepted"] / spec["drafted"],
                                                                                   abs=1e-4)
    assert got[("tiermoe_generation_tokens_total", ())] == 4 * 12  # each token once, however many a step brought


def test_no_spec_decode_series_without_drafting(server):
    """The scripted engine (no drafter) exports no tiermoe_spec_decode_* series at all."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    assert "tiermoe_requests_running" in text and "tiermoe_spec_decode" not in text
