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


def _check_out_dir(text: str) -> None:
    """OUT_DIR must be new or empty and creatable: the checkpoint's files would replace those of the
    same names in a directory holding something else (a real model's config.json), and "" is the
    working directory (an unset shell variable)."""
    from pathlib import Path

    from tiermoe.errors import UserError

    if not text.strip():
        raise UserError("OUT_DIR is empty: give the directory to write the checkpoint to")
    out = Path(text)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"{out}: directory is not empty; choose a new or empty directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a parent that is a file, or one this user cannot write
        raise UserError(f"{out}: cannot create the directory ({exc.strerror or exc})") from None


def _run(args) -> int:
    from tiermoe.errors import UserError
    from tiermoe.models.registry import TINY_ARCHS
    from tiermoe.models.tiny import write_tiny

    if args.arch not in TINY_ARCHS:  # before OUT_DIR is made
        raise UserError(f"unknown architecture '{args.arch}' for tiny (choose from {', '.join(TINY_ARCHS)})")
    if args.distill_mtp and args.arch != "glm5_next":
        raise UserError(f"--distill-mtp: {args.arch} has no MTP layer (only glm5_next)")
    if not -2**63 <= args.seed < 2**64:  # torch.Generator.manual_seed's range
        raise UserError(f"--seed {args.seed}: out of range (a 64-bit integer)")
    _check_out_dir(args.out_dir)
    out = write_tiny(args.arch, args.out_dir, seed=args.seed, dtype=args.dtype)
    if args.distill_mtp:
        from tiermoe.models.glm5_next.distill import distill_mtp

        r = distill_mtp(out, seed=args.seed)
        print(f"MTP distillation: {r.steps} steps in {r.seconds:.1f} s, held-out next-next agreement "
              f"{r.agreement_before:.1%} -> {r.agreement_after:.1%}")
    print(out)
    return 0
