"""Prompts cut by the step budget are cut on block edges when the family asks for it."""

from __future__ import annotations

from tiermoe.protocol import SamplingParams
from tiermoe.scheduler.kv_pages import KVPages
from tiermoe.scheduler.request import Request
from tiermoe.scheduler.scheduler import Scheduler


def _run(prompt_lens, budget, multiple):
    sched = Scheduler(KVPages(256, 16), max_num_seqs=4, max_batched_tokens=budget, chunk_multiple=multiple)
    reqs = [Request(str(i), [1] * n, SamplingParams(max_tokens=4), i) for i, n in enumerate(prompt_lens)]
    for r in reqs:
        sched.add(r)
    cuts = {r.request_id: [] for r in reqs}
    for _ in range(50):
        batch = sched.schedule()
        if not batch:
            break
        assert sum(n for _, n in batch.items) <= budget
        for req, n in batch.items:
            if req.num_computed < len(req.prompt_ids):
                cuts[req.request_id].append((req.num_computed, n))
            req.num_computed += n
            if req.num_computed >= len(req.prompt_ids) and not req.output_ids:
                req.output_ids.append(0)  # one decode token: the prompt is done
        if all(r.num_computed >= len(r.prompt_ids) for r in reqs):
            break
    return cuts


def test_cuts_fall_on_block_edges():
    cuts = _run([150, 70, 10, 200], budget=100, multiple=64)
    for req_cuts in cuts.values():
        for start, n in req_cuts:
            assert start % 64 == 0  # every piece starts on an edge; only a prompt's last piece may end off one
    assert sum(n for _, n in cuts["0"]) == 150 and sum(n for _, n in cuts["3"]) == 200


def test_plain_cuts_without_a_multiple_and_when_the_budget_is_smaller_than_a_block():
    assert _run([40], budget=16, multiple=1)["0"] == [(0, 16), (16, 16), (32, 8)]
    assert _run([40], budget=16, multiple=64)["0"] == [(0, 16), (16, 16), (32, 8)]
