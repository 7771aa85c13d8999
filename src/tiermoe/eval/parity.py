"""Teacher-forced parity of our engine against the transformers reference implementation.

Both run the same fixed prompts; our side goes through the real serving path (paged KV cache,
chunked prefill in 32-token chunks, the configured expert backend), the reference is
transformers' own model class. Reported per position: top-1 agreement, KL(ref || ours), and
the largest absolute logit difference. With decode steps on our side, also against the
reference's own cached decode, which for recurrent layers sums in another order than its full
forward.
"""

from __future__ import annotations

import inspect
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


def load_reference(ref_path: str | Path, device: str, dtype: torch.dtype):
    """transformers' model class for the checkpoint, loaded at `dtype` on `device`, eval mode."""
    import transformers

    # The eager experts loop is transformers' defining implementation (grouped_mm, its default,
    # is a fused rewrite of it that rounds differently in bf16).
    config = transformers.AutoConfig.from_pretrained(str(ref_path))
    cls = reference_class(config.model_type) or transformers.AutoModelForCausalLM
    return cls.from_pretrained(str(ref_path), dtype=dtype, experts_implementation="eager").to(device).eval()


def reference_logits(ref_path: str | Path, prompts: list[list[int]], device: str,
                     dtype: torch.dtype) -> list[torch.Tensor]:
    """The reference's logits [len(ids), V] fp32 per prompt, each prompt one full forward."""
    return reference_runs(ref_path, prompts, device, dtype)[0]


def reference_runs(ref_path: str | Path, prompts: list[list[int]], device: str, dtype: torch.dtype,
                   decode_from: int | None = None, reference_decode: bool = True,
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, str | None]:
    """(full-forward logits, cached-decode logits or None, why the decode is missing or None).

    The decode run is the reference's own token-by-token generation path: a one-token step with
    a cache is, for recurrent layers (linear attention), a different algorithm from the chunked
    full forward, so our decode steps are judged against it as well as against the full forward.
    Loaded once for both runs, since loading dominates on tiny models."""
    model = load_reference(ref_path, device, dtype)
    full, decode, why = [], None, None
    with torch.no_grad():
        for ids in prompts:
            full.append(model(torch.tensor([ids], device=device)).logits[0].float().cpu())
        if decode_from is not None and not reference_decode:
            why = "not asked for"
        elif decode_from is not None:
            try:
                decode = [reference_decode_logits(model, ids, decode_from, device) for ids in prompts]
            except Exception as exc:  # noqa: BLE001 - a family whose reference cannot decode with a cache
                decode, why = None, f"{type(exc).__name__}: {exc}"
    del model
    return full, decode, why


def _cache_keyword(model) -> str:
    """The forward keyword that takes the cache: `cache` in newer transformers (which still
    accepts, with a warning, the older `past_key_values` until it drops it), else the older one."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def reference_decode_logits(model, ids: list[int], decode_from: int, device: str) -> torch.Tensor:
    """Logits [len(ids), V] fp32 from the reference's cached decode: the tokens before
    `decode_from` in one forward, then one token a forward, each feeding the cache the previous
    forward returned. The model builds the cache itself on the first forward (use_cache=True),
    the way generation does, so a hybrid family gets its per-layer mix of KV and recurrent
    (conv and linear-attention state) layers from its own config."""
    keyword = _cache_keyword(model)
    cache, out, start = None, [], 0
    while start < len(ids):
        n = max(min(decode_from, len(ids)) - start, 1)
        kwargs = {"use_cache": True} if cache is None else {"use_cache": True, keyword: cache}
        step = model(torch.tensor([ids[start:start + n]], device=device), **kwargs)
        cache = getattr(step, "cache", None)
        if cache is None:  # transformers before the rename
            cache = getattr(step, "past_key_values", None)
        if cache is None:
            raise NotImplementedError(f"{type(model).__name__} returns no cache")
        out.append(step.logits[0].float().cpu())
        start += n
    return torch.cat(out)


def run_parity(model: str, reference: str | None, device: str, dtype_name: str, arch: str | None = None,
               chunk: int = 32, fp32_floor: bool = True, decode_from: int | None = None,
               reference_decode: bool = True) -> dict:
    """Our engine vs transformers at the same dtype. For reduced precision (bf16/fp16) also
    reports both sides against the transformers fp32 logits ("noise floor"): how far the
    reference's own low-precision run is from fp32, next to how far ours is.

    decode_from: ours computes every position from it on as a decode step; the reference's
    full forward stays the main comparison, and the reference's own cached decode is added
    (ours_vs_ref_decode, ref_decode_vs_ref, and ref_decode_vs_ref_fp32 with the noise floor): how
    far a decode algorithm alone moves the logits. A reference that cannot decode with a cache
    leaves those keys out and says why (ref_decode_skipped), as does reference_decode=False (a
    comparison with the full forward alone: the reference's token-by-token decode is its slow part)."""
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
    full, decode, why = reference_runs(reference, prompts, str(engine.model.device), dtype, decode_from,
                                       reference_decode)
    refs = torch.cat(full)
    ref_decode = torch.cat(decode) if decode is not None else None
    result = compare(refs, ours)
    out = {"arch": arch or engine.model.spec.arch, "dtype": str(dtype).replace("torch.", ""),
           "device": str(engine.model.device), "chunk": chunk, **result}
    if decode_from is not None:
        out["decode_from"] = decode_from
        out["decode_graphs"] = engine.runner.graphs is not None
        if ref_decode is not None:  # ours against the reference's own decode, and that decode's own spread
            out["ours_vs_ref_decode"] = compare(ref_decode, ours)
            out["ref_decode_vs_ref"] = compare(refs, ref_decode)
        else:
            out["ref_decode_skipped"] = why
    if fp32_floor and dtype != torch.float32:
        exact = torch.cat(reference_logits(reference, prompts, str(engine.model.device), torch.float32))
        out["ours_vs_ref_fp32"] = compare(exact, ours)
        out["ref_vs_ref_fp32"] = compare(exact, refs)
        if ref_decode is not None:  # which decode, ours or the reference's, strays further from fp32
            out["ref_decode_vs_ref_fp32"] = compare(exact, ref_decode)
    return out


def format_result(result: dict) -> str:
    keys = ["arch", "positions", "top1", "kl_mean", "kl_max", "max_abs_logit_diff"]
    ordered = {k: result[k] for k in keys}
    ordered.update({k: v for k, v in result.items() if k not in ordered})
    return json.dumps(ordered)
