"""`tiermoe eval parity (--model PATH | --tiny ARCH) [--reference PATH] [--device] [--dtype]`."""

from __future__ import annotations

import tempfile


def register(subparsers) -> None:
    p = subparsers.add_parser("eval", help="quality checks against a reference")
    sub = p.add_subparsers(dest="eval_command", metavar="EVAL")
    sub.required = True
    par = sub.add_parser("parity", help="teacher-forced logits vs the transformers reference")
    src = par.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory or packed store")
    src.add_argument("--tiny", metavar="ARCH", help="a tiny random checkpoint of ARCH, written to a temp dir")
    par.add_argument("--reference", help="reference checkpoint for transformers (default: --model)")
    par.add_argument("--device", default=None)
    par.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    par.set_defaults(handler=_parity)


def _parity(args) -> int:
    from tiermoe.engine.build import resolve_device
    from tiermoe.eval.parity import format_result, run_parity

    device = resolve_device(args.device)
    dtype = args.dtype or ("float32" if device == "cpu" else "bfloat16")
    if args.tiny:
        from tiermoe.models.tiny import write_tiny

        with tempfile.TemporaryDirectory(prefix="tiermoe-tiny-") as tmp:
            write_tiny(args.tiny, tmp)
            result = run_parity(tmp, None, device, dtype, arch=args.tiny)
    else:
        result = run_parity(args.model, args.reference, device, dtype)
    print(format_result(result))
    return 0
