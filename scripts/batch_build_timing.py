#!/usr/bin/env python3
"""Host time of building one decode step's ForwardBatch at long contexts (CPU, no model).

    python3 scripts/batch_build_timing.py [--seqs 4] [--contexts 4096,20480,200000]

A decode step rebuilds its batch on the host every token; at long contexts the page lists are
long (12.5k pages of 16 tokens at 200k), so this is per-token latency the GPU cannot hide.
Prints ms per build with block tables (the paged decode kernel) and with whole-context KV
indices (SDPA and MLA cores).
"""

from __future__ import annotations

import argparse
import sys
import time

from tiermoe.models.batch import build_forward_batch


def _contexts(text: str) -> list[int]:
    try:
        values = [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of token counts: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("token counts must be >= 1")
    return values


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, default=4, choices=range(1, 257), metavar="1..256")
    p.add_argument("--contexts", default="4096,20480,200000", type=_contexts, help="comma-separated token counts")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    if args.reps < 1 or args.page_size < 1:
        p.error("--reps and --page-size must be >= 1")
    ps = args.page_size
    for ctx in args.contexts:
        pages = list(range(ctx // ps + 2))
        chunks = [([5], ctx - 1, pages, b) for b in range(args.seqs)]
        width = -(-max(ctx, 204800) // ps)
        for name, kw in (("block tables", {"table_blocks": width}), ("KV indices", {})):
            build_forward_batch(chunks, ps, "cpu", **kw)
            t = time.perf_counter()
            for _ in range(args.reps):
                build_forward_batch(chunks, ps, "cpu", **kw)
            print(
                f"context {ctx:>7}, {args.seqs} seqs, {name:<12}: {(time.perf_counter() - t) / args.reps * 1e3:.2f} ms"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
