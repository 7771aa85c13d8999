#!/usr/bin/env python3
"""Summarise a py-spy raw (collapsed-stack) recording per thread: where each thread's wall time went.

    python3 scripts/pyspy_summary.py RECORDING.txt [--top 12] [--frames 4] [--thread SUBSTRING]

`scripts/gpu_decode_graph_check.sh` with SPY=1 records the server during an extra C1 sweep
(`py-spy record --threads --idle --format raw`); this prints each thread's share of the samples
and its heaviest stacks, cut to their innermost --frames frames, so a server-vs-in-process gap
can be read without a flamegraph viewer.
"""

from __future__ import annotations

import argparse
import collections
import sys


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("recording")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--frames", type=int, default=4)
    p.add_argument("--thread", default="", help="only threads whose name contains this")
    args = p.parse_args()
    per_thread: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    try:
        f = open(args.recording)
    except OSError as exc:
        print(f"pyspy_summary: cannot read {args.recording}: {exc.strerror}", file=sys.stderr)
        return 2
    with f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            thread, frames = frames[0], frames[1:]
            per_thread[thread][";".join(frames[-args.frames:])] += int(count)
    total = sum(sum(c.values()) for c in per_thread.values()) or 1
    for thread, stacks in sorted(per_thread.items(), key=lambda kv: -sum(kv[1].values())):
        if args.thread not in thread:
            continue
        n = sum(stacks.values())
        print(f"\n{thread}: {n} samples ({100 * n / total:.1f} % of all)")
        for stack, c in stacks.most_common(args.top):
            print(f"  {100 * c / n:5.1f} %  {stack}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
