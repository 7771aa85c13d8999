#!/usr/bin/env python3
"""Side-by-side report: floor, `tiermoe bench report` tables and the comparison table.

python3 scripts/sbs/report.py SBS_DIR --layers L --n-cpu-moe N --threads T --ubatch U

Reads SBS_DIR/results (written by scripts/llamacpp_side_by_side.sh), computes each engine's
decode floor for its own expert placement with `tiermoe bench floor` (bandwidths measured by
probe.py; llama.cpp's fixed layer split, tiermoe's slot hit share over its sweep), and writes
results/side_by_side.md: setup (machine, versions, commands, GPU memory of each engine), one
comparison row per measurement with each engine's rate, the ratio and the share of its floor,
the agreement of the two engines' outputs, and `tiermoe bench report`'s detailed tables.
Numbers are only ever read from the result files; a missing file leaves its cells as "-".
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import subprocess
import sys
from pathlib import Path


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _f(x, nd: int = 1) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def vram_peak_mib(path: Path) -> float | None:
    """Peak of nvidia-smi memory.used samples ('timestamp, MiB' lines)."""
    peak = None
    for line in _text(path).splitlines():
        try:
            v = float(line.split(",")[-1])
        except ValueError:
            continue
        peak = v if peak is None else max(peak, v)
    return peak


def rows_of(sweep: dict | None) -> dict:
    """{'prefill <n>': tok/s, 'C<c> per-stream': tok/s, 'C<c> aggregate': tok/s} of a sweep result."""
    out: dict = {}
    if not sweep:
        return out
    for p in sweep.get("prefill", []):
        out[f"prefill {p['target_tokens']}"] = p.get("median_tok_s")
    for d in sweep.get("decode", []):
        out[f"C{d['concurrency']} per-stream"] = d.get("per_stream_tok_s")
        out[f"C{d['concurrency']} aggregate"] = d.get("aggregate_tok_s")
    return out


def floor_args(meta: dict, env: dict, layers: int, gpu_share: float, rest: str) -> list[str]:
    """`tiermoe bench floor` arguments: `gpu_share` of the expert reads from HBM, the rest by
    `rest`: "ram" (read over PCIe: tiermoe exact), "cpu" (computed by the CPU where they sit:
    llama.cpp's CPU layers) or "host" (split at best between the two, both sharing host
    bandwidth: tiermoe fast, whose CPU lane may take some); plus the dense weights (attention,
    norms, embeddings) read from HBM once per token."""
    tier = "cpu" if rest == "cpu" else "ram"
    args = ["--bytes-per-expert", str(meta["sizes"]["store_bytes_per_expert"]), "--top-k", str(meta["spec"]["top_k"]),
            "--moe-layers", str(layers), "--fractions", f"gpu={gpu_share:.6f},{tier}={1 - gpu_share:.6f}"]
    if rest == "host":
        args.append("--balance-host")
    for flag, key in (("--hbm-gbs", "hbm_gbs"), ("--pcie-gbs", "pcie_gbs"), ("--cpu-gbs", "host_read_gbs"),
                      ("--host-gbs", "host_read_gbs")):
        if env.get(key):
            args += [flag, str(env[key])]
    dense = meta["sizes"].get("dense_bytes")
    if dense and env.get("hbm_gbs"):
        args += ["--non-moe-ms", f"{dense / float(env['hbm_gbs']) / 1e6:.4f}"]
    return args


def slot_hit_share(after: dict | None, before: dict | None) -> float | None:
    """Share of expert reads the GPU slots served during the sweep (tiermoe's /stats before and
    after): the device cache moves hot experts into HBM, so its floor is not the static split."""
    now, then = flatten((after or {}).get("engine") or {}), flatten((before or {}).get("engine") or {})
    hits, misses = (now.get(f"experts.slots.{k}", 0) - then.get(f"experts.slots.{k}", 0) for k in ("hits", "misses"))
    return hits / (hits + misses) if hits + misses > 0 else None


def floors(res: Path, meta: dict, env: dict, labels: list[str], layers: int, n_cpu_moe: int) -> dict:
    """{engine label: `tiermoe bench floor` result} for the work each engine did: llama.cpp's
    fixed split ((L - N) / L of the experts in HBM, the rest computed by the CPU), tiermoe's slot
    hit share measured over its sweep's decode steps (C1 and C4 together; the static split,
    marked "static", when its counters are missing), the rest over PCIe (exact) or split with
    the CPU lane (fast). Written to results/floor-LABEL.json."""
    out = {}
    for label in labels:
        share, how, rest = (layers - n_cpu_moe) / layers, "static", "cpu"
        if label.startswith("tiermoe"):
            rest = "host" if label.split("@")[0].endswith("fast") else "ram"
            measured = slot_hit_share(_load(res / f"stats-{label}.json"), _load(res / f"stats-before-{label}.json"))
            share, how = (measured, "measured") if measured is not None else (share, "static")
        path = res / f"floor-{label}.json"
        cmd = [sys.executable, "-m", "tiermoe.cli", "bench", "floor", *floor_args(meta, env, layers, share, rest),
               "--out", str(path)]
        if subprocess.run(cmd, capture_output=True, text=True).returncode == 0 and _load(path):
            out[label] = {**_load(path), "gpu_share": share, "share_source": how}
    return out


def comparison(sweeps: dict, floor_of: dict) -> list[str]:
    labels = [k for k in sweeps if k.startswith("tiermoe")] + (["llamacpp"] if "llamacpp" in sweeps else [])
    rows = {k: rows_of(v) for k, v in sweeps.items()}
    keys = []
    for r in rows.values():
        keys += [k for k in r if k not in keys]
    tier = [k for k in labels if k.startswith("tiermoe")]
    head = ["measurement (tok/s)"] + labels + (["best tiermoe / llama.cpp"] if tier and "llamacpp" in labels else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    behind = []
    for key in keys:
        vals = [rows[lab].get(key) for lab in labels]
        cells = [_f(v) for v in vals]
        if tier and "llamacpp" in labels:
            best = max((rows[t].get(key) or 0.0) for t in tier)
            ref = rows["llamacpp"].get(key)
            ratio = best / ref if best and ref else None
            cells.append(_f(ratio, 2) + ("x" if ratio else ""))
            if ratio is not None and ratio < 1.0:
                behind.append(key)
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    if floor_of and "C1 per-stream" in keys:  # each engine against the floor of its own expert placement
        pad = " | |" if len(head) > len(labels) + 1 else " |"
        share = [
            _f(100 * floor_of[lab]["gpu_share"], 1)
            + " %"
            + (" (static)" if floor_of[lab].get("share_source") == "static" and lab.startswith("tiermoe") else "")
            if lab in floor_of
            else "-"
            for lab in labels
        ]
        lines.append("| expert reads from HBM (the floor's split) | " + " | ".join(share) + pad)
        cells = []
        for lab in labels:
            v, fl = rows[lab].get("C1 per-stream"), floor_of.get(lab)
            cells.append(f"{_f(100 * v / fl['tok_s'], 0)} % of {_f(fl['tok_s'])}" if v and fl else "-")
        lines.append("| C1 per-stream / floor (tok/s) | " + " | ".join(cells) + pad)
    lines.append("")
    if behind:
        lines.append(f"Rows where tiermoe is not ahead: {', '.join(behind)} (profile below).")
        lines.append("")
    return lines


def flatten(obj, prefix: str = "") -> dict:
    """Numeric leaves of a nested dict as {'a.b.c': value}."""
    flat: dict = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            flat.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        flat[prefix] = obj
    return flat


def profile(after: dict | None, before: dict | None, label: str, floor: dict | None) -> list[str]:
    """tiermoe's counters over the measured sweep (after - before: tier hits, bytes moved, lane
    work, steps) next to the floor's bound lane: where the time went when a row is behind."""
    out = [f"#### {label}: engine counters during the sweep", ""]
    if floor:
        out.append(f"Floor bound lane: **{floor['bound']}** ({_f(floor['floor_ms'], 2)} ms/token at C1).")
    now, then = flatten((after or {}).get("engine") or {}), flatten((before or {}).get("engine") or {})
    flat = {k: v - then.get(k, 0) for k, v in now.items()}
    words = ("hit", "miss", "bytes", "lane", "evict", "read", "steps", "seconds", "tokens")
    # Counters only: ratios (per_*), sizes and levels do not subtract.
    skip = ("per_", "capacity", "resident", "in_flight", "kv_", "running", "waiting")
    picked = {k: v for k, v in flat.items() if any(w in k for w in words) and not any(w in k for w in skip) and v}
    if picked:
        out += ["", "| counter | value |", "|---|---|"] + [
            f"| {k} | {_f(v, 3) if isinstance(v, float) else v} |" for k, v in picked.items()
        ]
    else:
        out.append("(no counters recorded)")
    return out + [""]


def agreement(res: Path) -> list[str]:
    """Greedy completions of the same raw prompts: each tiermoe mode against llama.cpp."""
    spec = importlib.util.spec_from_file_location("greedy", Path(__file__).with_name("greedy.py"))
    greedy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(greedy)
    ref = _load(res / "greedy-llamacpp.json")
    out = []
    for p in sorted(res.glob("greedy-tiermoe-*.json")):
        mine = _load(p)
        if not (ref and mine):
            continue
        c = greedy.compare(mine, ref)
        out.append(
            f"| {p.stem.removeprefix('greedy-')} vs llama.cpp | {c['identical_completions']}/{c['prompts']} | "
            f"{c['tokens_before_divergence']}/{c['tokens']} | {_f(c['topn_overlap_on_prefix'], 3)} | "
            f"{_f(c['mean_abs_logprob_diff'], 4)} / {_f(c['max_abs_logprob_diff'], 4)} |"
        )
    if not out:
        return []
    head = [
        "Same weights, same answers? Greedy completions of the built-in panel prompts "
        "(raw, 32 tokens, top-5 logprobs):",
        "",
        "| pair | identical completions | tokens before divergence | top-5 overlap | mean / max abs logprob diff |",
        "|---|---|---|---|---|",
    ]
    return head + out + [""]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("sbs_dir")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--n-cpu-moe", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--ubatch", type=int, required=True)
    a = ap.parse_args()
    res = Path(a.sbs_dir) / "results"
    logs = Path(a.sbs_dir) / "logs"
    env = _load(res / "env.json") or {}
    meta = _load(res / "synthetic-store.json") or _load(res / "synthetic-gguf.json")
    if meta is None:
        print("no synthetic-*.json in results: nothing to report", file=sys.stderr)
        return 2
    py = sys.executable
    sweeps = {}
    for p in sorted(res.glob("sweep-*.json")):
        sweeps[p.stem.removeprefix("sweep-")] = _load(p)
    floor_of = floors(res, meta, env, list(sweeps), a.layers, a.n_cpu_moe)
    spec, sizes = meta["spec"], meta["sizes"]
    gguf_meta, store_meta = _load(res / "synthetic-gguf.json"), _load(res / "synthetic-store.json")
    gpu_gib = (a.layers - a.n_cpu_moe) * spec["experts"] * sizes["store_bytes_per_expert"] / 2**30
    md = [f"## Side by side: tiermoe vs llama.cpp expert offload ({dt.date.today().isoformat()})", ""]
    md += [
        f"Machine: {env.get('gpu', '?')} (driver {env.get('driver', '?')}, CUDA {env.get('cuda', '?')}), "
        f"{env.get('cpus', '?')} CPUs, {env.get('mem_total_gib', '?')} GiB RAM; torch {env.get('torch', '?')}. "
        f"Measured: HBM {env.get('hbm_gbs', '?')} GB/s, pinned host->GPU {env.get('pcie_gbs', '?')} GB/s, "
        f"host read ({a.threads} threads) {env.get('host_read_gbs', '?')} GB/s.",
        "",
    ]
    md += [
        f"Versions: tiermoe {_text(res / 'tiermoe-commit.txt')[:12] or '?'}; llama.cpp: "
        f"{' / '.join(_text(res / 'llamacpp-version.txt').splitlines()) or '?'}.",
        "",
    ]
    same_weights = gguf_meta and store_meta and gguf_meta["weights_sha256"] == store_meta["weights_sha256"]
    md += [
        f"Model: random-weight Qwen3-MoE, {a.layers} layers of Qwen3-235B-A22B's MoE shape (hidden {spec['hidden']}, "
        f"{spec['experts']} experts x intermediate {spec['moe_intermediate']}, top-{spec['top_k']}, {spec['heads']}/"
        f"{spec['kv_heads']} heads of {spec['head_dim']}), vocabulary {spec['vocab']}. Experts: tiermoe int4 store "
        f"(group {spec['group_size']}, bf16 scales) {sizes['store_bytes_per_expert']:,} B/expert; llama.cpp Q4_0 "
        f"{sizes['gguf_bytes_per_expert']:,} B/expert; same weights (generation digest "
        f"{'equal' if same_weights else 'NOT COMPARED'}"
        f"{'; ' + _text(res / 'check.txt').splitlines()[-1] if _text(res / 'check.txt') else ''}).",
        "",
    ]
    md += [
        f"Equal budget: {a.layers - a.n_cpu_moe} of {a.layers} layers' experts = {gpu_gib:.2f} GiB of GPU memory for "
        f"experts in both (tiermoe `--gpu-expert-gb {gpu_gib:.4f}`, llama.cpp `--n-cpu-moe {a.n_cpu_moe}`); "
        f"{a.threads} CPU threads each; {a.ubatch} tokens per step.",
        "",
    ]
    vram = {p.stem.removeprefix("vram-"): vram_peak_mib(p) for p in sorted(logs.glob("vram-*.csv"))}
    if vram:
        md += [
            "Peak GPU memory in use (nvidia-smi): " + ", ".join(f"{k} {_f(v, 0)} MiB" for k, v in vram.items()) + ".",
            "",
        ]
    buffers = _text(res / "llamacpp-buffers.txt")
    if buffers:
        md += ["llama.cpp buffers:", "", "```", buffers, "```", ""]
    md += ["Commands:", "", "```"] + [_text(p) for p in sorted(res.glob("cmd-*.txt"))] + ["```", ""]
    md += comparison(sweeps, floor_of)
    md += agreement(res)
    notes = _text(res / "notes.txt")
    if notes:
        md += ["Notes: " + notes, ""]
    for label in [k for k in sweeps if k.startswith("tiermoe")]:
        md += profile(
            _load(res / f"stats-{label}.json"), _load(res / f"stats-before-{label}.json"), label, floor_of.get(label)
        )
    detail = [str(res / f"floor-{label}.json") for label in floor_of]
    detail += [str(res / f"sweep-{k}.json") for k in sweeps]
    if detail:
        r = subprocess.run(
            [py, "-m", "tiermoe.cli", "bench", "report", *detail, "--title", "Detail"], capture_output=True, text=True
        )
        md += [r.stdout if r.returncode == 0 else f"(bench report failed: {r.stderr.strip()[-300:]})"]
    (res / "side_by_side.md").write_text("\n".join(md).rstrip() + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
