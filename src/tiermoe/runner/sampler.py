"""Batched sampler: penalties, logit bias, grammar masks, temperature, top-k, top-p, min-p, seeds.

Everything stays on the logits' device: no `.item()` or `.tolist()` inside, so on a GPU the
only host sync per step is the engine reading the chosen token ids once for the whole batch.
Order per row: penalties, then `logit_bias`, then the grammar's allowed-token mask (rows with
a response_format; the mask was computed on the host by runner/structured.py and copied in),
then greedy argmax or filtered sampling. Returned logprobs are the raw model distribution.
Random rows sample with the exponential-race form of Gumbel-max (argmax(p / q), q ~ Exp(1)),
drawn from each request's own generator when it has a seed, so a seeded request gives the
same tokens whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiermoe.protocol import SamplingParams


@dataclass
class SampleRow:
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None
    eos_ids: tuple[int, ...] = ()
    allowed: torch.Tensor | None = None  # [V] bool on the logits' device: the grammar's allowed tokens
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids [B] long, values [B]) prepared logit_bias


@dataclass
class SampleResult:
    tokens: torch.Tensor  # [N] long
    logprobs: torch.Tensor | None  # [N] chosen token's logprob
    top_ids: torch.Tensor | None  # [N, K]
    top_logprobs: torch.Tensor | None  # [N, K]


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.long,
                                device=logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and row.output_ids:
            out = torch.tensor(row.output_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(out, minlength=logits.shape[1])[: logits.shape[1]].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        if p.min_tokens and len(row.output_ids) < p.min_tokens:
            for eos in set(row.eos_ids) | set(p.stop_token_ids):
                if eos < logits.shape[1]:
                    logits[i, eos] = float("-inf")
    return logits


def bias_tensors(logit_bias: dict[int, float], device) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's logit_bias as (ids [B], values [B]) tensors (built once per request by the runner)."""
    ids = torch.tensor(list(logit_bias.keys()), dtype=torch.long, device=device)
    vals = torch.tensor(list(logit_bias.values()), dtype=torch.float32, device=device)
    return ids, vals


def _apply_bias_and_masks(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    for i, row in enumerate(rows):
        bias = row.bias
        if bias is None and row.params.logit_bias:
            bias = bias_tensors(row.params.logit_bias, logits.device)
        if bias is not None:
            logits[i].index_add_(0, bias[0], bias[1].to(logits.dtype))
        if row.allowed is not None:
            logits[i].masked_fill_(~row.allowed, float("-inf"))
    return logits


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [V] of one row, already divided by temperature -> filtered logits [V]."""
    if p.top_k and p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        cum = probs.cumsum(-1)
        drop = (cum - probs) > p.top_p  # keep the smallest set whose mass reaches top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    if p.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def sample(logits: torch.Tensor, rows: list[SampleRow],
           default_generator: torch.Generator | None = None) -> SampleResult:
    """logits [N, V] fp32 (model output) -> chosen tokens and optional logprobs."""
    want_logprobs = any(r.params.logprobs is not None for r in rows)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    if any(r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty
           or r.params.min_tokens for r in rows):
        logits = _apply_penalties(logits.clone(), rows)
    if any(r.allowed is not None or r.bias is not None or r.params.logit_bias for r in rows):
        logits = _apply_bias_and_masks(logits.clone(), rows)
    tokens = torch.argmax(logits, dim=-1)  # [N]; greedy rows keep this
    for i, row in enumerate(rows):
        p = row.params
        if p.greedy:
            continue
        filtered = _filter(logits[i] / p.temperature, p)
        probs = torch.softmax(filtered, dim=-1)
        gen = row.generator or default_generator
        q = torch.empty_like(probs).exponential_(generator=gen)
        tokens[i] = torch.argmax(probs / q)
    if not want_logprobs:
        return SampleResult(tokens, None, None, None)
    k = max((r.params.logprobs or 0) for r in rows)
    chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0]
    top_vals, top_ids = (torch.topk(raw_logprobs, k, dim=-1) if k > 0 else (None, None))
    return SampleResult(tokens, chosen, top_ids, top_vals)
