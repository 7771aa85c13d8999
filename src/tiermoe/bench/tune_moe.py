"""`tiermoe bench tune-moe`: tune the fused MoE kernel's launch configurations for one record shape.

A packed store whose record shape has no tuned entry falls back to a heuristic configuration
(kernels/triton/fused_moe.py `default_config`), which can leave the MoE kernel far below what
the GPU sustains (docs/results.md has the measured case). This builds random records of the
given shape in GPU memory (uniform routing) and runs the launch-config search
(kernels/triton/tuning.py; `tiermoe bench moe-gpu --tune` runs the same for GLM-5.3-Flash's
shape), then merges the winners into a configs JSON under this GPU's name (default: the
package's configs.json, which the engine reads). Needs CUDA.

It also prints the weight GB/s of a one-token decode call with the tuned configuration
(`decode_t1_GBps`; the default configuration's beside it): the figure that compares record kinds,
e.g. `--kind int3` against `--kind int4` at one shape, with the HBM copy rate as the ceiling.

    tiermoe bench tune-moe --hidden 4096 --inter 1536 --experts 128 --top-k 8 --group-size 32
"""

from __future__ import annotations

import argparse
import json

from tiermoe.errors import UserError


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("tune-moe", help="tune the fused MoE kernel for one expert record shape (CUDA)")
    p.add_argument("--hidden", type=int, required=True, help="hidden size of the model")
    p.add_argument("--inter", type=int, required=True, help="intermediate size of one expert")
    p.add_argument("--experts", type=int, default=64, help="experts to build (routing spreads over them)")
    p.add_argument("--top-k", type=int, default=8, help="routed experts per token")
    p.add_argument("--group-size", type=int, default=128, help="scale group size of the store (quantized kinds)")
    p.add_argument("--kind", choices=("int4", "int3", "int8", "bf16"), default="int4", help="expert record format")
    p.add_argument("--prefill-tokens", type=int, default=4096, help="tokens of the prefill bucket's timing")
    p.add_argument("--time-budget", type=float, default=120.0, help="seconds of search")
    p.add_argument("--out", default=None, help="configs JSON to write (default: the package's configs.json)")
    p.set_defaults(handler=_handler)


def _handler(args: argparse.Namespace) -> int:
    import torch

    from tiermoe.bench.records import random_records
    from tiermoe.kernels.layout import expert_layout
    from tiermoe.kernels.triton import fused_moe, tuning

    if not torch.cuda.is_available():
        raise UserError("tune-moe needs a CUDA device (launch configurations are timed on the GPU)")
    for name in ("hidden", "inter", "experts", "top_k", "group_size"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1")
    if args.top_k > args.experts:
        raise UserError(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    try:
        layout = expert_layout(args.kind, args.hidden, args.inter, args.group_size)
    except ValueError as exc:
        raise UserError(f"record shape: {exc}") from None
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    records = random_records(layout, args.experts, dev, gen)  # [E, R] uint8 in HBM
    pop = torch.full((args.experts,), 1.0 / args.experts, device=dev)
    cfgs, report = tuning.tune(
        layout, records, pop, args.top_k, args.prefill_tokens, gen, time_budget_s=args.time_budget
    )
    out = args.out or str(fused_moe.CONFIG_PATH)
    tuning.save_configs(out, torch.cuda.get_device_name(dev), layout, cfgs)
    print(
        json.dumps(
            {
                "shape": fused_moe.shape_key(layout),
                "configs": cfgs,
                "decode_s": report["decode_s"],
                "prefill_s": report["prefill_s"],
                "decode_t1_GBps": report["decode_t1_GBps"],
                "default": report["default"],
                "gemv_vs_block_s": report["trials"].get("gemv_vs_block"),
                "written": out,
            },
            indent=1,
        )
    )
    return 0
