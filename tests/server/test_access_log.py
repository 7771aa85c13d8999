"""The server's traffic log: one access line per finished request, and vLLM's periodic throughput
line while (and only while) there is traffic."""

import asyncio
import logging
import re
from types import SimpleNamespace

from tiermoe.engine.async_engine import AsyncEngine
from tiermoe.engine.scripted import ScriptedEngineCore
from tiermoe.protocol import SamplingParams
from tiermoe.server.access_log import REQUESTS_LOGGER, STATS_LOGGER
from tiermoe.server.live_stats import ThroughputLog, throughput_line
from tiermoe.server.metrics import Metrics


def test_access_line_per_finished_request(client, caplog):
    caplog.set_level(logging.INFO, logger=REQUESTS_LOGGER)
    r = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "Tell me a story"}],
                                       max_tokens=12)
    lines = [rec.getMessage() for rec in caplog.records if rec.name == REQUESTS_LOGGER and r.id in rec.getMessage()]
    assert len(lines) == 1, lines
    line = lines[0]
    cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
    assert line.startswith(f"{r.id}-0 /v1/chat/completions: prompt {r.usage.prompt_tokens} tokens ({cached} cached), "
                           f"completion {r.usage.completion_tokens} tokens, finish length, ")
    assert re.search(r"\d+\.\d tok/s, first token \d+\.\d\d s$", line), line


def test_access_lines_can_be_switched_off(client, caplog):
    caplog.set_level(logging.INFO, logger=REQUESTS_LOGGER)
    logging.getLogger(REQUESTS_LOGGER).disabled = True  # what `serve --disable-log-requests` does
    try:
        client.completions.create(model="scripted", prompt="hello", max_tokens=3)
    finally:
        logging.getLogger(REQUESTS_LOGGER).disabled = False
    assert not [rec for rec in caplog.records if rec.name == REQUESTS_LOGGER]


def test_throughput_line_only_while_there_is_traffic(tokenizer, caplog):
    caplog.set_level(logging.INFO, logger=STATS_LOGGER)

    async def scenario():
        engine = AsyncEngine(ScriptedEngineCore(tokenizer=tokenizer, step_delay_s=0.005))
        engine.start()
        log = ThroughputLog(SimpleNamespace(engine=engine, metrics=Metrics()), interval_s=0.1)
        log.start()
        await asyncio.sleep(0.35)  # idle: no line
        idle = len(caplog.records)
        async for _ in engine.generate("r1", tokenizer.encode("Tell me a story"), SamplingParams(max_tokens=60)):
            pass
        await asyncio.sleep(0.6)  # the line after the traffic, then silence again
        await log.stop()
        await engine.shutdown()
        return idle

    assert asyncio.run(scenario()) == 0
    lines = [rec.getMessage() for rec in caplog.records if rec.name == STATS_LOGGER]
    assert lines and len(lines) <= 5, lines
    assert all(re.fullmatch(r"Avg prompt throughput: \d+\.\d tokens/s, Avg generation throughput: \d+\.\d tokens/s, "
                            r"Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: \d+\.\d%", ln) for ln in lines)
    assert any("Avg generation throughput: 0.0" not in ln for ln in lines)
    assert "Avg generation throughput: 0.0 tokens/s, Running: 0 reqs" in lines[-1]  # once after it stopped


def test_throughput_line_names_expert_tiers_of_a_packed_store():
    snap = {"prompt_tok_s": 40.0, "tok_s": 12.5, "running": 1, "waiting": 0, "kv_usage": 0.031,
            "hits_per_token": {"slots": 180.0, "host": 50.0, "disk": 10.0}}
    assert throughput_line(snap) == (
        "Avg prompt throughput: 40.0 tokens/s, Avg generation throughput: 12.5 tokens/s, Running: 1 reqs, "
        "Waiting: 0 reqs, KV cache usage: 3.1%, Experts per decode token: slot hits 180.00, slot misses 60.00 "
        "(host 50.00, disk 10.00)")


def test_throughput_counts_a_request_that_ends_within_the_first_interval(tokenizer, caplog):
    caplog.set_level(logging.INFO, logger=STATS_LOGGER)

    async def scenario():
        engine = AsyncEngine(ScriptedEngineCore(tokenizer=tokenizer))
        engine.start()
        log = ThroughputLog(SimpleNamespace(engine=engine, metrics=Metrics()), interval_s=0.3)
        log.start()
        await asyncio.sleep(0.05)
        async for _ in engine.generate("r1", tokenizer.encode("Tell me a story"), SamplingParams(max_tokens=20)):
            pass
        await asyncio.sleep(0.4)
        await log.stop()
        await engine.shutdown()

    asyncio.run(scenario())
    lines = [rec.getMessage() for rec in caplog.records if rec.name == STATS_LOGGER]
    assert lines and "Avg generation throughput: 0.0" not in lines[0], lines
