"""`tiermoe bench decode`: in-process decode tokens/s at batch 1 and 4 (a benchmark, not a test).

Each batch size decodes `--tokens` greedy tokens per sequence after a short prompt; the first
step (prefill) is excluded from the timing. On CUDA the clock is read after a synchronise.
"""

from __future__ import annotations

import random
import tempfile
import time


def register(bench_subparsers) -> None:
    from tiermoe.engine.build import add_engine_args

    p = bench_subparsers.add_parser("decode", help="in-process decode tokens/s at batch 1 and 4")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory or packed store")
    src.add_argument("--tiny", metavar="ARCH", help="a tiny random checkpoint of ARCH")
    add_engine_args(p, model_positional=True)
    p.add_argument("--batch-sizes", default="1,4", help="comma-separated batch sizes to measure")
    p.add_argument("--tokens", type=int, default=64, help="decode tokens per sequence")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sequence")
    p.add_argument("--out", help="write the figures as JSON")
    p.set_defaults(handler=_run)


def measure(engine, batch: int, tokens: int, prompt_len: int, seed: int = 0) -> dict:
    """One round of `batch` sequences decoding `tokens` each: tok/s after the prefill step, and how the expert
    tiers served its decode tokens (`tiers_per_token`, None with resident experts)."""
    import torch

    from tiermoe.bench.sweep import tier_counters, tiers_per_token
    from tiermoe.protocol import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=tokens + 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", [rng.randrange(engine.vocab_size) for _ in range(prompt_len)], params)
    produced, t0, before = 0, None, None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if t0 is None:  # the first step is the prefill
            if engine.model.device.type == "cuda":
                torch.cuda.synchronize()
            before = tier_counters(engine.stats().get("experts"))
            t0 = time.perf_counter()
            continue
        produced += sum(len(o.new_token_ids) for o in outs)
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    return {"batch": batch, "tokens": produced, "seconds": round(elapsed, 4),
            "tok_per_s": round(produced / elapsed, 2), "per_stream_tok_per_s": round(produced / elapsed / batch, 2),
            "tiers_per_token": tiers_per_token(before, tier_counters(engine.stats().get("experts")))}


def _run(args) -> int:
    from tiermoe.bench.results import check_out, write_json
    from tiermoe.engine.build import build_engine_core, check_sizing_args
    from tiermoe.errors import UserError
    from tiermoe.protocol import InvalidRequest

    check_sizing_args(args)
    try:
        sizes = [int(x) for x in args.batch_sizes.split(",")]
    except ValueError:
        raise UserError(f"--batch-sizes: expected comma-separated integers, got {args.batch_sizes!r}") from None
    if min(sizes) < 1:
        raise UserError(f"--batch-sizes {args.batch_sizes}: each must be at least 1")
    if args.tokens < 1 or args.prompt_len < 1:  # 0 decode tokens times nothing; an empty prompt is refused
        raise UserError(f"--tokens {args.tokens} and --prompt-len {args.prompt_len}: each must be at least 1")
    check_out(args.out)
    with tempfile.TemporaryDirectory(prefix="tiermoe-bench-") as tmp:
        model = args.model
        if args.tiny:
            from tiermoe.models.tiny import write_tiny

            model = str(write_tiny(args.tiny, tmp))
        engine = build_engine_core(model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                                   max_num_seqs=max(sizes), options=vars(args))
        try:
            for b in dict.fromkeys(sizes):  # warm-up: each batch size's first decode steps compile and record
                measure(engine, b, 4, args.prompt_len, seed=99)
            results = [measure(engine, b, args.tokens, args.prompt_len) for b in sizes]
        except InvalidRequest as exc:  # a prompt beyond the context: the flags' fault, not the engine's
            raise UserError(f"--prompt-len {args.prompt_len} with --tokens {args.tokens}: {exc}") from None
    from tiermoe.bench.sweep import describe_tiers

    for r in results:
        print(f"decode batch {r['batch']}: {r['tok_per_s']:.1f} tok/s aggregate, "
              f"{r['per_stream_tok_per_s']:.1f} tok/s per stream ({r['tokens']} tokens in {r['seconds']} s)"
              f"{describe_tiers(r['tiers_per_token'])}")
    graphs = engine.stats().get("decode_graphs")  # None where no graph is recorded (CPU, --enforce-eager)
    print(describe_graphs(graphs))
    report = {"model": args.model or f"tiny:{args.tiny}", "device": str(engine.model.device),
              "dtype": str(engine.model.dtype).replace("torch.", ""), "results": results, "decode_graphs": graphs}
    write_json(report, args.out)
    return 0


def describe_graphs(graphs: dict | None) -> str:
    """One line: did the timed steps replay decode CUDA graphs (a figure means little without it)."""
    if not graphs:
        return "decode CUDA graphs: off (eager steps)"
    if graphs.get("failed"):
        return f"decode CUDA graphs: failed ({graphs['failed']}); eager steps"
    return (f"decode CUDA graphs: batch sizes {graphs.get('captured_batch_sizes')} recorded, "
            f"{graphs.get('replays', 0)} replays")
