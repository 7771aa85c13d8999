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
    par.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    par.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    par.add_argument("--chunk", type=int, default=32, help="prefill chunk size of our engine (tokens)")
    par.add_argument("--decode-from", type=int, default=None, metavar="N",
                     help="from token N on (rounded up to the model's chunk multiple; 0: every token), one "
                          "token a forward: the decode path and its CUDA graphs instead of prefill chunks")
    par.set_defaults(handler=_parity)
    _register_tiers(sub)
    from tiermoe.eval.paired_kl import register_paired_kl

    register_paired_kl(sub)


def _parity(args) -> int:
    from tiermoe.engine.build import resolve_device
    from tiermoe.errors import UserError
    from tiermoe.eval.parity import format_result, run_parity

    if args.chunk < 1:
        raise UserError(f"--chunk must be at least 1 token, not {args.chunk}")
    if args.decode_from is not None and args.decode_from < 0:
        raise UserError(f"--decode-from must be 0 or more, not {args.decode_from}")
    if args.reference is not None:
        _check_reference(args.reference)
    device = resolve_device(args.device)
    dtype = args.dtype or ("float32" if device == "cpu" else "bfloat16")
    if args.tiny:
        from tiermoe.models.tiny import write_tiny

        with tempfile.TemporaryDirectory(prefix="tiermoe-tiny-") as tmp:
            write_tiny(args.tiny, tmp)
            result = run_parity(tmp, None, device, dtype, arch=args.tiny, chunk=args.chunk,
                                decode_from=args.decode_from)
    else:
        result = run_parity(args.model, args.reference, device, dtype, chunk=args.chunk,
                            decode_from=args.decode_from)
    print(format_result(result))
    return 0


def _check_reference(path: str) -> None:
    """--reference is loaded by transformers: a path that is no checkpoint ended in its OSError or ValueError
    traceback (after our engine had loaded), and a packed store, whose routed experts are in experts.bin where
    transformers does not look, loaded with random experts and reported a large logit difference as a result."""
    from pathlib import Path

    from tiermoe.engine.build import is_packed_store
    from tiermoe.errors import UserError

    ref = Path(path)
    if not path.strip() or not (ref / "config.json").is_file():
        raise UserError(f"--reference {path!r}: not a checkpoint directory (no config.json)")
    if is_packed_store(ref):
        raise UserError(f"--reference {path}: a packed store; give the checkpoint it was packed from")


def _register_tiers(sub) -> None:
    t = sub.add_parser("tiers", help="bit-identical logits across expert tier sizes of a packed store")
    t.add_argument("--model", required=True, help="packed store directory")
    t.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    t.add_argument("--gpu-fractions", default="1.0,0.1,0.0", help="shares of all experts in device slots")
    t.add_argument("--host-fractions", default="all,0.1,0.0",
                   help="shares of all experts in host RAM ('all' = default sizing)")
    from tiermoe.engine.build import add_routing_args

    add_routing_args(t, record=False)  # the same replayed picks in every configuration
    t.set_defaults(handler=_tiers)


def _tiers(args) -> int:
    import json
    import math

    from tiermoe.engine.build import resolve_device
    from tiermoe.errors import UserError
    from tiermoe.eval.tiers import run_tiers

    try:
        gpu = [float(x) for x in args.gpu_fractions.split(",")]
        host = [None if x == "all" else float(x) for x in args.host_fractions.split(",")]
    except ValueError:
        raise UserError("--gpu-fractions/--host-fractions: comma-separated numbers (or 'all')") from None
    for flag, shares in (("--gpu-fractions", gpu), ("--host-fractions", host)):
        bad = [x for x in shares if x is not None and not 0 <= x < math.inf]  # above 1: every expert
        if bad:  # else refused later under --gpu-expert-gb, a flag this command does not have
            raise UserError(f"{flag}: {bad[0]} is no share of the experts (a finite number >= 0)")
    routing = {"routing_replay": args.routing_replay, "routing_replay_seed": args.routing_replay_seed}
    result = run_tiers(args.model, resolve_device(args.device), gpu, host, routing)
    for r in result["configs"]:
        print(f"gpu {r['gpu_fraction']:.2f} host {r['host_fraction'] if r['host_fraction'] is not None else 'all'}: "
              f"{'bit-identical' if r['bit_identical'] else 'DIFFERENT'} ({r['positions']} positions)")
    print(json.dumps({k: v for k, v in result.items() if k != "configs"} | {"configs": [
        {k: v for k, v in r.items() if k != "counters"} for r in result["configs"]]}))
    return 0 if result["all_bit_identical"] else 1
