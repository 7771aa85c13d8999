"""`tiermoe tiny ARCH OUT_DIR`."""

from __future__ import annotations


def register(subparsers) -> None:
    from tiermoe.models.registry import TINY_ARCHS

    p = subparsers.add_parser("tiny", help="write a small seeded random checkpoint of ARCH",
                              description="Write a small checkpoint of ARCH with seeded random weights and a tiny "
                                          "tokenizer to OUT_DIR: a model every command can load in seconds on a "
                                          "CPU, for trying `serve`, `pack`, `plan` and `generate` without a "
                                          "download (its text is gibberish).")
    p.add_argument("arch", metavar="ARCH", help=f"one of: {', '.join(TINY_ARCHS)}")
    p.add_argument("out_dir", metavar="OUT_DIR", help="directory to write (config.json, safetensors, tokenizer)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weight dtype")
    p.add_argument("--distill-mtp", action="store_true",
                   help="glm5_next: train the MTP layer on the trunk's own predictions (CPU, under a minute)")
    p.set_defaults(handler=_run)


def _run(args) -> int:
    from tiermoe.models.tiny import write_tiny

    if args.distill_mtp and args.arch != "glm5_next":
        from tiermoe.errors import UserError

        raise UserError(f"--distill-mtp: {args.arch} has no MTP layer (only glm5_next)")
    out = write_tiny(args.arch, args.out_dir, seed=args.seed, dtype=args.dtype)
    if args.distill_mtp:
        from tiermoe.models.glm5_next.distill import distill_mtp

        r = distill_mtp(out, seed=args.seed)
        print(f"MTP distillation: {r.steps} steps in {r.seconds:.1f} s, held-out next-next agreement "
              f"{r.agreement_before:.1%} -> {r.agreement_after:.1%}")
    print(out)
    return 0
