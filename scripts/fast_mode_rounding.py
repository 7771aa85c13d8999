"""How often fast mode's layer output leaves exact mode's, from the way the two parts of a layer are added alone
(no kernel, no model): exact mode rounds the fp32 sum of a token's picks to bf16 once; fast mode adds the GPU's
part and the CPU lane's part, either rounding the GPU's part to bf16 first (before 2f09bd8) or keeping it fp32.

    python3 scripts/fast_mode_rounding.py [--tokens 64] [--hidden 4096] [--picks 8] [--lane 3]

Prints the share of bf16 elements that differ from exact mode's for both ways (docs/results.md section 33).
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--picks", type=int, default=8)
    ap.add_argument("--lane", type=int, default=3, help="picks of each token the CPU lane computes")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(args.seed)
    weight = torch.rand(args.tokens, args.picks, 1, generator=g)  # routing weights [T, k, 1]
    y = torch.randn(args.tokens, args.picks, args.hidden, generator=g) * weight  # weighted expert outputs fp32
    on_lane = torch.arange(args.picks) >= args.picks - args.lane  # [k]
    exact = y.sum(1).to(torch.bfloat16)  # [T, H]: one rounding
    gpu, lane = y[:, ~on_lane].sum(1), y[:, on_lane].sum(1)  # fp32 [T, H] each
    twice = (gpu.to(torch.bfloat16).float() + lane).to(torch.bfloat16)
    once = (gpu + lane).to(torch.bfloat16)
    for name, got in (("GPU part rounded first", twice), ("both parts rounded once", once)):
        print(f"{name}: {float((got != exact).float().mean()):.6f} of the elements differ from exact mode's")


if __name__ == "__main__":
    main()
