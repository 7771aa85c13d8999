#!/usr/bin/env python3
"""How long does one MoE layer of a short prefill chunk take when its misses are read in place?

The device cache reads a non-decode chunk's non-resident experts in place from pinned host memory
below prefill_staging.STAGE_TOKENS tokens, and copies them to staging rows from there on. A chunk
of a few new tokens behind a cached prefix (a multi-turn chat, a C4 sweep's second turn) is such a
chunk. This times, on GLM-5.3-Flash's expert shape (int4 G128, 288 experts, top-8, 30 of them in
HBM slots as at 11 % of a 16-layer store), picks drawn from the real statistics, for each chunk size:

    in-place      fused_moe over the slot/host table, the launch configuration the server picks
    in-place/dec  the same with the decode bucket's configuration (BM 16) at every size
    staged        the picked misses copied to HBM (one copy per record, copy engine, after a host
                  read of the picks as the per-layer staging does), then fused_moe on HBM only

    python3 scripts/short_prefill_probe.py [--stats docs/data/real-routing-2026-12-04/glm-expert-stats.json]
                                           [--tokens 1,2,4,8,16,17,24,32,48,63,64,128] [--out probe.json]

Prints ms per layer per case and the misses' GB/s. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> int:
    from tiermoe.bench.records import random_records
    from tiermoe.kernels.layout import expert_layout
    from tiermoe.kernels.triton.fused_moe import fused_moe, get_config
    from tiermoe.moe.replay import replay_tables
    from tiermoe.store.tiers import Arena

    p = argparse.ArgumentParser()
    p.add_argument("--stats", default="docs/data/real-routing-2026-12-04/glm-expert-stats.json")
    p.add_argument("--tokens", default="1,2,4,8,16,17,24,32,48,63,64,128")
    p.add_argument("--slots", type=int, default=30, help="experts of the layer in HBM slots (the most popular)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", default="")
    a = p.parse_args()
    dev = torch.device("cuda")
    lay = expert_layout("int4", 4096, 2048, 128)
    e, k, r = 288, 8, lay.length
    ids_all, _ = replay_tables(a.stats, num_layers=1, num_experts=e, top_k=k, seed=3, table_tokens=8192)
    ids_all = torch.from_numpy(ids_all[0].astype("int64"))  # [N, k]
    arena = Arena(e, r, torch.device("cpu"), host=True, pin=True)
    arena.wait_pinned()
    gen = torch.Generator(dev).manual_seed(0)
    for c0 in range(0, e, 32):
        recs = random_records(lay, min(32, e - c0), dev, gen).cpu()
        for j in range(recs.shape[0]):
            arena.entry(c0 + j).copy_(recs[j])
    popular = torch.bincount(ids_all.flatten(), minlength=e).argsort(descending=True)[: a.slots].tolist()
    slots = torch.empty(max(1, a.slots), r, dtype=torch.uint8, device=dev)
    host_ptr = [arena.entry(i).data_ptr() for i in range(e)]
    table = list(host_ptr)
    for s, ex in enumerate(popular):
        slots[s].copy_(arena.entry(ex))
        table[ex] = slots[s].data_ptr()
    table_dev = torch.tensor(table, dtype=torch.int64, device=dev)
    staging = torch.empty(e, r, dtype=torch.uint8, device=dev)
    in_slot = torch.zeros(e, dtype=torch.bool, device=dev)
    in_slot[popular] = True
    dec_cfg = get_config(lay, 1, dev)
    dec_cfg = {s: dec_cfg[s] for s in ("gate_up", "down")}  # the block kernels' decode bucket, no gemv
    cursor = 0
    rows = []
    print(f"int4 G128 H4096 I2048 records of {r} B, {e} experts, {a.slots} in slots; ms per layer (median of {a.reps})")
    print("| tokens | distinct misses | in-place ms | in-place, decode config ms | staged ms | staged GB/s |")
    print("|---|---|---|---|---|---|")
    for t in [int(s) for s in a.tokens.split(",")]:
        times: dict[str, list[float]] = {"inplace": [], "inplace_dec": [], "staged": []}
        misses = []
        for rep in range(a.reps + 1):  # the first rep warms (compiles) and is dropped
            ids = ids_all[cursor : cursor + t].to(dev)
            cursor = (cursor + t) % (ids_all.shape[0] - 256)
            x = torch.randn(t, 4096, dtype=torch.bfloat16, device=dev) * 0.1
            w = torch.rand(t, k, device=dev)
            for name in times:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if name == "inplace":
                    fused_moe(x, ids, w, table_dev, lay)
                elif name == "inplace_dec":
                    fused_moe(x, ids, w, table_dev, lay, config=dec_cfg)
                else:
                    used = torch.zeros(e, dtype=torch.bool, device=dev)
                    used[ids.reshape(-1)] = True
                    need = torch.nonzero(used & ~in_slot).flatten().tolist()  # the host read of the picks
                    staged = table_dev.clone()
                    for row, ex in enumerate(need):
                        staging[row].copy_(arena.entry(ex), non_blocking=True)
                    if need:
                        staged[torch.tensor(need, device=dev)] = (
                            torch.arange(len(need), device=dev) * r + staging.data_ptr())
                    fused_moe(x, ids, w, staged, lay)
                    misses.append(len(need))
                torch.cuda.synchronize()
                if rep:
                    times[name].append((time.perf_counter() - t0) * 1e3)
        med = {n: statistics.median(v) for n, v in times.items()}
        miss = statistics.median(misses[1:])
        gbs = miss * r / (med["staged"] / 1e3) / 1e9
        rows.append({"tokens": t, "distinct_misses": miss, **{f"{n}_ms": round(v, 3) for n, v in med.items()},
                     "staged_gbs": round(gbs, 1)})
        print(f"| {t} | {miss:.0f} | {med['inplace']:.2f} | {med['inplace_dec']:.2f} | {med['staged']:.2f} "
              f"| {gbs:.1f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "record_bytes": r, "slots": a.slots, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
