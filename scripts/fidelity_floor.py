#!/usr/bin/env python3
"""How far does exact mode move from itself when only the fp32 order of the MoE sums changes?

Fast mode's CPU lane computes some of a layer's experts in another order than the GPU kernel (its own
dot products, its experts summed apart and then added to the GPU's part), so fast mode can match exact
mode only to within what such reorderings cost the model. This measures that floor on a store, with no
lane at all: exact mode greedy-decodes (as `tiermoe eval paired-kl` does), then the same tokens are
teacher-forced through exact mode again with the MoE kernel changed in a way that is the same
mathematics in another fp32 order:

    reversed   every token's picks in reverse order (the kernel sums the picks in pick order)
    half-bk    launch configurations with half the K tile (each dot product accumulated in another order)

    python3 scripts/fidelity_floor.py STORE [--device cuda] [--dtype bfloat16] [--tokens 64] [--out F.json]

Prints the paired KL and top-1 of each variant against exact mode (compare with `tiermoe eval paired-kl`
fast against exact on the same store).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


calls = [0]  # the variant's kernel calls (0 would mean the engine never reached it)


def _variant(name: str, orig):
    """fused_moe with the same mathematics in another fp32 order."""
    from tiermoe.kernels.triton.fused_moe import _min_block_k, get_config

    def reversed_picks(x, ids, w, table, layout, **kw):
        calls[0] += 1
        return orig(x, ids.flip(-1).contiguous(), w.flip(-1).contiguous(), table, layout, **kw)

    def half_bk(x, ids, w, table, layout, config=None, **kw):
        calls[0] += 1
        cfg = dict(config or get_config(layout, ids.shape[0], x.device))
        cfg.pop("gemv", None)  # the block kernels at every size
        for stage in ("gate_up", "down"):
            bk = cfg[stage]["BK"]
            cfg[stage] = {**cfg[stage], "BK": max(bk // 2, _min_block_k(layout))}
        return orig(x, ids, w, table, layout, config=cfg, **kw)

    return {"reversed": reversed_picks, "half-bk": half_bk}[name]


def main() -> int:
    import torch

    import tiermoe.kernels.triton.fused_moe as fm
    from tiermoe.engine.build import build_engine, engine_config
    from tiermoe.eval.paired_kl import decode_logits, fitting_prompts
    from tiermoe.eval.parity import compare

    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--variants", default="reversed,half-bk")
    p.add_argument("--out", default="")
    a = p.parse_args()
    orig = fm.fused_moe

    def run(forced):
        engine = build_engine(engine_config(a.store, device=a.device, dtype=a.dtype, max_num_seqs=1,
                                            options={"mode": "exact", "expert_kernel": "triton"}))
        try:
            prompts = fitting_prompts(engine, None, a.tokens)
            return [decode_logits(engine, q, a.tokens, forced=None if forced is None else forced[i])
                    for i, q in enumerate(prompts)]
        finally:
            engine.runner.experts.close()

    ref = run(None)
    tokens = [t for t, _ in ref]
    ref_logits = torch.cat([lg for _, lg in ref])
    results = {}
    for name in a.variants.split(","):
        fm.fused_moe = _variant(name, orig)
        calls[0] = 0
        try:
            got = torch.cat([lg for _, lg in run(tokens)])
        finally:
            fm.fused_moe = orig
        results[name] = {**compare(ref_logits, got), "kernel_calls": calls[0]}
        r = results[name]
        print(f"{name}: paired KL over {r['positions']} positions: mean {r['kl_mean']:.3g}, max {r['kl_max']:.3g}, "
              f"top-1 {r['top1']:.4f}, max |logit diff| {r['max_abs_logit_diff']:.3g} ({calls[0]} kernel calls)")
    if a.out:
        Path(a.out).write_text(json.dumps({"store": a.store, "device": a.device, "dtype": a.dtype,
                                           "tokens_per_prompt": a.tokens, "variants": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
