#!/usr/bin/env python3
"""At what rate does the device cache's gather move misses when a layer has only a few of them?
(docs/results.md sections 13-14: the gather is a third of a batch-1 and two thirds of a batch-4
decode step's GPU time; moe-gpu's gathers of ~5 records per call reached ~50 GB/s.)

    python3 scripts/gpu_gather_probe.py [--record-mib 10.125] [--gib 4]

Times `gather_records` (the device cache's host -> HBM copy kernel) for 1, 2, 4, 8 and 16
records per call from two kinds of pinned host memory: the store's host arena (1 GiB chunks,
cudaHostRegister flags 0, registered by a background thread) and moe-gpu's `pin_host` buffer
(one allocation, flags 3), against the copy engine (`Tensor.copy_` per record). Records are
spread over the whole buffer (a decode step's misses are), and each call reads records no
earlier call touched, so no cache or TLB state carries over. Prints GB/s per case. Needs CUDA.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ from the checkout
    from benchmarks.expert_stack import pin_host
    from tiermoe.kernels.triton.cache_manager import gather_records
    from tiermoe.store.tiers import Arena

    p = argparse.ArgumentParser()
    p.add_argument("--record-mib", type=float, default=10616832 / 2**20)
    p.add_argument("--gib", type=float, default=4.0, help="host memory of each kind")
    args = p.parse_args()
    r = int(args.record_mib * 2**20) // 4096 * 4096
    n = int(args.gib * 2**30 // r)
    dev = torch.device("cuda")
    arena = Arena(n, r, torch.device("cpu"), host=True, pin=True)
    arena.wait_pinned()
    pool = pin_host(n * r).view(n, r)
    kinds = {"store arena": [arena.entry(i) for i in range(n)], "pin_host": [pool[i] for i in range(n)]}
    for entries in kinds.values():
        for i in range(0, n, max(1, n // 64)):
            entries[i].fill_(i % 251)
    dst = torch.empty(16, r, dtype=torch.uint8, device=dev)
    dst_addr = torch.tensor([dst[i].data_ptr() for i in range(16)], dtype=torch.int64, device=dev)
    rnd = random.Random(0)
    # Warm the link and clocks first: the first timed case read 8.0 and 10.1 GB/s in two runs
    # (docs/results.md sections 15-16) while the same case on other memory read 48-49.
    warm_src = torch.tensor([e.data_ptr() for e in kinds["store arena"][:16]], dtype=torch.int64, device=dev)
    warm_cnt = torch.tensor([warm_src.numel()], dtype=torch.int32, device=dev)
    for _ in range(20):
        gather_records(warm_src, dst_addr, warm_cnt, r)
    torch.cuda.synchronize()
    print(f"record {r} bytes, {n} records per kind")
    print("| memory | records per call | gather kernel GB/s | copy engine GB/s |")
    print("|---|---|---|---|")
    for name, entries in kinds.items():
        order = list(range(n))
        rnd.shuffle(order)
        pos = 0
        for m in (1, 2, 4, 8, 16):
            reps = max(4, 64 // m)
            rates = []
            for mode in ("gather", "copy"):
                if pos + m * reps > n:
                    pos = 0
                picks = [order[pos + j] for j in range(m * reps)]
                pos += m * reps
                src = torch.tensor([entries[e].data_ptr() for e in picks], dtype=torch.int64, device=dev)
                cnt = torch.tensor([m], dtype=torch.int32, device=dev)
                gather_records(src[:m], dst_addr[:m], cnt, r)  # compile / warm
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for k in range(reps):
                    if mode == "gather":
                        gather_records(src[k * m : (k + 1) * m], dst_addr[:m], cnt, r)
                    else:
                        for j in range(m):
                            dst[j].copy_(entries[picks[k * m + j]], non_blocking=True)
                b.record()
                torch.cuda.synchronize()
                rates.append(m * reps * r / (a.elapsed_time(b) / 1e3) / 1e9)
            print(f"| {name} | {m} | {rates[0]:.1f} | {rates[1]:.1f} |")
    arena.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
