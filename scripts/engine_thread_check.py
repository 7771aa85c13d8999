#!/usr/bin/env python3
"""Does the thread that steps the engine change its speed? (a diagnostic, not a benchmark)

    python3 scripts/engine_thread_check.py STORE [engine flags] [--tokens 64] [--build-in-thread]

`tiermoe serve` steps the engine core from a background thread (engine/async_engine.py) while
the event loop owns the main thread; benchmarks and profiles step it from the main thread.
This builds the core as `tiermoe serve` would and times one greedy request of --tokens tokens
(a 60-token prompt) three ways on the same core: stepped from the main thread, from a plain
second thread, and through AsyncEngine (the server's bridge, no HTTP). Prints ms per token
(after the first token) for each. --build-in-thread builds the core in a thread that stays
alive and steps it there, as the server does when the engine thread owns the core.
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import sys
import threading
import time


def main() -> int:
    from tiermoe.engine.async_engine import AsyncEngine
    from tiermoe.engine.build import add_engine_args, build_engine_core
    from tiermoe.protocol import SamplingParams

    p = argparse.ArgumentParser()
    p.add_argument("store")
    add_engine_args(p, model_positional=True)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--build-in-thread", action="store_true")
    p.add_argument("--variants", default="", help="comma list of second-thread variants to time too: "
                   "inference_mode, threads1, set_device, profile (torch.profiler tables of a second-thread run)")
    args = p.parse_args()
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0.0)
    prompt = list(range(100, 160))

    def build():
        return build_engine_core(args.store, device=args.device, dtype=args.dtype, max_model_len=4096,
                                 max_num_seqs=4, options=vars(args))

    def run_direct(core, tag: str) -> None:
        core.add_request(tag, prompt, params)
        t0 = n0 = None
        n = 0
        while core.has_unfinished_requests():
            for out in core.step():
                n += len(out.new_token_ids)
                if t0 is None and n:
                    t0, n0 = time.perf_counter(), n
        print(f"{tag}: {1e3 * (time.perf_counter() - t0) / (n - n0):.2f} ms/token", flush=True)

    if args.build_in_thread:  # one long-lived thread builds the core and steps it
        jobs: queue.SimpleQueue = queue.SimpleQueue()

        def owner() -> None:
            core = build()
            while (tag := jobs.get()) is not None:
                run_direct(core, tag)

        t = threading.Thread(target=owner)
        t.start()
        for tag in ("owner thread (warm-up)", "owner thread", "owner thread again"):
            jobs.put(tag)
        jobs.put(None)
        t.join()
        return 0

    core = build()
    run_direct(core, "main thread (warm-up)")
    run_direct(core, "main thread")
    t = threading.Thread(target=run_direct, args=(core, "second thread"))
    t.start()
    t.join()
    for variant in filter(None, args.variants.split(",")):
        t = threading.Thread(target=second_thread_variant, args=(core, variant, run_direct))
        t.start()
        t.join()

    async def via_bridge() -> None:
        eng = AsyncEngine(core)
        eng.start()
        t0 = n0 = None
        n = 0
        async for out in eng.generate("bridge", prompt, params):
            n += len(out.new_token_ids)
            if t0 is None and n:
                t0, n0 = time.perf_counter(), n
        print(f"AsyncEngine thread: {1e3 * (time.perf_counter() - t0) / (n - n0):.2f} ms/token", flush=True)
        await eng.shutdown()

    asyncio.run(via_bridge())
    run_direct(core, "main thread again")
    return 0


def second_thread_variant(core, variant: str, run_direct) -> None:
    """One timed request on this (second) thread with one setting changed first."""
    import contextlib

    import torch

    ctx = contextlib.nullcontext()
    if variant == "inference_mode":
        ctx = torch.inference_mode()
    elif variant == "threads1":
        torch.set_num_threads(1)
    elif variant == "set_device" and torch.cuda.is_available():
        torch.cuda.set_device(torch.cuda.current_device())
    elif variant == "profile":
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=acts) as prof:
            run_direct(core, "second thread, profiled")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
        return
    with ctx:
        run_direct(core, f"second thread, {variant}")


if __name__ == "__main__":
    sys.exit(main())
