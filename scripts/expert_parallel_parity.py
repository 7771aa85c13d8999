"""Logits of one process against two expert-parallel ranks (gloo, on the CPU), on a tiny glm4_moe with 4 picks a
token packed as bf16 records: what tests/parallel/ bounds, printed as figures.

    python scripts/expert_parallel_parity.py [--kernel torch|triton]

torch: the store path in fp32 and in bf16; triton: the Triton store path and the device cache (4 GPU records, its
disk tier holding the rank's share) in bf16, through Triton's interpreter (TRITON_INTERPRET=1 is set for the
ranks). Each line: the ranks' logits against one process's (tiermoe.eval.parity.compare), then whether the two
ranks agree and whether the ranks' logits are the same under each budget.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPT = [5, 17, 33, 64, 101, 250, 7, 300]
GB = 12288 / 2**30  # a bf16 record of the tiny glm4_moe
RUNS = {
    "torch": {"float32": {"ram": {"gpu_expert_gb": 0, "host_expert_gb": 16 * GB}},
              "bfloat16": {"ram": {"gpu_expert_gb": 0, "host_expert_gb": 16 * GB},
                           "small": {"gpu_expert_gb": 2 * GB, "host_expert_gb": 3 * GB}}},
    "triton": {"bfloat16": {"store-triton": {"expert_kernel": "triton", "device_cache": "off", "gpu_expert_gb": 0,
                                             "host_expert_gb": 16 * GB},
                            "cache-4": {"expert_kernel": "triton", "device_cache": "on", "gpu_expert_gb": 4 * GB,
                                        "host_expert_gb": 16 * GB}}},
}


def rank_main(rank: int, world: int, init: str, store: str, kernel: str, out: str) -> None:
    """One rank: the logits [2P, V] of PROMPT (one chunk, then a token a step) under each budget, saved."""
    import torch

    from tiermoe.engine.build import build_engine_core
    from tiermoe.eval.parity import engine_logits
    from tiermoe.parallel import join, leave

    join(rank, world, init, "cpu")
    try:
        got = {}
        for dtype, budgets in RUNS[kernel].items():
            for name, options in budgets.items():
                eng = build_engine_core(store, device="cpu", dtype=dtype, max_num_seqs=1,
                                        options={"tensor_parallel_size": world, **options})
                try:
                    got[(dtype, name)] = torch.cat([engine_logits(eng, PROMPT, chunk=len(PROMPT)),
                                                    engine_logits(eng, PROMPT, chunk=1)])
                finally:
                    eng.model.expert_backend.close()
        torch.save(got, out)
    finally:
        leave()


def _ranks(world: int, store: Path, kernel: str, tmp: Path) -> list[dict]:
    import torch

    outs = [tmp / f"{kernel}-{world}-{r}.pt" for r in range(world)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"TRITON_INTERPRET": "1"} if kernel == "triton" else {})}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(world), "--init",
                               f"file://{tmp / f'rv-{kernel}-{world}'}", "--store", str(store), "--kernel", kernel,
                               "--out", str(outs[r])], env=env) for r in range(world)]
    if any(p.wait() for p in procs):
        raise SystemExit("a rank failed")
    return [torch.load(o) for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel", choices=("torch", "triton"), default="torch")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--init", default=None, help=argparse.SUPPRESS)
    p.add_argument("--store", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        return rank_main(args.rank, args.world, args.init, args.store, args.kernel, args.out)
    import torch

    from tiermoe.eval.parity import compare
    from tiermoe.models.tiny import write_tiny
    from tiermoe.store.pack import pack

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        src = write_tiny("glm4_moe", tmp / "checkpoint")
        config = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 4}))
        pack(str(src), str(tmp / "store"), quant="bf16", progress=False, log=lambda _: None)
        (one,) = _ranks(1, tmp / "store", args.kernel, tmp)
        two = _ranks(2, tmp / "store", args.kernel, tmp)
        for (dtype, name), ref in one.items():
            m = compare(ref, two[0][(dtype, name)])
            same = all(torch.equal(two[0][k], two[1][k]) for k in two[0])
            budgets = all(torch.equal(two[0][(dtype, n)], two[0][(dtype, name)]) for (dt, n) in two[0] if dt == dtype)
            print(f"{args.kernel} {dtype} {name}: 2 ranks vs 1 process: top-1 {m['top1']:.3f}, KL mean "
                  f"{m['kl_mean']:.2e}, max {m['kl_max']:.2e}, max |logit diff| {m['max_abs_logit_diff']:.3g}; "
                  f"ranks agree: {same}; same under every {dtype} budget: {budgets}")


if __name__ == "__main__":
    main()
