#!/usr/bin/env python3
"""What the HTTP server adds per streamed token, without a GPU or a model.

    python3 scripts/server_overhead_check.py [--step-ms 6.5] [--busy-ms 0] [--tokens 200] [--reps 3]

The engine core is the scripted one (engine/scripted.py) whose step() sleeps --step-ms, as a
real step waits for the GPU with the GIL released, after --busy-ms of pure-Python work that
holds the GIL (a real step's scheduling, batch building and sampling); replies are long
enough for --tokens tokens.
Two measurements of the same core and AsyncEngine, per rep:
  in-process  AsyncEngine.generate consumed in the engine's own process (no HTTP)
  HTTP        `tiermoe serve`'s app (FastAPI + uvicorn in this process, the engine on its
              thread), streamed by a client in another process (the OpenAI chat endpoint,
              stream=True), timing each content chunk
and prints ms per token (median inter-token gap, and mean) for both, and the difference: the
server's share (docs/results.md section 17 measured about 2.6 ms a token on the H200).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

CLIENT = textwrap.dedent("""
    import json, sys, time, urllib.request
    url, tokens = sys.argv[1], int(sys.argv[2])
    body = {"model": "scripted", "stream": True, "max_tokens": tokens,
            "messages": [{"role": "user", "content": "LONG_REPLY"}]}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    stamps = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp:
            if line.startswith(b"data: {") and b'"content"' in line:
                stamps.append(time.perf_counter())
    print(json.dumps(stamps))
""")


def gaps_ms(stamps: list[float]) -> list[float]:
    return [1e3 * (b - a) for a, b in zip(stamps, stamps[1:])]


def summary(gaps: list[float]) -> str:
    return f"median {statistics.median(gaps):.2f} ms, mean {statistics.fmean(gaps):.2f} ms ({len(gaps)} gaps)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step-ms", type=float, default=6.5)
    ap.add_argument("--busy-ms", type=float, default=0.0)
    ap.add_argument("--loop-ms", type=float, default=0.0,
                    help="extra pure-Python work on the event loop per delivered step (a heavier server)")
    ap.add_argument("--release-us", type=float, default=50.0,
                    help="the engine's Python work releases the GIL this often (each torch op does)")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    if a.step_ms < 0 or a.busy_ms < 0 or a.tokens < 3 or a.reps < 1:
        print("server_overhead_check: --step-ms, --busy-ms >= 0, --tokens >= 3, --reps >= 1", file=sys.stderr)
        return 2
    from testkit.servers import ServerThread

    from tiermoe.engine.async_engine import AsyncEngine
    from tiermoe.protocol import SamplingParams
    from tiermoe.engine.scripted import ScriptedEngineCore, ScriptedReply
    from tiermoe.models.tiny_tokenizer import build_tokenizer
    from tiermoe.server.app import create_app

    tok = build_tokenizer()
    words = " ".join(f"w{i}" for i in range(4 * a.tokens))
    core = ScriptedEngineCore(
        tokenizer=tok,
        script=lambda prompt: ScriptedReply(content=words),
        step_delay_s=a.step_ms / 1e3,
        max_model_len=16 * a.tokens + 4096,
    )
    scripted_step = core.step

    def step():
        end = time.perf_counter() + a.busy_ms / 1e3
        mark = time.perf_counter()
        while (now := time.perf_counter()) < end:  # interpreter work holding the GIL ...
            if now - mark > a.release_us / 1e6:  # ... released now and then, as torch ops do
                time.sleep(0)
                mark = time.perf_counter()
        return scripted_step()

    core.step = step
    engine = AsyncEngine(core)
    deliver = engine._deliver

    def heavy_deliver(*args):
        end = time.perf_counter() + a.loop_ms / 1e3
        while time.perf_counter() < end:
            pass
        return deliver(*args)

    engine._deliver = heavy_deliver
    prompt_ids = tok.encode("LONG_REPLY")

    async def in_process() -> list[float]:
        stamps = []
        params = SamplingParams(max_tokens=a.tokens, ignore_eos=True)
        async for out in engine.generate(f"r{time.monotonic_ns()}", prompt_ids, params):
            stamps += [time.perf_counter()] * len(out.new_token_ids)
        return stamps

    results = {"in-process": [], "HTTP": []}
    with ServerThread(create_app(engine, served_model_name="scripted", max_model_len=16 * a.tokens + 4096)) as srv:
        for _ in range(a.reps):
            # on the server's own event loop (the engine delivers there), with no HTTP request open
            stamps = asyncio.run_coroutine_threadsafe(in_process(), engine._loop).result(timeout=300)
            results["in-process"] += gaps_ms(stamps)
            out = subprocess.run(
                [sys.executable, "-c", CLIENT, srv.url, str(a.tokens)], capture_output=True, text=True, timeout=300
            )
            if out.returncode != 0:
                print(f"server_overhead_check: client failed: {out.stderr.strip()[-300:]}", file=sys.stderr)
                return 1
            results["HTTP"] += gaps_ms(json.loads(out.stdout))
    base = statistics.median(results["in-process"])
    for name, gaps in results.items():
        print(f"{name:10s} {summary(gaps)}")
    print(
        f"server adds {statistics.median(results['HTTP']) - base:.2f} ms per token (medians), "
        f"step: {a.busy_ms} ms Python + {a.step_ms} ms sleep"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
