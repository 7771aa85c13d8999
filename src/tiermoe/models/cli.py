"""`tiermoe tiny ARCH OUT_DIR`."""

from __future__ import annotations


def register(subparsers) -> None:
    from tiermoe.models.registry import TINY_ARCHS

    p = subparsers.add_parser("tiny", help="write a small seeded random checkpoint of ARCH")
    p.add_argument("arch", metavar="ARCH", help=f"one of: {', '.join(TINY_ARCHS)}")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.set_defaults(handler=_run)


def _run(args) -> int:
    from tiermoe.models.tiny import write_tiny

    out = write_tiny(args.arch, args.out_dir, seed=args.seed, dtype=args.dtype)
    print(out)
    return 0
