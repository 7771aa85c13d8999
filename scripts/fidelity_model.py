#!/usr/bin/env python3
"""What paired KL should fast mode reach on a store, if the CPU lane and the GPU kernel differ only in fp32 order?

An emulation on the CPU, for a prediction to hold the GPU's figure against (`tiermoe eval paired-kl --device
cuda`). The store's torch expert path is replaced by the fused Triton kernel's numerics (each pick's expert in
fp32 from bf16 weights bf16(q * scale), its activation rounded to bf16 once, the picks' weighted fp32 sum in pick
order, rounded once), which is exact mode on CUDA. Then the same tokens are teacher-forced through variants:

    lane       fast mode's arithmetic: in each decode step, LANE random picks of every layer (seeded) are
               computed apart, each expert's dot products in another accumulation (float64, then fp32), their
               sum in ascending expert id added to the other picks' fp32 sum in pick order, rounded once
    lane-order as lane, each expert's dot products in fp32 as the kernel's: the order of the sum alone
    lane-dot   as lane, the lane's picks summed in their places in pick order: the dots' order alone
    reversed   the picks summed in reverse order (the same mathematics, another fp32 order)

    PYTHONPATH=src python3 scripts/fidelity_model.py STORE [--tokens 64] [--lane 3] [--out F.json]

Needs no GPU (bf16 activations on the CPU). It is a model of the two kernels' difference, not a measurement of
them: the GPU's paired-kl is the figure; this says what that figure means.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
import torch.nn.functional as F


def _expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float | None,
            acc: torch.dtype) -> torch.Tensor:
    """The fused kernel's numerics for one expert: x [n, H] bf16 -> fp32 [n, H] (dots accumulated in `acc`)."""
    h = x.to(acc) @ gate_up.to(acc).t()  # [n, 2I]
    g, u = h.chunk(2, dim=-1)
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    act = (F.silu(g) * u).to(torch.bfloat16)  # [n, I]: rounded once, as the kernel stores it
    return (act.to(acc) @ down.to(acc).t()).to(torch.float32)  # [n, H]


class Numerics:
    """combine_experts with the fused kernel's numerics, in the order a variant sums."""

    def __init__(self, lane: int, seed: int = 0):
        self.variant, self.lane, self.rnd = "kernel", lane, random.Random(seed)

    def __call__(self, x, topk_ids, topk_weights, weights_of, swiglu_limit=None, skip=()):
        t, k = topk_ids.shape
        ids = topk_ids.tolist()
        weights = weights_of(sorted({e for row in ids for e in row}))
        on_lane: set[int] = set()
        if self.variant in ("lane", "lane-order", "lane-dot") and t == 1:  # the lane serves decode steps
            on_lane = set(self.rnd.sample(ids[0], min(self.lane, k)))
        y = torch.zeros(t, k, x.shape[1], dtype=torch.float32)  # [T, k, H]
        for e in {e for row in ids for e in row}:
            rows, cols = (topk_ids == e).nonzero(as_tuple=True)
            acc = torch.float64 if e in on_lane and self.variant != "lane-order" else torch.float32
            y[rows, cols] = _expert(x[rows], *weights[e], swiglu_limit, acc) * topk_weights[rows, cols, None].float()
        order = list(range(k))[::-1] if self.variant == "reversed" else list(range(k))
        out = torch.zeros(t, x.shape[1], dtype=torch.float32)
        lane_part = torch.zeros_like(out)
        for j in order:
            if on_lane and ids[0][j] in on_lane and self.variant != "lane-dot":
                continue
            out += y[:, j]
        if self.variant == "lane-dot":  # the lane's picks summed in their places: only their dots differ
            on_lane = set()
        for e in sorted(on_lane):  # the lane's own sum, ascending ids, then added to the device's part
            lane_part += y[0, ids[0].index(e)]
        return (out + lane_part).to(x.dtype)


def main() -> int:
    import tiermoe.moe.experts as experts
    import tiermoe.moe.store_backends as store_backends
    from tiermoe.engine.build import build_engine, engine_config
    from tiermoe.eval.paired_kl import decode_logits, fitting_prompts
    from tiermoe.eval.parity import compare

    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--lane", type=int, default=3, help="picks of each decode layer on the emulated lane")
    p.add_argument("--variants", default="lane,reversed")
    p.add_argument("--out", default="")
    a = p.parse_args()
    numerics = Numerics(a.lane)
    experts.combine_experts = store_backends.combine_experts = numerics
    engine = build_engine(engine_config(a.store, device="cpu", dtype="bfloat16", max_num_seqs=1,
                                        options={"mode": "exact", "expert_kernel": "torch"}))
    try:
        prompts = fitting_prompts(engine, None, a.tokens)
        ref = [decode_logits(engine, q, a.tokens) for q in prompts]
        results = {}
        for name in a.variants.split(","):
            numerics.variant = name
            got = [decode_logits(engine, q, a.tokens, forced=toks)[1] for q, (toks, _) in zip(prompts, ref)]
            numerics.variant = "kernel"
            r = results[name] = compare(torch.cat([lg for _, lg in ref]), torch.cat(got))
            print(f"{name}: paired KL over {r['positions']} positions: mean {r['kl_mean']:.3g}, max {r['kl_max']:.3g}, "
                  f"top-1 {r['top1']:.4f}, max |logit diff| {r['max_abs_logit_diff']:.3g}")
    finally:
        engine.runner.experts.close()
    if a.out:
        Path(a.out).write_text(json.dumps({"store": a.store, "tokens_per_prompt": a.tokens, "lane": a.lane,
                                           "variants": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
