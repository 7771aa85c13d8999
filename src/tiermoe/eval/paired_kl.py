"""`tiermoe eval paired-kl --model STORE`: how far fast mode (CPU lane on) is from exact mode, or
(with `--reference REF`) how far one store is from another (e.g. int3 records from bf16 ones).

Same tokens on both sides: each prompt is first greedy-decoded by the reference (exact mode of
the same store, or the store REF), recording the logits of every generated position; then the
SAME token sequence is teacher-forced through the compared side (fast mode of the same store,
or STORE in exact mode), one decode step per token (the lane only serves decode steps), and
the logits at the same positions are compared: mean and max KL(reference || compared), top-1
agreement. Both runs compute every generated position in a single-token decode step; prompts
are prefilled identically in both (prefill never uses the lane).

Two stores are compared one after the other in the same process (the reference's engine is
closed before the compared one is built), so the pair needs the memory of the larger alone.
"""

from __future__ import annotations

import json
import time
from argparse import Namespace
from typing import Any, Mapping

from tiermoe.engine.prompts import chat_prompt_ids
from tiermoe.protocol import SamplingParams
from tiermoe.errors import UserError
from tiermoe.eval.prompts import EVAL_TEXTS
from tiermoe.scheduler.request import Request



def register_paired_kl(sub) -> None:
    """Add `paired-kl` to the `tiermoe eval` subcommands."""
    p = sub.add_parser("paired-kl", help="fast mode (CPU lane) vs exact mode on the same tokens of a packed store, "
                                         "or a store vs a reference store (--reference)")
    p.add_argument("--model", required=True, help="packed store directory")
    p.add_argument("--reference", default=None, metavar="STORE",
                   help="a reference store of the same model (e.g. packed with --quant bf16): compare --model's "
                        "exact mode with it instead of fast mode with exact mode")
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    p.add_argument("--prompts", nargs="+", default=None, metavar="TEXT",
                   help="prompt texts (default: a fixed set of 4)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default="auto", help="activation dtype: auto, bfloat16, float16, float32")
    from tiermoe.engine.build import add_store_args

    add_store_args(p, with_mode=False)
    p.set_defaults(handler=_paired_kl)


def _paired_kl(args) -> int:
    from tiermoe.engine.build import resolve_device

    if args.tokens < 1:
        raise UserError("--tokens must be at least 1")
    if args.prompts is not None and any(not text.strip() for text in args.prompts):
        raise UserError("--prompts: a prompt text is empty (the chat template alone would be compared)")
    # the namespace holds every store flag add_store_args gave this command (the rest is ignored)
    if args.reference is not None:
        result = run_paired_kl_stores(args.model, args.reference, device=resolve_device(args.device),
                                      dtype=args.dtype, tokens=args.tokens, texts=args.prompts, options=args)
        print(f"paired KL of {args.model} against {args.reference} over {result['positions']} positions: "
              f"mean {result['kl_mean']:.3g}, max {result['kl_max']:.3g}, top-1 agreement {result['top1']:.4f}; "
              f"expert bytes {result['record_bytes']:,} vs {result['reference_record_bytes']:,} a record")
        print(json.dumps(result))
        return 0
    result = run_paired_kl(args.model, device=resolve_device(args.device), dtype=args.dtype, tokens=args.tokens,
                           texts=args.prompts, options=args)
    lane = result["cpu_lane"]
    print(f"paired KL over {result['positions']} positions: mean {result['kl_mean']:.3g}, max {result['kl_max']:.3g}, "
          f"top-1 agreement {result['top1']:.4f}; CPU lane {lane['per_decode_token']:.2f} experts/token "
          f"({lane['kernel']}), waited {lane['wait_s']:.2f} s; exact mode's experts: {result['exact_kernel']}")
    if result["exact_kernel"] == "torch" and result["dtype"] != "float32":
        print("note: exact mode ran the torch expert path, which rounds every expert's add to "
              f"{result['dtype']}; the lane keeps the fused kernel's fp32 sum, so this KL includes that difference")
    print(json.dumps(result))
    return 0


def prompt_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Chat-templated token ids of each text (plain encoding without a chat template)."""
    out = []
    for text in texts:
        ids = chat_prompt_ids(tokenizer, text)
        if not ids:
            raise UserError(f"prompt {text!r} encodes to no tokens")
        out.append(ids)
    return out


def fitting_prompts(engine, texts: list[str] | None, tokens: int) -> list[list[int]]:
    """The prompts' token ids (the built-in set when `texts` is None); UserError when a prompt plus
    `tokens` generated tokens would not fit the model's context."""
    prompts = prompt_ids(engine.tokenizer, texts or EVAL_TEXTS)
    longest = max(len(p) for p in prompts) + tokens
    if longest > engine.max_model_len:
        raise UserError(f"--tokens {tokens}: prompt plus tokens need a context of {longest}, "
                        f"the model has {engine.max_model_len}")
    return prompts


def decode_logits(engine, prompt: list[int], n: int, forced: list[int] | None = None,
                  chunk: int = 32) -> tuple[list[int], torch.Tensor]:
    import torch

    """Greedy-decode (or, with `forced`, teacher-force) n tokens after `prompt`.

    Returns (the n tokens, logits [n, V] fp32 on the CPU), where logits[i] is what the model
    predicted for token i. Every one of the n positions is computed in a one-token decode step
    (the prompt's last token included), so the CPU lane sees each of them.
    """
    req = Request("paired-kl", list(prompt), SamplingParams(max_tokens=n), n)
    req.slot = 0  # the engine serves nothing else here; recurrent families keep state per slot
    if not engine.kv.allocate(req.pages, len(prompt) + n):
        raise UserError(f"KV cache too small for a {len(prompt) + n}-token paired-KL sequence")
    tokens, rows = [], []
    try:
        body = len(prompt) - 1
        for start in range(0, body, chunk):
            k = min(chunk, body - start)
            engine.runner.forward([(req, k)])
            req.num_computed += k
        for i in range(n):
            logits = engine.runner.forward([(req, 1)])[-1].float().cpu()  # [V]
            req.num_computed += 1
            tok = forced[i] if forced is not None else int(logits.argmax())
            rows.append(logits)
            tokens.append(tok)
            req.output_ids.append(tok)
    finally:
        engine.kv.release(req.pages)
    return tokens, torch.stack(rows)


def run_paired_kl(store: str, *, device: str = "cpu", dtype: str = "auto", tokens: int = 64,
                  texts: list[str] | None = None, options: Mapping[str, Any] | Namespace | None = None) -> dict:
    """Exact greedy decode, then the same tokens teacher-forced in fast mode; metrics dict.
    options: engine flags (a CLI namespace or a dict; the mode is fast here)."""
    import torch

    from pathlib import Path

    from tiermoe.engine.build import build_engine, engine_config, is_packed_store
    from tiermoe.eval.parity import compare
    from tiermoe.moe.lane import LaneExperts

    if not is_packed_store(Path(store)):
        raise UserError(f"{store}: not a packed store (needs manifest.json and experts.bin; see tiermoe pack)")
    flags = vars(options) if isinstance(options, Namespace) else dict(options or {})
    engine = build_engine(engine_config(store, device=device, dtype=dtype, max_num_seqs=1,
                                        options={**flags, "mode": "fast"}))
    backend = engine.runner.experts
    if not isinstance(backend, LaneExperts):
        backend.close()
        raise UserError(f"{store}: the model does not serve its experts from the store, nothing to compare")
    try:
        prompts = fitting_prompts(engine, texts, tokens)
        t0 = time.perf_counter()
        backend.set_mode("exact")
        exact = [decode_logits(engine, p, tokens) for p in prompts]
        t1 = time.perf_counter()
        backend.set_mode("fast")
        fast = [decode_logits(engine, p, tokens, forced=toks)[1] for p, (toks, _) in zip(prompts, exact)]
        t2 = time.perf_counter()
        result = compare(torch.cat([lg for _, lg in exact]), torch.cat(fast))
        counters = backend.counters()
    finally:
        backend.close()
    return {"store": str(store), "device": str(engine.model.device),
            "dtype": str(engine.model.dtype).replace("torch.", ""), "prompts": len(prompts),
            "tokens_per_prompt": tokens, **result, "exact_s": round(t1 - t0, 3), "fast_s": round(t2 - t1, 3),
            "exact_kernel": counters.get("expert_kernel", ""), "cpu_lane": counters.get("cpu_lane", {})}


def run_paired_kl_stores(store: str, reference: str, *, device: str = "cpu", dtype: str = "auto",
                         tokens: int = 64, texts: list[str] | None = None,
                         options: Mapping[str, Any] | Namespace | None = None) -> dict:
    """The reference store greedy-decodes, `store` is teacher-forced on the same tokens; both in
    exact mode. Metrics dict with both stores' record kinds and bytes."""
    import torch

    from pathlib import Path

    from tiermoe.engine.build import build_engine, engine_config, is_packed_store
    from tiermoe.eval.parity import compare
    from tiermoe.store.records import load_manifest

    for path in (store, reference):
        if not is_packed_store(Path(path)):
            raise UserError(f"{path}: not a packed store (needs manifest.json and experts.bin; see tiermoe pack)")
    flags = {**(vars(options) if isinstance(options, Namespace) else dict(options or {})), "mode": "exact"}
    mine, theirs = load_manifest(store), load_manifest(reference)
    if mine.moe_layers != theirs.moe_layers or mine.experts_per_layer != theirs.experts_per_layer:
        raise UserError(f"{store} and {reference} hold different experts (MoE layers or experts per layer differ)")

    def run(path: str, forced: list[list[int]] | None) -> tuple[list[list[int]], list[torch.Tensor], float]:
        engine = build_engine(engine_config(path, device=device, dtype=dtype, max_num_seqs=1, options=flags))
        try:
            prompts = fitting_prompts(engine, texts, tokens)
            t0 = time.perf_counter()
            outs = [decode_logits(engine, p, tokens, forced=None if forced is None else forced[n])
                    for n, p in enumerate(prompts)]
            return [t for t, _ in outs], [lg for _, lg in outs], time.perf_counter() - t0
        finally:
            engine.runner.experts.close()

    ref_tokens, ref_logits, ref_s = run(reference, None)
    _, logits, s = run(store, ref_tokens)
    result = compare(torch.cat(ref_logits), torch.cat(logits))
    return {"store": str(store), "reference": str(reference), "device": device, "dtype": dtype,
            "prompts": len(ref_tokens), "tokens_per_prompt": tokens, **result,
            "kind": mine.layout.kind, "group_size": mine.layout.group_size, "record_bytes": mine.layout.length,
            "reference_kind": theirs.layout.kind, "reference_record_bytes": theirs.layout.length,
            "reference_s": round(ref_s, 3), "store_s": round(s, 3)}
