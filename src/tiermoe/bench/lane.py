"""`tiermoe bench lane`: how fast the CPU lane computes experts, beside what the host's memory allows.

Fast mode pays off only when the CPU lane reads expert weights at close to the host's memory
bandwidth (issue 20). This measures both in one run, on the same records: for each record kind
(int4, int3, int8, bf16), thread count and token count T it times `CpuLane.compute_posted` (the entry
point the device cache's mailbox calls) on `--experts` experts per call, every one routed by all T
tokens, cycling through a pool of records larger than the CPU caches so every call reads RAM;
and, per thread count, a multi-threaded read of the same pool (by the lane's own thread pool where
the compiled kernel is built, else by torch's threads). Weight GB/s counts the bytes of
the records' weight and scale sections (ExpertLayout.weight_bytes) per expert computed. Every kind
beside int4 is then compared with int4 at the same threads and tokens (ms per expert, GB/s, share
of the host read): int3 reads 3/8 of a byte per weight against int4's 1/2, so where the lane runs
at the host's read rate an int3 expert takes about 3/4 of an int4 one.

    tiermoe bench lane [--hidden 4096 --inter 2048 --group-size 128] [--kinds int4,int3,int8,bf16]
                       [--threads 1,2,4,8] [--tokens 1,2,4,8] [--repeat N] [--store STORE] [--out lane.json]

`--store` takes the records (kind and shape too) from a packed store instead of random ones.
"""

from __future__ import annotations

import argparse
import os
import time

from tiermoe.errors import UserError

KIND_CHOICES = ("int4", "int3", "int8", "bf16")


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("lane", help="CPU-lane GB/s of expert weights by threads and record kind, "
                                                 "beside the host read GB/s")
    p.add_argument("--hidden", type=int, default=4096, help="hidden size H (default: GLM-5.3-Flash's MoE)")
    p.add_argument("--inter", type=int, default=2048, help="expert intermediate size I")
    p.add_argument("--group-size", type=int, default=128, help="scale group of int4/int3/int8 records")
    p.add_argument("--kinds", default=",".join(KIND_CHOICES), help="record kinds, e.g. int4,bf16")
    p.add_argument("--threads", default=None, help="lane thread counts (default 1,2,4,.. up to the usable cores)")
    p.add_argument("--tokens", default="1,2,4,8", help="tokens routed to every expert of a call")
    p.add_argument("--experts", type=int, default=4, help="experts per lane call (one MoE layer's share)")
    p.add_argument("--pool-gb", type=float, default=1.0, help="GiB of records cycled through, per kind")
    p.add_argument("--seconds", type=float, default=0.5, help="time per measurement")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds over every cell (kinds interleaved), each cell keeping its fastest round: on a host "
                        "other work shares, one round's cells of one kind can all meet a busy spell")
    p.add_argument("--store", default=None, help="packed store to take records (kind, shape) from")
    p.add_argument("--isa", choices=("avx512bf16", "avx512", "avx2", "scalar"), default="avx512bf16",
                   help="most the compiled kernel may use (default: the best this CPU has)")
    p.add_argument("--no-pin", action="store_true", help="do not pin the lane's threads to physical cores "
                                                           "(fast mode pins them beside a GPU)")
    p.add_argument("--item-rows", default=None,
                   help="work items of the compiled kernel to compare, as GATE_UP:DOWN rows, comma-separated "
                        "(default: its built-in 16:16)")
    p.add_argument("--ahead-rows", default=None,
                   help="how many rows ahead its prefetches reach, comma-separated, 0 = none (default: 2)")
    p.add_argument("--prefetch-hint", default=None,
                   help="prefetch locality, comma-separated: 3 = L1, 2 = L2, 1 = L3 (default: 3)")
    p.add_argument("--busy", type=int, default=0,
                   help="processes that spin on a core each during every measurement: a GPU engine's thread "
                        "waits for its steps that way, beside the lane")
    p.add_argument("--set-up", default="compiled",
                   help="who turns a posted layer's words into each expert's rows and weights: compiled (in the "
                        "kernel, as the device cache's mailbox serves) or python (per-expert torch calls, as "
                        "before); comma-separated to compare")
    p.add_argument("--out", default=None, help="write the result JSON here")
    p.set_defaults(handler=_run)


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise UserError(f"{flag}: expected integers >= 1, got {text!r}")
    return vals


def default_threads() -> list[int]:
    """1, 2, 4, ... below the usable cores, then the usable cores themselves."""
    n = len(os.sched_getaffinity(0))
    out, t = [], 1
    while t < n:
        out.append(t)
        t *= 2
    return out + [n]


def _check(args) -> tuple[list[str], list[int], list[int]]:
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KIND_CHOICES]
    if bad or not kinds:
        raise UserError(f"--kinds: unknown kind(s) {bad}; choose from {', '.join(KIND_CHOICES)}")
    threads = _ints(args.threads, "--threads") if args.threads else default_threads()
    tokens = _ints(args.tokens, "--tokens")
    if args.experts < 1 or args.pool_gb <= 0 or args.seconds <= 0 or args.repeat < 1:
        raise UserError("--experts, --pool-gb, --seconds and --repeat must be > 0")
    if args.hidden < 1 or args.inter < 1 or args.group_size < 1:
        raise UserError("--hidden, --inter and --group-size must be >= 1")
    return kinds, threads, tokens


SET_UPS = ("compiled", "python")


def _set_ups(args) -> list[str]:
    set_ups = [u.strip() for u in args.set_up.split(",") if u.strip()]
    if not set_ups or any(u not in SET_UPS for u in set_ups):
        raise UserError(f"--set-up: comma-separated {' or '.join(SET_UPS)}, got {args.set_up!r}")
    return set_ups


def _synthetic_pool(kind: str, args):
    """(store RecordLayout, uint8 [n, R] random valid records) of about --pool-gb GiB."""
    import torch

    from tiermoe.bench.records import random_records
    from tiermoe.kernels.layout import expert_layout
    from tiermoe.store.records import RecordLayout

    g = args.group_size if kind != "bf16" else None
    layout = RecordLayout.build(kind, args.hidden, args.inter, g)  # UserError on a shape that does not tile
    klay = expert_layout(kind, args.hidden, args.inter, g or 0)
    n = max(args.experts + 1, int(args.pool_gb * 2**30 // layout.length))
    return layout, random_records(klay, n, torch.device("cpu"), torch.Generator().manual_seed(0))


def _store_pool(path: str, args):
    """(store RecordLayout, uint8 [n, R] records read from the store) of about --pool-gb GiB."""
    import numpy as np
    import torch

    from tiermoe.store.records import check_experts_file, load_manifest

    m = load_manifest(path)
    check_experts_file(m)
    layout = m.layout
    n = min(len(m.records), max(args.experts + 1, int(args.pool_gb * 2**30 // layout.length)))
    raw = np.memmap(m.experts_path, dtype=np.uint8, mode="r")
    pool = torch.empty(n, layout.length, dtype=torch.uint8)  # [n, R]
    for i, r in enumerate(m.records[:n]):
        pool[i].numpy()[:] = raw[r.offset : r.offset + layout.length]
    return layout, pool


def host_read_gbs(pool, threads: int, seconds: float, pin: bool) -> float:
    """GB/s of a `threads`-thread read of every byte of `pool` (best of the passes in `seconds`):
    the lane's own thread pool reading 8-byte words where the compiled kernel loads, else torch's
    threads summing them."""
    import torch

    from tiermoe.moe.lane_kernel import lane_pool

    flat = pool.view(-1)
    words = flat[: flat.numel() // 8 * 8].view(torch.int64)  # integer sums: no denormal stalls
    native = lane_pool(threads, pin)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best, t_end = 0.0, time.perf_counter() + seconds
        while True:
            t0 = time.perf_counter()
            if native is not None:
                native.read(words)
            else:
                words.sum()
            best = max(best, words.numel() * 8 / (time.perf_counter() - t0) / 1e9)
            if time.perf_counter() > t_end:
                return best
    finally:
        torch.set_num_threads(prev)
        if native is not None:
            native.close()


def lane_cell(layout, pool, threads: int, tokens: int, experts: int, seconds: float, isa: str = "avx512bf16",
              pin: bool = True, tuning=None, set_up: str = "compiled") -> dict:
    """Time the lane on `experts` records of `pool` per call, each routed by all `tokens` tokens, as the
    device cache's mailbox calls it (CpuLane.compute_posted on a posted layer's words; set_up "python":
    those words decoded in Python and CpuLane.compute, the per-expert torch set-up of before), with
    `threads` threads; the records change every call (cycled through the pool)."""
    import torch

    from tiermoe.kernels.layout import expert_layout
    from tiermoe.moe.cpu_lane import CpuLane, posted_routing
    from tiermoe.moe.lane_cost import tuning_label

    weight_bytes = expert_layout(layout.kind, layout.hidden, layout.intermediate, layout.group_size or 0).weight_bytes
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, layout.hidden, generator=gen).to(torch.bfloat16)  # [T, H]
    weights = torch.full((tokens, experts), 1.0 / experts).view(torch.int32)  # [T, experts] fp32 bits
    n = pool.shape[0]
    records = [pool[e] for e in range(n)]  # expert id = record index in the pool
    rec_of = torch.tensor([r.data_ptr() for r in records], dtype=torch.int64)  # [n]
    metas, cursor = [], 0  # the words of every call of the cycle: lane ids | topk ids (all picks) | weights
    while not metas or cursor != 0:
        picked = torch.tensor([(cursor + e) % n for e in range(experts)], dtype=torch.int32)
        metas.append(torch.cat([picked, picked.repeat(tokens), weights.flatten()]))
        cursor = (cursor + experts) % n
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)  # compute() runs in this thread
    lane = CpuLane([layout], max_experts=experts, max_tokens=tokens, threads=threads, act_dtype=torch.bfloat16,
                   isa=isa, pin=pin, tuning=tuning)
    calls = 0
    try:
        def call():
            meta = metas[calls % len(metas)]
            if set_up == "compiled":
                return lane.compute_posted(0, x, meta, experts, experts, rec_of, records)
            picked, ids, w = posted_routing(meta, experts, experts, tokens)
            return lane.compute(0, x, ids, w, {e: records[e] for e in picked})

        call()  # warm-up: first-use costs (thread start, kernel load) are not the lane's rate
        c0 = dict(lane.c.as_dict())
        t0 = time.perf_counter()
        while True:
            call()
            calls += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds and calls >= 2:
                break
        counters = lane.counters(calls * tokens)
    finally:
        lane.close()
        torch.set_num_threads(prev)
    done = calls * experts
    return {"threads": threads, "tokens": tokens, "experts_per_call": experts, "calls": calls,
            "gbs": done * weight_bytes / elapsed / 1e9, "ms_per_expert": elapsed / done * 1e3,
            "us_per_call": elapsed / calls * 1e6, "set_up": set_up,
            "repacks_per_expert": (counters.get("repacks", 0) - c0.get("repacks", 0)) / done,
            "kernel": counters.get("kernel"), "tuning": None if tuning is None else tuning_label(tuning)}


def _tunings(args) -> list:
    """Every combination of --item-rows, --ahead-rows and --prefetch-hint ([None]: none given)."""
    from tiermoe.kernels.cpu.native import LaneTuning

    if args.item_rows is None and args.ahead_rows is None and args.prefetch_hint is None:
        return [None]
    base = LaneTuning()
    items = []
    for part in (args.item_rows or f"{base.rows_gu}:{base.rows_down}").split(","):
        gu, _, down = part.strip().partition(":")
        items.append((_ints(gu, "--item-rows")[0], _ints(down or gu, "--item-rows")[0]))
    aheads = [a.strip() for a in (args.ahead_rows or str(base.ahead_rows)).split(",") if a.strip()]
    if not aheads or not all(a.isdigit() for a in aheads):
        raise UserError(f"--ahead-rows: expected comma-separated integers >= 0, got {args.ahead_rows!r}")
    hints = _ints(args.prefetch_hint or str(base.hint), "--prefetch-hint")
    if max(hints) > 3:
        raise UserError(f"--prefetch-hint: 1, 2 or 3, got {args.prefetch_hint!r}")
    return [LaneTuning(gu, down, int(a), h) for gu, down in items for a in aheads for h in hints]


def _spinners(n: int) -> list:
    """n processes that spin on a core each until killed."""
    import subprocess
    import sys

    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def run_lane_bench(args) -> dict:
    kinds, threads, tokens = _check(args)
    tunings = _tunings(args)
    if args.busy < 0:
        raise UserError("--busy: a count >= 0")
    spinners = _spinners(args.busy)
    try:
        return _measure(args, kinds, threads, tokens, tunings, _set_ups(args))
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()


def _measure(args, kinds: list[str], threads: list[int], tokens: list[int], tunings: list,
             set_ups: list[str]) -> dict:
    import torch

    pools = [_store_pool(args.store, args)] if args.store else [_synthetic_pool(k, args) for k in kinds]
    host = {}
    for t in threads:
        host[t] = max(host_read_gbs(p, t, args.seconds, not args.no_pin) for _, p in pools)
    best: dict[tuple, dict] = {}  # (pool, threads, tokens, tuning, set-up) -> the fastest round's cell
    cells = [(t, n, u, su) for t in threads for n in tokens for u in tunings for su in set_ups]
    for rnd in range(args.repeat):
        for i, (layout, pool) in enumerate(pools):
            for t, n_tok, tuning, set_up in cells:
                cell = lane_cell(layout, pool, t, n_tok, args.experts, args.seconds, args.isa, not args.no_pin,
                                 tuning, set_up)
                cell.update(kind=layout.kind, host_read_gbs=host[t], share_of_host=cell["gbs"] / host[t])
                key = (i, t, n_tok, cell["tuning"], set_up)
                if key not in best or cell["ms_per_expert"] < best[key]["ms_per_expert"]:
                    best[key] = cell
                if args.repeat == 1:
                    print(_row_line(cell), flush=True)
    rows = list(best.values())  # pool, threads, tokens order
    if args.repeat > 1:
        for cell in rows:
            print(_row_line(cell), flush=True)
    versus = compare_with_int4(rows)
    if versus:
        print(VERSUS_HEADER, flush=True)
        for v in versus:
            print(_versus_line(v), flush=True)
    layout = pools[0][0]
    return {"shape": {"hidden": layout.hidden, "inter": layout.intermediate, "group_size": layout.group_size},
            "store": args.store, "cores": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "host_read_gbs": {str(t): g for t, g in host.items()}, "repeat": args.repeat, "busy": args.busy,
            "rows": rows,
            "versus_int4": versus}


def compare_with_int4(rows: list[dict]) -> list[dict]:
    """Each non-int4 row beside the int4 row of the same threads and tokens: ms per expert, weight GB/s and
    share of the host read of both, and the ratio of the ms (below 1: faster per expert than int4)."""
    int4 = {(r["threads"], r["tokens"], r.get("tuning"), r.get("set_up")): r for r in rows if r["kind"] == "int4"}
    out = []
    for r in rows:
        base = int4.get((r["threads"], r["tokens"], r.get("tuning"), r.get("set_up")))
        if r["kind"] == "int4" or base is None:
            continue
        out.append({"kind": r["kind"], "threads": r["threads"], "tokens": r["tokens"],
                    "ms_per_expert": r["ms_per_expert"], "int4_ms_per_expert": base["ms_per_expert"],
                    "ms_ratio": r["ms_per_expert"] / base["ms_per_expert"], "gbs": r["gbs"], "int4_gbs": base["gbs"],
                    "share_of_host": r["share_of_host"], "int4_share_of_host": base["share_of_host"]})
    return out


HEADER = ("kind  threads  tokens   lane GB/s  ms/expert  us/call  host read GB/s  lane/host  repacks/expert  "
          "set-up    kernel")


VERSUS_HEADER = (f"\n{'kind':<5} {'threads':>7} {'tokens':>7} {'ms/expert (int4)':>18} {'lane GB/s (int4)':>18} "
                 f"{'lane/host (int4)':>17} {'ms vs int4':>11}")


def _versus_line(v: dict) -> str:
    ms = f"{v['ms_per_expert']:.3f} ({v['int4_ms_per_expert']:.3f})"
    gbs = f"{v['gbs']:.2f} ({v['int4_gbs']:.2f})"
    share = f"{v['share_of_host']:.0%} ({v['int4_share_of_host']:.0%})"
    return f"{v['kind']:<5} {v['threads']:>7} {v['tokens']:>7} {ms:>18} {gbs:>18} {share:>17} {v['ms_ratio']:>10.2f}x"


def _row_line(r: dict) -> str:
    return (f"{r['kind']:<5} {r['threads']:>7} {r['tokens']:>7} {r['gbs']:>11.2f} {r['ms_per_expert']:>10.3f} "
            f"{r['us_per_call']:>8.0f} {r['host_read_gbs']:>15.1f} {r['share_of_host']:>10.0%} "
            f"{r['repacks_per_expert']:>15.2f}  {r['set_up']:<9} {r['kernel']}"
            + (f"  {r['tuning']}" if r.get("tuning") else ""))


def _run(args: argparse.Namespace) -> int:
    from tiermoe.bench.results import envelope, write_json

    from tiermoe.store.records import RecordLayout

    kinds = _check(args)[0]  # bad flags: one line before any output
    _tunings(args)
    _set_ups(args)
    for kind in kinds if args.store is None else ():
        RecordLayout.build(kind, args.hidden, args.inter, args.group_size if kind != "bf16" else None)
    if args.busy < 0:
        raise UserError("--busy: a count >= 0")
    print(HEADER, flush=True)
    result = run_lane_bench(args)
    write_json(envelope("lane", **result), args.out)
    if args.out:
        print(f"wrote {args.out}")
    return 0
