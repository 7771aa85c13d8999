"""`tiermoe bench mtp`: MTP speculative decoding at batch 1, drafting off vs on.

For each setting (0 = off, then every `--num-draft`), one engine is built with
`num_speculative_tokens` set and the same prompts are decoded one at a time, greedy, for
`--tokens` tokens each (EOS ignored). Timing starts after each request's first step (the
prefill) and covers its decode steps only. Reported per setting: decode tok/s, speed-up over
drafting off, acceptance rate (accepted / drafted), tokens per verify step, engine steps, and
whether the tokens equal drafting off (exit status 1 if any differ).

`--tiny glm5_next` writes a tiny checkpoint and distils its MTP layer first (tiny.py,
distill.py; `--distill-steps 0` keeps the random head); its prompts are seeded random ids
disjoint from the distillation's. `--model` runs the checkpoint's own MTP weights on the
chat-templated evaluation prompts. A CPU tiny model's speed-up is a property of this
machine and of a per-step cost dominated by framework overhead, not a GPU figure.
"""

from __future__ import annotations

import json
import random
import tempfile
import time

PROMPT_SEED = 1234  # the distillation draws its prompts from seed 0


def register(bench_subparsers) -> None:
    from tiermoe.engine.build import add_store_args

    p = bench_subparsers.add_parser("mtp", help="MTP speculative decoding at batch 1: acceptance, speed-up, exactness")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory or packed store with MTP weights")
    src.add_argument(
        "--tiny", metavar="ARCH", choices=("glm5_next",), help="a tiny glm5_next with a distilled MTP layer"
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default="auto", help="auto (checkpoint dtype), bfloat16, float16, float32")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    add_store_args(p)
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--num-draft", default="1,2", help="draft lengths to compare with drafting off (each 1 or 2)")
    p.add_argument("--prompts", type=int, default=4, help="prompts, decoded one after the other")
    p.add_argument("--prompt-len", type=int, default=24, help="--tiny: length of the random prompts")
    p.add_argument("--distill-steps", type=int, default=300, help="--tiny: MTP distillation steps (0: random head)")
    p.add_argument(
        "--tiny-branch-scale",
        type=float,
        default=1.0,
        help="--tiny: trunk residual-branch scale (tiny.py; < 1 makes the trunk predictable)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", help="write the figures as JSON")
    p.set_defaults(handler=_run)


def _drafts(text: str) -> list[int]:
    from tiermoe.errors import UserError

    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--num-draft: expected comma-separated integers, got {text!r}") from None
    if not ks or any(k not in (1, 2) for k in ks):
        raise UserError(f"--num-draft {text}: each value must be 1 or 2")
    return ks


def decode_prompts(engine, prompts: list[list[int]], tokens: int) -> dict:
    """Decode each prompt alone (batch 1); returns tokens, decode seconds and counters."""
    import torch

    from tiermoe.protocol import SamplingParams

    cuda = engine.model.device.type == "cuda"
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    outs, seconds, decode_tokens, steps = [], 0.0, 0, 0
    for i, ids in enumerate(prompts):
        engine.add_request(f"mtp-{i}", list(ids), params)
        got, t0 = [], None
        while engine.has_unfinished_requests():
            new = [t for o in engine.step() for t in o.new_token_ids]
            if t0 is None:  # the prefill step (and first token) is not timed
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
            else:
                decode_tokens += len(new)
                steps += 1
            got.extend(new)
        if cuda:
            torch.cuda.synchronize()
        seconds += time.perf_counter() - t0
        outs.append(got)
    return {"tokens": outs, "seconds": seconds, "decode_tokens": decode_tokens, "decode_steps": steps}


def _bench_prompts(engine, args) -> list[list[int]]:
    if args.tiny:
        rng = random.Random(PROMPT_SEED)
        return [[rng.randrange(3, engine.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    from tiermoe.engine.prompts import chat_prompt_ids
    from tiermoe.eval.prompts import EVAL_TEXTS

    return [chat_prompt_ids(engine.tokenizer, EVAL_TEXTS[i % len(EVAL_TEXTS)]) for i in range(args.prompts)]


def _run(args) -> int:
    import torch

    from tiermoe.engine.build import build_engine_core
    from tiermoe.errors import UserError

    ks = _drafts(args.num_draft)
    if args.tokens < 2 or args.prompts < 1:
        raise UserError("--tokens must be >= 2 and --prompts >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    report: dict = {
        "model": args.model or f"tiny:{args.tiny}",
        "tokens_per_prompt": args.tokens,
        "prompts": args.prompts,
        "batch": 1,
        "threads": torch.get_num_threads(),
        "settings": [],
    }
    with tempfile.TemporaryDirectory(prefix="tiermoe-bench-mtp-") as tmp:
        model = args.model
        if args.tiny:
            from tiermoe.models.glm5_next.distill import distill_mtp
            from tiermoe.models.glm5_next.tiny import write_tiny_checkpoint

            model = str(write_tiny_checkpoint(tmp, branch_scale=args.tiny_branch_scale))
            report["tiny_branch_scale"] = args.tiny_branch_scale
            if args.distill_steps > 0:
                d = distill_mtp(model, steps=args.distill_steps)
                report["distill"] = d.to_dict()
                print(
                    f"MTP distillation: {d.steps} steps in {d.seconds:.1f} s, loss {d.loss_first:.2f} -> "
                    f"{d.loss_last:.2f}, held-out next-next agreement {d.agreement_before:.1%} -> "
                    f"{d.agreement_after:.1%}"
                )
                if d.agreement_after < 0.1 and args.tiny_branch_scale == 1.0:
                    print(
                        "note: the default tiny trunk is close to chaotic (its next token is hardly predictable "
                        "from local context), so no small head learns it; --tiny-branch-scale 0.25 gives a "
                        "predictable trunk"
                    )
        base = None
        for k in [0, *ks]:
            options = {**vars(args), "num_speculative_tokens": k, "max_num_batched_tokens": None}
            engine = build_engine_core(
                model,
                device=args.device,
                dtype=args.dtype,
                max_model_len=args.max_model_len,
                max_num_seqs=1,
                options=options,
            )
            try:  # each setting's engine gives its expert tiers back (pinned host memory) before the next
                if k and engine.runner.spec is None:
                    raise UserError(f"{model}: this model cannot draft (no MTP layer weights)")
                prompts = _bench_prompts(engine, args)
                decode_prompts(engine, prompts[:1], 4)  # warm-up (one-time allocations, kernels)
                before = dict(engine.stats().get("speculative") or {})
                r = decode_prompts(engine, prompts, args.tokens)
                spec = engine.stats().get("speculative") or {}
            finally:
                engine.runner.experts.close()
            drafted = spec.get("drafted", 0) - before.get("drafted", 0)
            accepted = spec.get("accepted", 0) - before.get("accepted", 0)
            verify = spec.get("verify_steps", 0) - before.get("verify_steps", 0)
            emitted = spec.get("emitted", 0) - before.get("emitted", 0)
            row = {
                "num_speculative_tokens": k,
                "decode_tokens": r["decode_tokens"],
                "decode_steps": r["decode_steps"],
                "seconds": round(r["seconds"], 4),
                "tok_per_s": round(r["decode_tokens"] / r["seconds"], 2),
                "drafted": drafted,
                "accepted": accepted,
                "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
                "tokens_per_verify": round(emitted / verify, 4) if verify else None,
                "tokens_per_step": round(r["decode_tokens"] / max(r["decode_steps"], 1), 4),
            }
            if base is None:
                base = r
                row.update(speedup=1.0, identical=True)
            else:
                row["speedup"] = round(
                    (r["decode_tokens"] / r["seconds"]) / (base["decode_tokens"] / base["seconds"]), 3
                )
                row["identical"] = r["tokens"] == base["tokens"]
            report["settings"].append(row)
            report.setdefault("device", str(engine.model.device))
            report.setdefault("dtype", str(engine.model.dtype).replace("torch.", ""))
            del engine
    for row in report["settings"]:
        k = row["num_speculative_tokens"]
        rate = "n/a" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.1%}"
        per = "n/a" if row["tokens_per_verify"] is None else f"{row['tokens_per_verify']:.2f}"
        extra = (
            ""
            if not k
            else (
                f", acceptance {rate}, {per} tokens/verify, speed-up {row['speedup']:.2f}x, "
                f"tokens {'identical' if row['identical'] else 'DIFFER'}"
            )
        )
        print(
            f"num_speculative_tokens={k}: {row['tok_per_s']:.1f} tok/s ({row['decode_tokens']} tokens, "
            f"{row['decode_steps']} steps){extra}"
        )
    ok = all(row["identical"] for row in report["settings"])
    report["identical"] = ok
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    if not ok:
        print("error: greedy tokens with drafting on differ from drafting off")
        return 1
    return 0
