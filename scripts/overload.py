#!/usr/bin/env python3
"""Overload a running tiermoe server and check that it degrades cleanly.

Drives CLIENTS concurrent clients (default 4x --max-num-seqs) for --duration seconds against
a server on this machine; each client loops streaming chat requests. The server must answer
every request with a complete stream or a 429 (whose Retry-After the client honours before
trying again); anything else is an error. Reported: completed requests, 429s, other errors,
latency of admitted requests (p50/p99, and time to first token), throughput, and the
server's resident memory (from /proc/PID/status) and GPU memory (from /stats, if it reports
one) before, at peak and after. Passes (exit 0) when there were no other errors, at least
one request completed, and memory came back to its baseline within the tolerance.

  python scripts/overload.py --url http://127.0.0.1:8000 --max-num-seqs 4 --duration 120

The server's pid is found from the port (or give --pid). Only loopback URLs are accepted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx

PROMPTS = [
    "Tell me a story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List some facts about the moon.",
    "Write a short poem about rain on a tin roof.",
    "What is the capital of France, and why is it famous?",
    "Describe the water cycle step by step.",
]
GPU_KEYS = ("gpu_memory_allocated_bytes", "gpu_memory_used_bytes", "cuda_memory_allocated", "device_memory_bytes")


@dataclass
class Tally:
    completed: int = 0
    rejected: int = 0  # 429
    retry_after: dict = field(default_factory=dict)  # Retry-After value -> count
    errors: list = field(default_factory=list)  # (kind, detail)
    latencies: list = field(default_factory=list)  # seconds, admitted requests
    ttfts: list = field(default_factory=list)
    tokens: int = 0
    finish: dict = field(default_factory=dict)


# ---- the server process -------------------------------------------------------------------


def pid_of_port(port: int) -> int | None:
    """The pid of the process listening on 127.0.0.1/::1:port (socket inode -> /proc/*/fd)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) > 9 and parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(parts[9])
    if not inodes:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(proc.name)
        except OSError:
            continue
    return None


def rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def find_gpu_bytes(stats) -> int | None:
    """A GPU memory figure anywhere in the /stats document (None if the server reports none)."""
    if isinstance(stats, dict):
        for key, value in stats.items():
            if key in GPU_KEYS and isinstance(value, (int, float)):
                return int(value)
            found = find_gpu_bytes(value)
            if found is not None:
                return found
    return None


# ---- clients ------------------------------------------------------------------------------


async def one_request(client: httpx.AsyncClient, args, prompt: str, tally: Tally) -> float:
    """One streaming chat request; returns the seconds to wait before the next (Retry-After)."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.model:
        body["model"] = args.model
    t0 = time.monotonic()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code == 429:
                await r.aread()
                tally.rejected += 1
                value = r.headers.get("retry-after", "")
                tally.retry_after[value] = tally.retry_after.get(value, 0) + 1
                try:
                    return max(0.0, float(value))
                except ValueError:
                    tally.errors.append(("429 without a numeric Retry-After", value))
                    return 1.0
            if r.status_code != 200:
                text = (await r.aread()).decode("utf-8", "replace")
                tally.errors.append((f"HTTP {r.status_code}", text[:200]))
                return 0.5
            first, finish, usage, done = None, None, None, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    tally.errors.append(("in-stream error", str(event["error"])[:200]))
                for choice in event.get("choices") or []:
                    if first is None and (choice.get("delta") or {}).get("content"):
                        first = time.monotonic()
                    finish = choice.get("finish_reason") or finish
                usage = event.get("usage") or usage
    except (httpx.HTTPError, OSError, ValueError) as exc:
        tally.errors.append((type(exc).__name__, str(exc)[:200]))
        return 0.5
    if not done or finish in (None, "error"):
        tally.errors.append(("incomplete stream", f"done={done} finish={finish}"))
        return 0.0
    tally.completed += 1
    tally.finish[finish] = tally.finish.get(finish, 0) + 1
    tally.latencies.append(time.monotonic() - t0)
    if first is not None:
        tally.ttfts.append(first - t0)
    if usage:
        tally.tokens += int(usage.get("completion_tokens", 0))
    return 0.0


async def client_loop(i: int, client: httpx.AsyncClient, args, deadline: float, tally: Tally) -> None:
    rng = random.Random(i)
    n = 0
    while time.monotonic() < deadline:
        prompt = f"{rng.choice(PROMPTS)} (client {i}, request {n})"
        n += 1
        wait = await one_request(client, args, prompt, tally)
        if wait:
            await asyncio.sleep(wait * (1 + 0.1 * rng.random()))  # at least Retry-After, with jitter


async def sample_memory(client: httpx.AsyncClient, pid: int | None, stop: asyncio.Event, peaks: dict) -> None:
    last_stats = 0.0
    while not stop.is_set():
        rss = rss_bytes(pid)
        if rss is not None:
            peaks["rss"] = max(peaks.get("rss", 0), rss)
        if time.monotonic() - last_stats > 2:
            last_stats = time.monotonic()
            gpu = await gpu_bytes(client)
            if gpu is not None:
                peaks["gpu"] = max(peaks.get("gpu", 0), gpu)
        try:
            await asyncio.wait_for(stop.wait(), 0.25)
        except asyncio.TimeoutError:
            pass


async def gpu_bytes(client: httpx.AsyncClient) -> int | None:
    try:
        r = await client.get("/stats", timeout=10)
        return find_gpu_bytes(r.json()) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


async def run(args) -> dict:
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    timeout = httpx.Timeout(args.request_timeout, connect=10)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, limits=limits, timeout=timeout) as client:
        r = await client.get("/health")
        if r.status_code != 200:
            raise SystemExit(f"overload: {args.url}/health answered {r.status_code}")
        pid = args.pid or pid_of_port(urlparse(args.url).port or 80)
        warm = Tally()
        for k in range(args.warmup):  # first requests allocate lazily; the baseline comes after
            await one_request(client, args, f"{PROMPTS[k % len(PROMPTS)]} (warm-up {k})", warm)
        await asyncio.sleep(1.0)
        base_rss, base_gpu = rss_bytes(pid), await gpu_bytes(client)
        tally, stop, peaks = Tally(), asyncio.Event(), {}
        sampler = asyncio.create_task(sample_memory(client, pid, stop, peaks))
        t0 = time.monotonic()
        deadline = t0 + args.duration
        await asyncio.gather(*(client_loop(i, client, args, deadline, tally) for i in range(args.clients)))
        wall = time.monotonic() - t0
        stop.set()
        await sampler
        # memory after: the server should settle back to its baseline once idle
        tolerance = max(args.rss_tolerance_mb * 2**20, args.rss_tolerance_pct / 100 * (base_rss or 0))
        settle_deadline = time.monotonic() + args.settle
        after_rss = rss_bytes(pid)
        while after_rss is not None and base_rss is not None and after_rss - base_rss > tolerance \
                and time.monotonic() < settle_deadline:
            await asyncio.sleep(0.5)
            after_rss = rss_bytes(pid)
        after_gpu = await gpu_bytes(client)
        health = (await client.get("/health")).status_code
    mb = lambda b: None if b is None else round(b / 2**20, 1)  # noqa: E731
    rss_ok = base_rss is None or after_rss is None or after_rss - base_rss <= tolerance
    gpu_ok = base_gpu is None or after_gpu is None or after_gpu - base_gpu <= tolerance
    report = {
        "url": args.url,
        "server_pid": pid,
        "clients": args.clients,
        "max_num_seqs": args.max_num_seqs,
        "duration_s": round(wall, 1),
        "max_tokens": args.max_tokens,
        "completed": tally.completed,
        "rejected_429": tally.rejected,
        "retry_after_values": tally.retry_after,
        "other_errors": len(tally.errors),
        "error_samples": tally.errors[:10],
        "finish_reasons": tally.finish,
        "latency_s": {
            "p50": pct(tally.latencies, 0.5),
            "p99": pct(tally.latencies, 0.99),
            "max": max(tally.latencies, default=None),
        },
        "ttft_s": {"p50": pct(tally.ttfts, 0.5), "p99": pct(tally.ttfts, 0.99)},
        "requests_per_s": round(tally.completed / wall, 2) if wall else None,
        "tokens_per_s": round(tally.tokens / wall, 1) if wall else None,
        "rss_mb": {
            "baseline": mb(base_rss),
            "peak": mb(peaks.get("rss")),
            "after": mb(after_rss),
            "tolerance": mb(tolerance),
        },
        "gpu_mb": {"baseline": mb(base_gpu), "peak": mb(peaks.get("gpu")), "after": mb(after_gpu)}
        if base_gpu is not None
        else "not reported by /stats",
        "health_after": health,
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    report["passed"] = bool(tally.completed > 0 and not tally.errors and rss_ok and gpu_ok and health == 200)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback only)")
    p.add_argument(
        "--max-num-seqs", type=int, default=4, help="the server's --max-num-seqs (sets the default client count)"
    )
    p.add_argument("--clients", type=int, default=None, help="concurrent clients (default 4x --max-num-seqs)")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load (default 120)")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each request")
    p.add_argument("--model", default=None, help="`model` to send (default: none, the server's own)")
    p.add_argument("--api-key", default=os.environ.get("TIERMOE_API_KEY"))
    p.add_argument("--pid", type=int, default=None, help="server pid for RSS (default: found from the port)")
    p.add_argument("--warmup", type=int, default=4, help="sequential requests before the memory baseline")
    p.add_argument("--settle", type=float, default=15.0, help="seconds allowed for memory to come back after the load")
    p.add_argument("--rss-tolerance-mb", type=float, default=64.0)
    p.add_argument(
        "--rss-tolerance-pct", type=float, default=10.0, help="of the baseline; the larger tolerance applies"
    )
    p.add_argument("--request-timeout", type=float, default=300.0, help="client-side timeout per request (seconds)")
    p.add_argument("--json", default=None, help="also write the report to this file")
    args = p.parse_args(argv)
    host = urlparse(args.url).hostname or ""
    if not (host == "localhost" or host.startswith("127.") or host == "::1"):
        p.error(f"--url {args.url}: only loopback servers (127.0.0.0/8, localhost, ::1)")
    if args.clients is None:
        args.clients = 4 * args.max_num_seqs
    if args.clients < 1 or args.duration <= 0:
        p.error("--clients and --duration must be positive")
    report = asyncio.run(run(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print("PASSED" if report["passed"] else "FAILED", file=sys.stderr)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
