#!/usr/bin/env python3
"""Fast-mode decode for many steps, then the mailbox's counts: every post answered exactly once.

In fast mode on the device cache each decode layer posts its lane work to a host mailbox and
the GPU waits for the answer (moe/device_lane.py). A post left unanswered costs the device a
bounded spin and a step that fails; one answered twice, or an answer missing from the counts,
shows only in the counters. This runs the engine as `tiermoe serve` does (start-up warm-up, decode
graphs), on a tiny GLM-4-MoE store packed as int4, two requests at a time of different lengths
(decode batches of 2 and of 1), until STEPS decode steps ran; then it reads the counters that
/stats reports under engine.experts.device_cache.mailbox and checks

    posts == served == lane_calls (one post per lane layer call, eager or replayed)
    unanswered == 0, timeouts == 0, failed == 0

Prints one JSON line (ok, steps, counters, seconds). Exit 0 when every check holds.
Usage: python3 scripts/fast_mode_mailbox_soak.py [--steps 10000] [--device cuda] [--out FILE]
(from the repository root; on a CPU the kernels run in Triton's interpreter: use few steps).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

GIB = 2**30
RECORD = 4096  # bytes of one int4 expert record of the tiny model (H 64, I 32, groups of 32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000, help="decode steps to run (at least)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=400, help="tokens of the longer request of each pair")
    ap.add_argument("--deadline-s", type=float, default=420.0, help="stop adding requests after this long")
    ap.add_argument("--out", default=None, help="also write the JSON line here")
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import torch

    from tiermoe.engine.build import build_engine_core
    from tiermoe.protocol import SamplingParams
    from tiermoe.models.tiny import write_tiny
    from tiermoe.store.pack import pack

    t0 = time.perf_counter()
    report: dict = {"ok": False, "device": args.device, "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        src = write_tiny("glm4_moe", Path(tmp) / "src", dtype="bfloat16")
        pack(str(src), str(Path(tmp) / "store"), quant="int4", group_size=32, progress=False, log=lambda _: None)
        options = {"expert_kernel": "triton", "gpu_expert_gb": 4 * RECORD / GIB, "host_expert_gb": 16 * RECORD / GIB,
                   "mode": "fast", "cpu_lane_experts": 2, "cpu_lane_share": 1.0, "cpu_lane_threads": 2}
        eng = build_engine_core(str(Path(tmp) / "store"), device=args.device, dtype="bfloat16", max_num_seqs=2,
                                max_model_len=args.tokens + 64, options=options)
        try:
            report["warm_up_steps"] = eng.warm_up()
            pairs = 0
            while eng.stats()["decode_steps"] < args.steps and time.perf_counter() - t0 < args.deadline_s:
                for i, n in enumerate((args.tokens, args.tokens // 2)):  # batch 2, then batch 1
                    eng.add_request(f"p{pairs}-{i}", [5 + pairs % 50, 17 + i, 33, 64][: 4 - i],
                                    SamplingParams(max_tokens=n, ignore_eos=True))
                while eng.has_unfinished_requests():
                    for out in eng.step():
                        if out.finished and out.finish_reason not in ("length", "stop"):
                            raise RuntimeError(f"request {out.request_id} ended with {out.finish_reason}")
                pairs += 1
            stats = eng.stats()  # what /stats reports under "engine"
        finally:
            eng.model.expert_backend.close()
    dc = stats["experts"]["device_cache"]
    mailbox = dc.get("mailbox", {})
    report.update(steps=stats["decode_steps"], errors=stats.get("errors", 0), lane_calls=dc["lane_calls"],
                  mailbox=mailbox, graph_replays=dc.get("graph_replays", 0),
                  lane_experts=stats["experts"].get("cpu_lane", {}).get("experts", 0),
                  seconds=round(time.perf_counter() - t0, 1))
    problems = []
    if report["steps"] < args.steps:
        problems.append(f"only {report['steps']} decode steps within {args.deadline_s:.0f} s")
    if report["errors"]:
        problems.append(f"{report['errors']} failed steps")
    if not (mailbox.get("posts") == mailbox.get("served") == dc["lane_calls"] > 0):
        problems.append("posts, served and lane calls differ")
    if any(mailbox.get(k) for k in ("unanswered", "timeouts", "failed")):
        problems.append("unanswered, timed out or failed posts")
    if args.device != "cpu" and not report["graph_replays"]:
        problems.append("no decode step was replayed from a CUDA graph")
    report["ok"], report["problems"] = not problems, problems
    line = json.dumps(report)
    print(line, flush=True)
    if args.out:
        Path(args.out).write_text(line + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
