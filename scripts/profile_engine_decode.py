#!/usr/bin/env python3
"""Where a decode step's time goes in the serving engine (a profile, not a benchmark).

    python3 scripts/profile_engine_decode.py STORE OUTDIR [engine flags, e.g. --gpu-expert-gb 10]

Builds the engine as `tiermoe serve` would, warms up, then for batch 1 and 4: the wall time per
decode step (synchronised; with --compare-eager also with the decode CUDA graphs off), and a
torch.profiler table of the top operators by host time and by device time over 8 steps.
Written to OUTDIR/profile.txt and printed. On CPU it runs as a dry run (no device figures).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path


def main() -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tiermoe.engine.build import add_engine_args, build_engine_core
    from tiermoe.protocol import SamplingParams

    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("outdir")
    add_engine_args(p, model_positional=True)
    p.add_argument("--compare-eager", action="store_true", help="also time each batch size with the graphs off")
    p.add_argument("--prefill-tokens", type=int, default=0, help="also time and profile one prefill chunk this long")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length of the decoded requests (context)")
    p.add_argument("--variants", default="",
                   help="comma list of LAYERS:WAIT, each profiled in turn on one engine: decode graphs recorded in "
                        "pieces of LAYERS layers (0: one graph a step; runner/decode_graph.py), the engine's thread "
                        "waiting for each step asleep or spinning (WAIT sleep|spin; ModelRunner.wait_for_device), "
                        "e.g. 0:spin,1:spin,1:sleep; default: the engine's own settings")
    p.add_argument("--trace", action="store_true",
                   help="also write each batch size's profiled steps as a Chrome trace (OUTDIR/trace-bN.json)")
    p.add_argument("--stage-misses", action=argparse.BooleanOptionalAction, default=None,
                   help="device cache: gather the misses it does not admit into HBM rows (default) or, with "
                        "--no-stage-misses, read them in place (EngineArgs.stage_misses)")
    args = p.parse_args()
    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    t0 = time.perf_counter()
    ctx = args.max_model_len or max(4096, args.prefill_tokens + 256)
    eng = build_engine_core(args.store, device=args.device, dtype=args.dtype, max_model_len=ctx, max_num_seqs=4,
                            options=vars(args))
    say(f"engine built in {time.perf_counter() - t0:.1f} s")
    cuda = eng.model.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)  # a CPU run is a dry run of this script
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    rng = random.Random(0)

    def misses() -> int:
        """Device-cache misses so far (each one record over PCIe); 0 without the device cache."""
        return int(eng.stats().get("experts", {}).get("device_cache", {}).get("misses", 0))

    def start(batch: int, tokens: int, tag: str) -> None:
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        for i in range(batch):
            eng.add_request(f"{tag}-{i}", [rng.randrange(eng.vocab_size) for _ in range(args.prompt_tokens)], params)
        decodes = eng.counters["decode_steps"]
        while eng.counters["decode_steps"] == decodes:  # prefill (chunks when the prompt is long), one decode
            eng.step()

    def steps(n: int) -> list[float]:
        walls = []
        for _ in range(n):
            sync()
            a = time.perf_counter()
            eng.step()
            sync()
            walls.append(time.perf_counter() - a)
        return walls

    def profile_batches(tag: str) -> None:
        for batch in (1, 4):
            start(batch, 20, f"warm{batch}{tag}")
            steps(16)
            while eng.has_unfinished_requests():
                eng.step()
            if graphs is not None and args.compare_eager:  # the same engine with graphs off, then on
                eng.runner.graphs = None
                start(batch, 40, f"e{batch}{tag}")
                walls = sorted(steps(24))
                say(f"batch {batch} eager: wall per decode step median {1e3 * walls[len(walls) // 2]:.2f} ms")
                while eng.has_unfinished_requests():
                    eng.step()
                eng.runner.graphs = graphs
            start(batch, 40, f"b{batch}{tag}")
            before = misses()
            walls = sorted(steps(24))
            say(f"batch {batch}: wall per decode step median {1e3 * walls[len(walls) // 2]:.2f} ms "
                f"(min {1e3 * walls[0]:.2f}, max {1e3 * walls[-1]:.2f}); "
                f"{(misses() - before) / 24:.1f} expert misses per step (records moved host -> GPU)")
            with profile(activities=acts) as prof:
                steps(8)
            if args.trace:  # the step's timeline: gaps between kernels, copies against compute
                prof.export_chrome_trace(str(out / f"trace-b{batch}{tag}.json"))
            ka = prof.key_averages()
            say(f"--- batch {batch}: top operators by self host time (8 steps)")
            say(ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
            dev = [getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0) for e in ka]
            dev_us = sum(dev)
            # launches that did device work (kernels, copies; the aten rows that own them have no self device time)
            launches = sum(e.count for e, us in zip(ka, dev) if us > 0 and not e.key.startswith("aten::"))
            say(f"--- batch {batch}: device busy {dev_us / 8 / 1e3:.2f} ms per step, {launches / 8:.0f} device "
                f"launches per step; top kernels by device time (8 steps)")
            try:
                say(ka.table(sort_by="self_device_time_total", row_limit=45, max_name_column_width=90))
            except Exception:  # older profilers name it cuda
                say(ka.table(sort_by="self_cuda_time_total", row_limit=45, max_name_column_width=90))
            while eng.has_unfinished_requests():
                eng.step()

    graphs = eng.runner.graphs
    say(f"decode CUDA graphs: {'on' if graphs is not None else 'off'}")
    for variant in [v for v in args.variants.split(",") if v] or [""]:
        if variant:
            layers, wait = variant.split(":")
            if graphs is not None:  # record anew with this many decoder layers per graph piece
                graphs.layers_per_graph = int(layers)
                graphs.drop_recordings()
            eng.runner.sleep_while_waiting = wait == "sleep"  # forced either way (the engine: asleep in fast mode)
            say(f"=== variant {variant}: {layers} layers per graph (0: one graph a step), the engine's thread "
                f"{'asleep' if wait == 'sleep' else 'spinning'} while a step runs")
        profile_batches(f"-{variant.replace(':', '-')}" if variant else "")
    if args.prefill_tokens:  # one prefill chunk of that many tokens: wall time and top kernels
        for tag in ("warm", "timed"):
            eng.add_request(f"p-{tag}", [rng.randrange(eng.vocab_size) for _ in range(args.prefill_tokens)],
                            SamplingParams(max_tokens=1, ignore_eos=True))
            sync()
            a = time.perf_counter()
            if tag == "timed":
                with profile(activities=acts) as prof:
                    eng.step()
                    sync()
            else:
                eng.step()
                sync()
            wall = time.perf_counter() - a
            while eng.has_unfinished_requests():
                eng.step()
        say(f"prefill {args.prefill_tokens} tokens: one step {1e3 * wall:.1f} ms (profiled)")
        try:
            say(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))
        except Exception:  # older profilers name it cuda
            say(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
    say(str(eng.stats().get("experts", {})))
    (out / "profile.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
