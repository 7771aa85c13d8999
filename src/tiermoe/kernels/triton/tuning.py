"""Launch-configuration search for the fused MoE kernel (run on the target GPU).

Decode (BLOCK_M = 16, T <= 16) and prefill buckets are tuned separately, each stage
(gate_up, down) in turn with the other fixed, on records resident in HBM. Decode candidates
are timed inside a CUDA graph of `reps` calls with different routing per call, so launch
overhead and L2 reuse do not decide the winner; prefill candidates are timed eagerly (each
call is milliseconds). The result is merged into configs.json under the device's name.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import torch

from tiermoe.kernels.layout import ExpertLayout
from tiermoe.kernels.triton.fused_moe import CONFIG_PATH, _check_config, default_config, fused_moe, shape_key
from tiermoe.kernels.triton.moe_gemv import check_gemv_config


def _decode_candidates(layout: ExpertLayout) -> list[dict]:
    """Most promising first: a deadline cuts the tail."""
    g = layout.group_size or 128
    shapes = [(32, 128, 4, 4), (64, 128, 4, 4), (16, 128, 4, 4), (32, 64, 4, 4), (64, 128, 8, 3), (32, 128, 4, 2)]
    cands = [
        {"BM": 16, "BN": bn, "BK": bk, "num_warps": nw, "num_stages": ns}
        for bn, bk, nw, ns in shapes
        if _fits(layout, bn, bk, g)
    ]
    return [c for c in cands if _accepted(layout, c)]


def _gemv_candidates(layout: ExpertLayout) -> list[dict]:
    """Launch shapes of the few-token matrix-vector kernel (moe_gemv.py), most promising first."""
    g = layout.group_size or 128
    # (BN, BK, warps, stages, accumulator): "tile" keeps [BN, BK] fp32 tiles and reduces once
    # (more registers a thread), "row" reduces each tile as it comes (fewer registers, so more
    # blocks an SM in flight, but more shuffles); which wins is measured here
    shapes = [
        (32, 256, 4, 3, "tile"),
        (16, 256, 4, 3, "tile"),
        (32, 256, 4, 3, "row"),
        (64, 256, 4, 3, "row"),
        (64, 128, 4, 3, "tile"),
        (16, 512, 4, 3, "row"),
        (128, 256, 8, 3, "row"),
        (8, 512, 2, 3, "tile"),
    ]
    cands = [
        {"BN": bn, "BK": bk, "num_warps": nw, "num_stages": ns, "acc": acc}
        for bn, bk, nw, ns, acc in shapes
        if _fits(layout, bn, bk, g)
    ]
    return [c for c in cands if _accepted(layout, c, gemv=True)]


def _fits(layout: ExpertLayout, bn: int, bk: int, g: int) -> bool:
    """Does a BN x BK tile divide both matrices, with K tiles within or across whole groups?"""
    dims_ok = all(
        n % bn == 0 and k % bk == 0 for n, k in ((layout.inter, layout.hidden), (layout.hidden, layout.inter))
    )
    return dims_ok and (layout.kind == "bf16" or g % bk == 0 or bk % g == 0)


def _accepted(layout: ExpertLayout, cand: dict, gemv: bool = False) -> bool:
    """Does the kernel's own configuration check take `cand` for both stages? (Kind-specific
    limits, e.g. int3's K tiles of at least 64, stay in one place: the kernels'.)"""
    try:
        if gemv:
            check_gemv_config(layout, {"gate_up": cand, "down": cand})
        else:
            _check_config(layout, {"gate_up": cand, "down": cand}, 1)
    except ValueError:
        return False
    return True


def _prefill_candidates(layout: ExpertLayout, bm: int) -> list[dict]:
    shapes = (
        [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 4), (128, 128, 8, 3)]
        if bm == 64
        else [(128, 64, 8, 3), (128, 32, 8, 4)]
    )
    cands = [
        {"BM": bm, "BN": bn, "BK": bk, "num_warps": nw, "num_stages": ns}
        for bn, bk, nw, ns in shapes
        if _fits(layout, bn, bk, layout.group_size or 128)
    ]
    return [c for c in cands if _accepted(layout, c)]


def _sample(pop: torch.Tensor, tokens: int, k: int, gen: torch.Generator, shared_row: int):
    ids = torch.multinomial(pop.expand(tokens, -1).contiguous(), k, False, generator=gen)
    ids = torch.cat([ids, torch.full((tokens, 1), shared_row, device=pop.device)], 1).to(torch.int32)
    w = torch.cat(
        [
            torch.softmax(torch.rand(tokens, k, device=pop.device, generator=gen), -1),
            torch.ones(tokens, 1, device=pop.device),
        ],
        1,
    )
    return ids, w


def _time_decode(layout, table, pop, k, cfg, tokens, gen, reps=16) -> float:
    """Seconds per fused_moe call (graph of `reps` calls with fresh routing each)."""
    shared_row = table.numel() - 1
    calls = [_sample(pop, tokens, k, gen, shared_row) for _ in range(reps)]
    x = torch.randn(tokens, layout.hidden, device=table.device, generator=gen).to(torch.bfloat16)
    for ids, w in calls[:2]:
        fused_moe(x, ids, w, table, layout, config=cfg)  # compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for ids, w in calls:
            fused_moe(x, ids, w, table, layout, config=cfg)
    g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(3):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / (3 * reps)


def decode_gbps(layout, table, pop, k, cfg, gen) -> float:
    """Weight GB/s of one-token decode calls with `cfg`: the weight bytes of the k routed records
    plus the shared row (k + 1 records, each read whole) over the time per call, align and sum
    kernels included. Comparable across record kinds: what a kind's kernels make of its fewer
    bytes, against the HBM copy rate."""
    return (k + 1) * layout.weight_bytes / _time_decode(layout, table, pop, k, cfg, 1, gen) / 1e9


def _time_prefill(layout, table, pop, k, cfg, tokens, gen) -> float:
    ids, w = _sample(pop, tokens, k, gen, table.numel() - 1)
    x = torch.randn(tokens, layout.hidden, device=table.device, generator=gen).to(torch.bfloat16)
    fused_moe(x, ids, w, table, layout, config=cfg)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(3):
        fused_moe(x, ids, w, table, layout, config=cfg)
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / 3


def tune(
    layout: ExpertLayout,
    records: torch.Tensor,
    pop: torch.Tensor,
    top_k: int,
    prefill_tokens: int,
    gen: torch.Generator,
    time_budget_s: float = 90.0,
    log=print,
) -> tuple[dict, dict]:
    """Best {"decode": cfg, "prefill": cfg} for records uint8 [E, R] on the GPU; plus a report."""
    e_n = records.shape[0]
    table = records.data_ptr() + torch.arange(e_n + 1, device=records.device, dtype=torch.int64) * layout.length
    table[-1] = records.data_ptr()  # shared row: any record
    deadline = time.perf_counter() + time_budget_s
    report: dict = {"decode": [], "prefill": []}

    def search(bucket, base, cands_for_stage, timer):
        best = {"gate_up": dict(base["gate_up"]), "down": dict(base["down"])}
        best_t = timer(best)
        report[bucket].append({"config": json.loads(json.dumps(best)), "s": best_t})
        for stage in ("gate_up", "down"):
            for cand in cands_for_stage:
                if time.perf_counter() > deadline:
                    return best, best_t
                trial = {**best, stage: cand}
                if stage == "gate_up" and cand["BM"] != best["down"]["BM"]:
                    trial["down"] = {**best["down"], "BM": cand["BM"]}
                try:
                    t = timer(trial)
                except Exception as exc:  # a config may not compile (resources); skip it
                    report[bucket].append({"config": trial, "error": str(exc).splitlines()[0][:200]})
                    continue
                report[bucket].append({"config": trial, "s": t})
                if t < best_t:
                    best, best_t = trial, t
        return best, best_t

    def dec_timer(cfg):
        return _time_decode(layout, table, pop, top_k, cfg, 1, gen) + _time_decode(
            layout, table, pop, top_k, cfg, 4, gen
        )

    dec, dec_t = search("decode", default_config(layout, 1), _decode_candidates(layout), dec_timer)
    log(f"tune decode: {dec} ({dec_t * 1e6:.1f} us for T=1 + T=4)")
    pre_best, pre_t, pre_default_t = None, float("inf"), None
    if prefill_tokens:
        pre_default_t = _time_prefill(
            layout, table, pop, top_k, default_config(layout, prefill_tokens), prefill_tokens, gen
        )
        for bm in (64, 128):
            base = default_config(layout, prefill_tokens)
            base = {s: {**c, "BM": bm} for s, c in base.items()}
            timer = lambda cfg: _time_prefill(layout, table, pop, top_k, cfg, prefill_tokens, gen)  # noqa: E731
            cfg, t = search("prefill", base, _prefill_candidates(layout, bm), timer)
            if t < pre_t:
                pre_best, pre_t = cfg, t
        log(f"tune prefill: {pre_best} ({pre_t * 1e3:.2f} ms per {prefill_tokens}-token layer)")
    gemv = _tune_gemv(layout, table, pop, top_k, dec, gen, deadline, report)  # last: what time is left
    if gemv is not None:
        dec = {**dec, "gemv": gemv}
        log(f"tune decode: the matrix-vector kernel up to {gemv['max_tokens']} tokens: {gemv}")
    out = {"decode": dec, "prefill": pre_best or default_config(layout, max(prefill_tokens, 17))}
    defaults = {"decode_s": report["decode"][0]["s"], "prefill_s": pre_default_t}  # what untuned shapes get
    defaults["decode_t1_GBps"] = decode_gbps(layout, table, pop, top_k, default_config(layout, 1), gen)
    gbps = decode_gbps(layout, table, pop, top_k, dec, gen)
    log(f"tune decode: T=1 streams {gbps:.0f} GB/s of weights (default configuration {defaults['decode_t1_GBps']:.0f})")
    return out, {"decode_s": dec_t, "prefill_s": pre_t if pre_best else None, "decode_t1_GBps": gbps,
                 "default": defaults, "trials": report}


def _tune_gemv(
    layout: ExpertLayout,
    table: torch.Tensor,
    pop: torch.Tensor,
    top_k: int,
    block_cfg: dict,
    gen: torch.Generator,
    deadline: float,
    report: dict,
) -> dict | None:
    """The best matrix-vector configuration at T = 1 and the most tokens up to which it beats the
    block kernel's `block_cfg` (tried at 2, 4, 8, 16), or None where it never does."""
    cands = _gemv_candidates(layout)
    report["gemv"] = []
    if not cands:
        return None

    def timed(gemv: dict, tokens: int) -> float:
        return _time_decode(layout, table, pop, top_k, {**block_cfg, "gemv": {**gemv, "max_tokens": 16}}, tokens, gen)

    best, best_t = None, float("inf")
    for stage in ("both", "gate_up", "down"):  # one shape for both, then each stage in turn
        for cand in cands:
            if time.perf_counter() > deadline:
                break
            trial = {"gate_up": dict(cand), "down": dict(cand)} if stage == "both" else {**best, stage: dict(cand)}
            try:
                t = timed(trial, 1)
            except Exception as exc:  # a config may not compile (resources); skip it
                report["gemv"].append({"config": trial, "error": str(exc).splitlines()[0][:200]})
                continue
            report["gemv"].append({"config": trial, "s": t})
            if t < best_t:
                best, best_t = trial, t
        if best is None:
            return None
    block_t = _time_decode(layout, table, pop, top_k, block_cfg, 1, gen)
    report["gemv_vs_block"] = {1: [best_t, block_t]}
    if best_t >= block_t:
        return None
    max_tokens = 1
    for tokens in (2, 4, 8, 16):
        try:
            mine, theirs = timed(best, tokens), _time_decode(layout, table, pop, top_k, block_cfg, tokens, gen)
        except Exception as exc:  # keep what was measured so far
            report["gemv_vs_block"][tokens] = str(exc).splitlines()[0][:200]
            break
        report["gemv_vs_block"][tokens] = [mine, theirs]
        if mine >= theirs:
            break
        max_tokens = tokens
    return {**best, "max_tokens": max_tokens}


def save_configs(
    path: str | Path, device_name: str, layout: ExpertLayout, cfgs: dict, base: str | Path = CONFIG_PATH
) -> None:
    """Merge `cfgs` into the JSON at `base` (the package's) and write it to `path`."""
    try:
        data = json.loads(Path(base).read_text())
    except FileNotFoundError:
        data = {}
    data.setdefault("format", 1)
    data.setdefault("devices", {}).setdefault(device_name, {})[shape_key(layout)] = cfgs
    Path(path).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
