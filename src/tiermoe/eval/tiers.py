"""`tiermoe eval tiers`: are logits bit-identical whatever share of experts the GPU/host tiers hold?

Runs the fixed parity prompts through the packed store once per tier configuration (fractions
of all routed experts given to the device slot tier, the rest to host RAM, or to nothing) and
compares every configuration's logits with the first, bit for bit.
"""

from __future__ import annotations

import json

import torch


def expert_bytes(store_dir: str) -> int:
    manifest = json.loads(open(f"{store_dir}/manifest.json").read())
    return sum(int(r["length"]) for r in manifest["records"])


def run_tiers(store: str, device: str, budgets: list[float], host_budgets: list[float | None],
              routing: dict | None = None) -> dict:
    """routing: engine flags of a routing replay (`--routing-replay`), the same for every
    configuration: each engine starts at the same table row, so the picks match and exact
    mode must still give the same bits."""
    from pathlib import Path

    from tiermoe.engine.build import build_engine, engine_config, is_packed_store
    from tiermoe.errors import UserError
    from tiermoe.eval.parity import engine_logits, parity_prompts

    if not is_packed_store(Path(store)):
        raise UserError(f"{store}: not a packed store (needs manifest.json and experts.bin; see tiermoe pack)")
    total = expert_bytes(store)
    rows, baseline = [], None
    for gpu_frac in budgets:
        for host_frac in host_budgets:
            options = {**(routing or {}), "gpu_expert_gb": gpu_frac * total / 2**30}
            if host_frac is not None:
                options["host_expert_gb"] = host_frac * total / 2**30
            engine = build_engine(engine_config(store, device=device, dtype="auto", max_num_seqs=1, options=options))
            prompts = parity_prompts(engine.tokenizer, engine.vocab_size, min_positions=256)
            logits = torch.cat([engine_logits(engine, p) for p in prompts])
            counters = engine.runner.experts.counters()
            counters["routing"] = engine.stats()["routing"]
            engine.runner.experts.close()
            if baseline is None:
                baseline = logits
            rows.append({"gpu_fraction": gpu_frac, "host_fraction": host_frac, "positions": int(logits.shape[0]),
                         "bit_identical": bool(torch.equal(logits, baseline)),
                         "max_abs_diff": float((logits - baseline).abs().max()), "counters": counters})
    return {"store": store, "device": device, "configs": rows,
            "all_bit_identical": all(r["bit_identical"] for r in rows)}
