"""Hardware floors and the printed summary of a `bench moe-gpu` result.

A floor is the time the measured work would take at the measured bandwidths alone: resident
bytes over the HBM rate, bytes that cross PCIe over the best host -> GPU rate, and for prefill
also the matmul rate. Kept apart from the measurement so that it is checked without a GPU
(tests/benchmarks/test_moe_gpu_floors.py).
"""

from __future__ import annotations


def add_floors(res: dict, lay) -> None:
    """Hardware floor of the measured work: max(resident bytes / HBM, streamed bytes / PCIe[, flops])."""
    bw = res.get("bandwidth")
    if not bw:
        return
    hbm = bw["hbm_copy_GBps"] * 1e9
    pcie = max(bw["h2d_pinned_GBps"], bw["zero_copy_read_GBps"]) * 1e9
    wb, r, n_l = lay.weight_bytes, lay.length, res["model"]["layers"]
    res["floor_model"] = {"hbm_GBps": hbm / 1e9, "pcie_GBps": pcie / 1e9, "bytes": "weight bytes (no padding)"}
    for t, d in res.get("decode", {}).items():
        t = int(t)
        hits, misses, adm = d["hits_per_step"], d["misses_per_step"], d["admitted_per_step"]
        floor = max((hits + n_l) * wb / hbm, misses * wb / pcie)  # + n_l: one shared expert per layer
        d["floor_step_ms"] = 1e3 * floor
        d["floor_per_token_ms"] = 1e3 * floor / t
        d["pct_of_floor"] = 100 * floor / (d["step_ms"] / 1e3)
        # every miss crosses PCIe once: gathered into a slot / scratch row (then read in HBM), or read in place
        staged = misses if res["args"].get("stage_misses") else adm
        pcie_bytes = staged * r + (misses - staged) * wb
        d["bytes_per_token"] = {"pcie": pcie_bytes / t, "hbm": ((hits + staged + n_l) * wb + staged * r) / t, "cpu": 0}
        for key in ("baseline", "baseline_copy_triton"):
            if key in d:
                d[key]["ratio_ours_faster"] = d[key]["step_ms"] / d["step_ms"]
    ex = res.get("exactness", {}).get("batches", {})
    for t, d in ex.items():
        if "per_layer_ms_all_resident" in d:
            floor = (d["unique_per_layer"] + 1) * wb / hbm
            d["floor_per_layer_ms"] = 1e3 * floor
            d["pct_of_floor"] = 100 * floor / (d["per_layer_ms_all_resident"] / 1e3)
    p = res.get("prefill")
    if p:
        m = res["model"]
        flops = 2 * p["tokens"] * (m["top_k"] + 1) * 3 * m["hidden"] * m["inter"] * n_l
        terms = {"pcie_s": p["staged_per_layer"] * n_l * wb / pcie,
                 "hbm_s": (p["resident_used_per_layer"] + 1) * n_l * wb / hbm,
                 "compute_s": flops / (bw["bf16_matmul_TFLOPs"] * 1e12)}
        floor = max(terms.values())
        p["floor"] = {**terms, "chunk_ms": 1e3 * floor, "tok_s": p["tokens"] / floor}
        p["pct_of_floor"] = 100 * p["tok_s"] / p["floor"]["tok_s"]
        for key in ("baseline", "baseline_copy_triton"):
            if key in p:
                p[key]["ratio_ours_faster"] = p["tok_s"] / p[key]["tok_s"]


def summary(res: dict) -> str:
    m = res["model"]
    lines = [f"moe-gpu {res['date']} {res['env'].get('gpu', 'cpu')}: {m['layers']} layers x {m['experts']} experts "
             f"({m['kind']}, {m['record_bytes'] / 2**20:.2f} MiB/record), {m['slots_per_layer']} GPU slots/layer"]
    bw = res.get("bandwidth")
    if bw:
        lines.append(f"  bandwidth GB/s: HBM copy {bw['hbm_copy_GBps']:.0f}, pinned H2D {bw['h2d_pinned_GBps']:.1f} "
                     f"(per record {bw['h2d_pinned_per_record_GBps']:.1f}), "
                     f"zero-copy read {bw['zero_copy_read_GBps']:.1f}; "
                     f"bf16 mm {bw['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    ex = res.get("exactness")
    if ex:
        lines.append(f"  exactness ({ex['layers']} layers, {ex['steps']} steps, budgets 100/10/0 %): "
                     f"{'bit-identical' if ex['all_bit_identical'] else 'MISMATCH'}")
        for t, d in ex["batches"].items():
            if "twin_rel_err" in d:
                lines.append(f"    T={t} vs plain-torch twin: rel err {d['twin_rel_err']:.1e}")
            if "pct_of_floor" in d:
                lines.append(f"    all-resident T={t}: {1e3 * d['per_layer_ms_all_resident']:.1f} us/layer "
                             f"(HBM floor {1e3 * d['floor_per_layer_ms']:.1f} us, {d['pct_of_floor']:.0f} %)")
    for t, d in res.get("decode", {}).items():
        s = (f"  decode T={t}: {d['step_ms']:.2f} ms/step, {d['per_token_ms']:.2f} ms/token, "
             f"{1e3 * d['per_layer_ms']:.0f} us/layer, hit {100 * d['hit_rate']:.1f} %")
        if "pct_of_floor" in d:
            s += f", floor {d['floor_step_ms']:.2f} ms -> {d['pct_of_floor']:.0f} % of floor"
        if "baseline" in d:
            s += f"; naive torch {d['baseline']['step_ms']:.1f} ms ({d['baseline'].get('ratio_ours_faster', 0):.2f}x)"
        lines.append(s)
    p = res.get("prefill")
    if p:
        s = f"  prefill {p['tokens']}: {p['tok_s']:.0f} tok/s ({p['chunk_ms']:.0f} ms/chunk)"
        if "floor" in p:
            s += f", floor {p['floor']['tok_s']:.0f} tok/s -> {p['pct_of_floor']:.0f} %"
        if "baseline" in p:
            s += f"; naive torch {p['baseline']['tok_s']:.0f} tok/s"
        lines.append(s)
    return "\n".join(lines)
