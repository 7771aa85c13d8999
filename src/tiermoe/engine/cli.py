"""`tiermoe generate`: run one prompt and print only the completion text.

It builds a whole engine core and steps it to the end, so it lives with the engine rather than
with the runner, which the engine drives.
"""

from __future__ import annotations

import sys


def register(subparsers) -> None:
    from tiermoe.engine.build import add_engine_args
    from tiermoe.engine.threads import add_cpu_threads_arg

    p = subparsers.add_parser("generate", help="complete one prompt and print the completion",
                              description="Load the model, complete --prompt (as one user message through the chat "
                                          "template, or --raw) and print only the completion's text; logs and "
                                          "errors go to stderr.")
    add_engine_args(p)
    add_cpu_threads_arg(p)
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template to the prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: smallest token set of this mass")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this share of the likeliest one")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="penalize tokens already seen, HF style (1: off; above 1 penalizes)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="subtract from logits of tokens already seen")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times each token's count so far from its logit")
    p.set_defaults(handler=_run)


def _run(args) -> int:
    from tiermoe.engine.build import build_engine_core, check_sizing_args
    from tiermoe.engine.llm_engine import generate_ids
    from tiermoe.engine.prompts import chat_prompt_ids
    from tiermoe.errors import UserError
    from tiermoe.engine.threads import use_cpu_threads
    from tiermoe.protocol import InvalidRequest, SamplingParams

    check_sizing_args(args)  # one prompt decodes alone, yet a batch of 0 is refused here as by serve and plan
    use_cpu_threads(args.cpu_threads)
    engine = build_engine_core(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                               max_num_seqs=1, options=vars(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            seed=args.seed)
    ids = chat_prompt_ids(engine.tokenizer, args.prompt, args.raw)
    try:
        out = generate_ids(engine, [ids], params)[0]
    except InvalidRequest as exc:
        raise UserError(f"--{(exc.param or 'prompt').replace('_', '-')}: {exc}") from None
    sys.stdout.write(engine.tokenizer.decode(out, skip_special_tokens=True) + "\n")
    return 0
