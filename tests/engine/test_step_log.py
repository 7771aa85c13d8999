"""The engine's step log (`serve --log-level debug`): one line a step, naming prefill and decode steps."""

from __future__ import annotations

import logging
import re

from tiermoe.engine.build import build_engine_core
from tiermoe.engine.llm_engine import generate_ids
from tiermoe.protocol import SamplingParams

LINE = re.compile(r"step (\d+): (prefill|decode|mixed), (\d+) sequences, (\d+) tokens, [\d.]+ ms")


def test_step_log_names_each_step(tiny_dir, caplog):
    engine = build_engine_core(str(tiny_dir("glm4_moe")), device="cpu", dtype="float32", max_num_seqs=2,
                               options={})
    with caplog.at_level(logging.DEBUG, logger="tiermoe.engine.steps"):
        generate_ids(engine, [[5, 6, 7, 8, 9], [3, 4]], SamplingParams(max_tokens=4, ignore_eos=True))
    lines = [LINE.match(r.getMessage()) for r in caplog.records if r.name == "tiermoe.engine.steps"]
    assert lines and all(lines)
    kinds = [(m.group(2), int(m.group(3)), int(m.group(4))) for m in lines]
    assert kinds[0] == ("prefill", 2, 7)  # both prompts in one step
    assert kinds[1:] == [("decode", 2, 2)] * 3  # then one token for each, until the fourth
    assert "after the last" in caplog.records[-1].getMessage()


def test_step_log_is_silent_at_info(tiny_dir, caplog):
    engine = build_engine_core(str(tiny_dir("glm4_moe")), device="cpu", dtype="float32", max_num_seqs=2,
                               options={})
    with caplog.at_level(logging.INFO, logger="tiermoe.engine.steps"):
        generate_ids(engine, [[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert not [r for r in caplog.records if r.name == "tiermoe.engine.steps"]
