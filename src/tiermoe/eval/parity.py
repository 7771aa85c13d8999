"""Teacher-forced parity of our engine against the transformers reference implementation.

Both run the same fixed prompts; our side goes through the real serving path (paged KV cache,
chunked prefill in 32-token chunks, the configured expert backend), the reference is
transformers' own model class. Reported per position: top-1 agreement, KL(ref || ours), and
the largest absolute logit difference.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from tiermoe.engine.prompts import chat_prompt_ids
from tiermoe.protocol import SamplingParams
from tiermoe.eval.prompts import EVAL_TEXTS
from tiermoe.models.fp32_params import reference_class
from tiermoe.scheduler.request import Request



def parity_prompts(tokenizer, vocab_size: int, min_positions: int = 256, seed: int = 1234) -> list[list[int]]:
    """Chat-templated English prompts plus seeded random-id sequences (>= min_positions total)."""
    prompts = []
    for text in EVAL_TEXTS:
        prompts.append(chat_prompt_ids(tokenizer, text))
    rng = random.Random(seed)
    limit = min(vocab_size, len(tokenizer))
    while sum(len(p) for p in prompts) < min_positions or len(prompts) < 6:
        prompts.append([rng.randrange(limit) for _ in range(96)])
    return prompts


def engine_logits(engine, ids: list[int], chunk: int = 32, decode_from: int | None = None) -> torch.Tensor:
    """Logits [len(ids), V] fp32 from our engine, computed chunk by chunk through the KV cache.

    decode_from: from this token on, one token a forward: decode steps, which take the decode
    path (and its CUDA graphs, when on) rather than the prefill one."""
    req = Request("parity", list(ids), SamplingParams(max_tokens=1), 1)
    req.slot = 0  # the engine serves nothing else here; recurrent families keep state per slot
    if not engine.kv.allocate(req.pages, len(ids)):
        raise RuntimeError("KV cache too small for a parity prompt")
    out = []
    try:
        start = 0
        while start < len(ids):
            n = 1 if decode_from is not None and start >= decode_from else min(chunk, len(ids) - start)
            if decode_from is not None and start < decode_from:
                n = min(n, decode_from - start)
            out.append(engine.runner.forward([(req, n)], all_logits=True).cpu())
            req.num_computed += n
            start += n
    finally:
        engine.kv.release(req.pages)
    return torch.cat(out)


def compare(ref: torch.Tensor, ours: torch.Tensor) -> dict:
    """ref, ours [P, V] fp32 -> metrics."""
    lp_ref, lp_ours = torch.log_softmax(ref.double(), -1), torch.log_softmax(ours.double(), -1)
    kl = (lp_ref.exp() * (lp_ref - lp_ours)).sum(-1).clamp(min=0)
    return {
        "positions": int(ref.shape[0]),
        "top1": float((ref.argmax(-1) == ours.argmax(-1)).double().mean()),
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "max_abs_logit_diff": float((ref - ours).abs().max()),
    }


def reference_logits(ref_path: str | Path, prompts: list[list[int]], device: str,
                     dtype: torch.dtype) -> list[torch.Tensor]:
    import transformers

    # The eager experts loop is transformers' defining implementation (grouped_mm, its default,
    # is a fused rewrite of it that rounds differently in bf16).
    config = transformers.AutoConfig.from_pretrained(str(ref_path))
    cls = reference_class(config.model_type) or transformers.AutoModelForCausalLM
    model = cls.from_pretrained(str(ref_path), dtype=dtype, experts_implementation="eager").to(device).eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            outs.append(model(torch.tensor([ids], device=device)).logits[0].float().cpu())
    del model
    return outs


def run_parity(model: str, reference: str | None, device: str, dtype_name: str, arch: str | None = None,
               chunk: int = 32, fp32_floor: bool = True, decode_from: int | None = None) -> dict:
    """Our engine vs transformers at the same dtype. For reduced precision (bf16/fp16) also
    reports both sides against the transformers fp32 logits ("noise floor"): how far the
    reference's own low-precision run is from fp32, next to how far ours is."""
    from tiermoe.engine.build import build_engine_core, is_packed_store
    from tiermoe.errors import UserError
    from tiermoe.models.loader import parse_dtype

    if reference is None:
        if is_packed_store(Path(model)):
            raise UserError(f"{model}: a packed store has no transformers reference; pass --reference SRC_CHECKPOINT")
        reference = model
    engine = build_engine_core(model, device=device, dtype=dtype_name, max_num_seqs=1)
    dtype = engine.model.dtype
    prompts = parity_prompts(engine.tokenizer, engine.vocab_size)
    longest = max(len(p) for p in prompts)
    if longest >= engine.max_model_len:
        raise UserError(f"parity prompts need a context of {longest + 1} tokens")
    multiple = engine.scheduler.chunk_multiple  # the engine never cuts a prompt off a block edge
    chunk = -(-chunk // multiple) * multiple
    if decode_from is not None:  # a prompt is cut on block edges only
        decode_from = -(-decode_from // multiple) * multiple
    ours = torch.cat([engine_logits(engine, p, chunk, decode_from) for p in prompts])
    refs = torch.cat(reference_logits(reference, prompts, str(engine.model.device), dtype))
    result = compare(refs, ours)
    out = {"arch": arch or engine.model.spec.arch, "dtype": str(dtype).replace("torch.", ""),
           "device": str(engine.model.device), "chunk": chunk, **result}
    if decode_from is not None:
        out["decode_from"] = decode_from
        out["decode_graphs"] = engine.runner.graphs is not None
    if fp32_floor and dtype != torch.float32:
        exact = torch.cat(reference_logits(reference, prompts, str(engine.model.device), torch.float32))
        out["ours_vs_ref_fp32"] = compare(exact, ours)
        out["ref_vs_ref_fp32"] = compare(exact, refs)
    return out


def format_result(result: dict) -> str:
    keys = ["arch", "positions", "top1", "kl_mean", "kl_max", "max_abs_logit_diff"]
    ordered = {k: result[k] for k in keys}
    ordered.update({k: v for k, v in result.items() if k not in ordered})
    return json.dumps(ordered)
