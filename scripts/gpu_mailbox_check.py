#!/usr/bin/env python3
"""GPU check of the host mailbox (tiermoe.kernels.triton.mailbox) on a CUDA machine.

  1. eager: two slots posted, a host thread answers with a small fp32 "expert", wait_add adds
     exactly the host's answer;
  2. the same inside one captured CUDA graph, replayed 100 times with new inputs each time:
     every replay must add exactly what the host thread computed for that replay's rows;
  3. timing: graph of (post -> host copies x to fp32 -> wait_add), CUDA events around each of
     1000 replays, median per replay, for T = 1 and T = 4 at H = 4096.

Prints progress lines, then one JSON line last. Exits within about 120 s whatever happens (a
watchdog prints the JSON with an error and kills the process; every device wait is bounded).

Run from the repository root:  python3 scripts/gpu_mailbox_check.py   (exit 0 = all checks pass)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

T_START = time.monotonic()
DEADLINE_S = 110.0
H, TMAX = 4096, 4
MAX_SPINS = 1 << 21  # bounded device wait (a poll of host memory takes about a microsecond)
REPORT: dict = {"ok": False, "stage": "start"}
_emit_lock = threading.Lock()


def emit_and_exit(code: int) -> None:
    with _emit_lock:
        REPORT["elapsed_s"] = round(time.monotonic() - T_START, 2)
        print(json.dumps(REPORT), flush=True)
        os._exit(code)


def _watchdog() -> None:
    REPORT["error"] = f"watchdog: still running after {DEADLINE_S:.0f} s in stage {REPORT.get('stage')}"
    emit_and_exit(3)


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T_START:6.1f}s] {msg}", flush=True)


def time_left() -> float:
    return DEADLINE_S - (time.monotonic() - T_START)


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import torch

    if not torch.cuda.is_available():
        REPORT["error"] = "no CUDA device"
        return 2
    from tiermoe.kernels.triton.mailbox import Mailbox, MailboxServer

    dev = torch.device("cuda")
    REPORT["device"] = torch.cuda.get_device_name(0)
    REPORT["torch"] = torch.__version__
    import triton

    REPORT["triton"] = triton.__version__

    # ---------------------------------------------------------------- 1. eager, two slots
    REPORT["stage"] = "eager"
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(2, H, 32, generator=gen) / H**0.5  # [S, H, 32] low-rank stand-in expert
    b = torch.randn(2, 32, H, generator=gen) / 32**0.5  # [S, 32, H]
    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    seen_lock = threading.Lock()

    def expert(slot: int, x: torch.Tensor) -> torch.Tensor:
        y = (x.float() @ a[slot]) @ b[slot] + x.float()  # [T, H] fp32
        with seen_lock:
            seen.append((slot, x.clone(), y.clone()))
        return y

    mb = Mailbox(2, H, TMAX, dev)
    server = MailboxServer(mb, expert, threads=4).start()

    def check_round(xs, bases, outs, n0) -> str | None:
        """None when both slots got exactly the host's answer for exactly the posted rows."""
        with seen_lock:
            got = {s: (x, y) for s, x, y in seen[n0:]}
        if sorted(got) != [0, 1]:
            return f"host answered slots {sorted(got)} (errors {mb.errors().tolist()})"
        for s in range(2):
            x_srv, y_srv = got[s]
            if not torch.equal(x_srv, xs[s].cpu()):
                return f"slot {s}: host saw other rows than posted"
            want = (bases[s].float().cpu() + y_srv).to(torch.bfloat16)
            if not torch.equal(outs[s].cpu(), want):
                diff = (outs[s].float().cpu() - want.float()).abs().max().item()
                return f"slot {s}: out differs from base + host answer (max abs {diff})"
        return None

    xs = [torch.randn(TMAX, H, device=dev).to(torch.bfloat16) for _ in range(2)]
    bases = [torch.randn(TMAX, H, device=dev).to(torch.bfloat16) for _ in range(2)]
    outs = [x.clone() for x in bases]
    n0 = len(seen)
    t0 = time.monotonic()
    mb.post(0, xs[0])
    mb.post(1, xs[1])
    mb.wait_add(0, outs[0], max_spins=MAX_SPINS)
    mb.wait_add(1, outs[1], max_spins=MAX_SPINS)
    torch.cuda.synchronize()
    log(f"eager round (incl. compile) {time.monotonic() - t0:.2f} s, errors {mb.errors().tolist()}")
    err = check_round(xs, bases, outs, n0)
    REPORT["eager_ok"] = err is None
    if err:
        REPORT["error"] = "eager: " + err
        return 1

    # ---------------------------------------------------------------- 2. CUDA graph, 100 replays
    REPORT["stage"] = "graph"
    sx = [torch.zeros(TMAX, H, dtype=torch.bfloat16, device=dev) for _ in range(2)]
    so = [torch.zeros(TMAX, H, dtype=torch.bfloat16, device=dev) for _ in range(2)]

    def step() -> None:
        mb.post(0, sx[0])
        mb.post(1, sx[1])
        mb.wait_add(0, so[0], max_spins=MAX_SPINS)
        mb.wait_add(1, so[1], max_spins=MAX_SPINS)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside capture (answered by the server like any step)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()
    good = 0
    for i in range(100):
        if time_left() < 60:
            REPORT["error"] = f"graph: too slow, {good} replays in the time allowed"
            return 1
        xs = [torch.randn(TMAX, H, device=dev).to(torch.bfloat16) for _ in range(2)]
        bases = [torch.randn(TMAX, H, device=dev).to(torch.bfloat16) for _ in range(2)]
        for s in range(2):
            sx[s].copy_(xs[s])
            so[s].copy_(bases[s])
        n0 = len(seen)
        graph.replay()
        torch.cuda.synchronize()
        err = check_round(xs, bases, so, n0)
        if err:
            REPORT["error"] = f"graph replay {i}: {err}"
            REPORT["graph_replays_ok"] = good
            return 1
        good += 1
    REPORT["graph_replays_ok"] = good
    REPORT["seq_after_graph"] = mb.seq.tolist()
    log(f"graph: {good} replays exact, seq {mb.seq.tolist()}, errors {mb.errors().tolist()}")
    server.stop()
    del graph

    # ---------------------------------------------------------------- 3. round-trip timing
    REPORT["stage"] = "timing"
    REPORT["roundtrip_us"] = {}
    for t in (1, 4):
        mbt = Mailbox(1, H, TMAX, dev)
        srv = MailboxServer(mbt, lambda s, x: x.float(), threads=1, spin_s=0.05).start()
        x = torch.randn(t, H, device=dev).to(torch.bfloat16)
        out = torch.zeros(t, H, dtype=torch.bfloat16, device=dev)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            mbt.post(0, x)
            mbt.wait_add(0, out, max_spins=MAX_SPINS)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            mbt.post(0, x)
            mbt.wait_add(0, out, max_spins=MAX_SPINS)
        for _ in range(20):
            g.replay()
        torch.cuda.synchronize()
        n = 1000
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        w0 = time.perf_counter()
        for e0, e1 in ev:
            e0.record()
            g.replay()
            e1.record()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - w0) / n * 1e6
        us = sorted(e0.elapsed_time(e1) * 1e3 for e0, e1 in ev)
        srv.stop()
        errs = mbt.errors().tolist()
        REPORT["roundtrip_us"][f"T{t}"] = {
            "median": round(statistics.median(us), 2), "p10": round(us[n // 10], 2), "p90": round(us[n * 9 // 10], 2),
            "wall_per_replay": round(wall, 2), "served": srv.served, "errors": errs,
        }
        log(f"T={t}: {REPORT['roundtrip_us'][f'T{t}']}")
        if errs != [0] or srv.served != n + 21:
            REPORT["error"] = f"timing T={t}: errors {errs}, served {srv.served} of {n + 21}"
            return 1
        if time_left() < 15:
            REPORT["error"] = "timing: out of time"
            return 1
    REPORT["stage"] = "done"
    REPORT["ok"] = True
    return 0


if __name__ == "__main__":
    import signal

    signal.alarm(int(DEADLINE_S) + 8)  # last resort, needs no GIL: the default action ends the process
    dog = threading.Timer(DEADLINE_S, _watchdog)
    dog.daemon = True
    dog.start()
    try:
        code = main()
    except BaseException as exc:  # report, never hang or leave a traceback as the last line
        import traceback

        traceback.print_exc()
        REPORT["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        code = 1
    emit_and_exit(code)
