"""Render bench result JSON files into markdown (for docs/results.md) and PNG plots.

Every section is dated and carries the command that produced it, because a table without its
command cannot be reproduced or compared. Plots use matplotlib's Agg backend (no display) and
are only drawn where a picture says more than the table: sweep rates and stream delivery.
"""

from __future__ import annotations

import os
from pathlib import Path

from tiermoe.store.floor import fraction_of_floor
from tiermoe.bench.results import kind_of, read_json
from tiermoe.errors import UserError


def _f(x, nd: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, float)):
        return f"{x:,.{nd}f}"
    return str(x)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in r) + " |" for r in rows]
    return out


def _head(title: str, r: dict) -> list[str]:
    date = str(r.get("created", ""))[:10]
    lines = [f"### {title} ({date})", ""]
    who = " · ".join(str(x) for x in (r.get("model"), r.get("url"), r.get("host")) if x)
    if who:
        lines += [who, ""]
    if r.get("command"):
        lines += [f"Command: `{r['command']}`", ""]
    return lines


def _sweep_md(r: dict, floor: dict | None) -> list[str]:
    lines = _head("Speed sweep", r)
    rows = [
        [_f(p["target_tokens"], 0), _f(p["prompt_tokens"], 0), _f(p["median_tok_s"]), _f(p["median_ttft_s"], 3)]
        for p in r.get("prefill", [])
    ]
    reps = (r.get("config") or {}).get("reps", "?")
    lines += _table(["prefill size", "prompt tokens", f"prefill tok/s (median of {reps})", "TTFT s"], rows) + [""]
    def share(rate: float | None, conc: int) -> str:
        # The floor is a single-stream (C1) bound; batched rounds share expert reads.
        if not rate or conc != 1:
            return "-"
        return _f(fraction_of_floor(rate, floor) * 100, 0) + " %"

    rows = []
    tiers = any(d.get("tiers_per_token") for d in r.get("decode", []))
    for d in r.get("decode", []):
        row = [f"C{d['concurrency']}", _f(d["aggregate_tok_s"]), _f(d["per_stream_tok_s"])]
        if floor:
            row.append(share(d["per_stream_tok_s"], d["concurrency"]))
        if tiers:
            t = d.get("tiers_per_token") or {}
            row += [_f(t.get("slot_hits")), _f(t.get("slot_misses")), _f(t.get("lane_experts"))]
        rows.append(row)
    lc = r.get("long_prompt_c1")
    if lc:
        row = [f"C1 after {_f(lc.get('prompt_tokens'), 0)}-token prompt", "-", _f(lc.get("per_stream_tok_s"))]
        if floor:
            row.append(share(lc.get("per_stream_tok_s"), 1))
        rows.append(row + (["-", "-", "-"] if tiers else []))
    header = ["decode", "aggregate tok/s", "per-stream tok/s"] + (["C1 / floor"] if floor else [])
    if tiers:  # how the tiers served the decode tokens: a rate means little without it
        header += ["slot hits / token", "slot misses / token", "CPU-lane experts / token"]
    return lines + _table(header, rows) + [""]


def _stream_md(r: dict) -> list[str]:
    lines = _head("Stream delivery", r)
    rows = [
        [
            r.get("verdict"),
            _f((r.get("fraction_by_midpoint") or 0) * 100, 0) + " %",
            _f((r.get("fraction_in_tail") or 0) * 100, 0) + " %",
            _f(r.get("per_stream_tok_s")),
            _f(r.get("completion_tokens"), 0),
            r.get("reason"),
        ]
    ]
    return lines + _table(["verdict", "text by midpoint", "text in last second", "tok/s", "tokens", "why"], rows) + [""]


def _gates_md(r: dict) -> list[str]:
    lines = _head(f"Acceptance gates: {r.get('verdict')} ({r.get('passed')}/{r.get('total')})", r)
    rows = [[g["name"], g["verdict"], g.get("reason", ""), _f(g.get("duration_s"), 1)] for g in r.get("gates", [])]
    return lines + _table(["gate", "verdict", "evidence", "s"], rows) + [""]


def _panel_score_md(r: dict) -> list[str]:
    lines = _head("Quality panel (teacher-forced)", r)
    ref = r.get("reference") or {}
    lines += [f"Reference: {ref.get('model')} at {ref.get('url')} ({str(ref.get('created', ''))[:10]})", ""]
    rows = [
        [
            _f(r.get("items"), 0),
            _f(r.get("positions"), 0)
            + (f" (+{r['positions_misaligned']} misaligned)" if r.get("positions_misaligned") else ""),
            _f(r.get("top1_agreement"), 3),
            _f(r.get("mean_kl"), 4),
            _f(r.get("greedy_match_fraction"), 3),
            _f(r.get("greedy_exact_fraction"), 3),
            ", ".join(r.get("teacher_forcing") or []),
        ]
    ]
    header = ["items", "positions", "top-1 agreement", "mean KL", "greedy match", "greedy exact", "forcing"]
    return lines + _table(header, rows) + [""]


def _panel_md(r: dict) -> list[str]:
    items = r.get("items") or []
    toks = sum(len(i.get("tokens", [])) for i in items)
    return _head("Quality panel reference", r) + [
        f"{len(items)} prompts, {toks} positions, top-{r.get('top_logprobs')}",
        "",
    ]


def _floor_md(r: dict) -> list[str]:
    lines = _head("Decode floor", r)
    rows = [
        [
            name,
            _f(lane["bytes_per_token"] / 1e9, 3),
            _f(lane["gbs"], 1),
            _f(lane["ms"], 2) + (" (bound)" if name == r["bound"] else ""),
        ]
        for name, lane in r["lanes"].items()
    ]
    lines += _table(["lane", "GB/token", "GB/s", "ms/token"], rows)
    lines += [
        "",
        f"Floor: {_f(r['moe_ms'], 2)} ms MoE + {_f(r['non_moe_ms'], 2)} ms non-MoE = "
        f"**{_f(r['floor_ms'], 2)} ms/token = {_f(r['tok_s'], 1)} tok/s**",
        "",
    ]
    return lines


def _sweep_compare_md(sweeps: list[tuple[str, dict]]) -> list[str]:
    sizes = sorted({p["target_tokens"] for _, r in sweeps for p in r.get("prefill", [])})
    concs = sorted({d["concurrency"] for _, r in sweeps for d in r.get("decode", [])})
    header = ["run", "date"] + [f"prefill {s}" for s in sizes] + [f"C{c} agg" for c in concs]
    rows = []
    for label, r in sweeps:
        pre = {p["target_tokens"]: p["median_tok_s"] for p in r.get("prefill", [])}
        dec = {d["concurrency"]: d["aggregate_tok_s"] for d in r.get("decode", [])}
        rows.append(
            [label, str(r.get("created", ""))[:10]] + [_f(pre.get(s)) for s in sizes] + [_f(dec.get(c)) for c in concs]
        )
    return ["### Sweep comparison (tok/s)", ""] + _table(header, rows) + [""]


def _plot_sweep(r: dict, path: Path, floor: dict | None = None) -> None:
    """Prefill and decode tok/s; where the sweep recorded them, slot hits / misses / CPU-lane experts
    per decode token by concurrency; with a floor result, C1 as a fraction of the floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dec = r.get("decode", [])
    tiers = [d.get("tiers_per_token") for d in dec]
    c1 = next((d["per_stream_tok_s"] for d in dec if d["concurrency"] == 1 and d["per_stream_tok_s"]), None)
    panels = 2 + any(tiers) + bool(floor and c1)
    fig, axes = plt.subplots(1, panels, figsize=(4.5 * panels, 3.4))
    a, b = axes[0], axes[1]
    pre = r.get("prefill", [])
    a.bar([str(p["target_tokens"]) for p in pre], [p["median_tok_s"] or 0 for p in pre], color="#4c72b0")
    a.set_title("prefill (median)")
    a.set_xlabel("prompt tokens")
    a.set_ylabel("tok/s")
    xs = list(range(len(dec)))
    labels = [f"C{d['concurrency']}" for d in dec]
    b.bar([x - 0.2 for x in xs], [d["aggregate_tok_s"] or 0 for d in dec], 0.4, label="aggregate")
    b.bar([x + 0.2 for x in xs], [d["per_stream_tok_s"] or 0 for d in dec], 0.4, label="per stream")
    b.set_xticks(xs, labels)
    b.set_title("decode")
    b.set_ylabel("tok/s")
    b.legend(fontsize=8)
    nxt = 2
    if any(tiers):
        c = axes[nxt]
        nxt += 1
        bottom = [0.0] * len(dec)
        for key, name in (("slot_hits", "slot hits"), ("slot_misses", "slot misses"), ("lane_experts", "CPU lane")):
            vals = [(t or {}).get(key) or 0.0 for t in tiers]
            c.bar(xs, vals, 0.6, bottom=bottom, label=name)
            bottom = [u + v for u, v in zip(bottom, vals)]
        c.set_xticks(xs, labels)
        c.set_title("expert picks per decode token")
        c.legend(fontsize=8)
    if floor and c1:
        d = axes[nxt]
        share = fraction_of_floor(c1, floor)
        d.bar(["C1"], [share * 100], color="#55a868")
        d.axhline(100, color="grey", linestyle="--")
        d.set_ylim(0, max(110, share * 110))
        d.set_title("C1 per-stream / floor")
        d.set_ylabel("%")
    fig.suptitle(f"{r.get('model')} ({str(r.get('created', ''))[:10]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_stream(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = r.get("timeline") or []
    fig, ax = plt.subplots(figsize=(6, 3.2))
    if tl:
        t0, total = tl[0][0], tl[-1][1] or 1
        ax.plot([t - t0 for t, _ in tl], [c / total for _, c in tl], label="delivered text")
        ax.plot([0, tl[-1][0] - t0], [0, 1], "--", color="grey", label="even delivery")
    ax.set_xlabel("seconds since first token")
    ax.set_ylabel("share of text")
    ax.set_title(f"stream delivery: {r.get('verdict')}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(
    paths: list[str],
    out: str | None = None,
    plots_dir: str | None = None,
    title: str | None = None,
    append: bool = False,
) -> str:
    """Markdown for the given result files, written to `out` (appended when `append`);
    PNG plots into plots_dir (None: no plots), linked relative to `out`."""
    if not paths:
        raise UserError("bench report: give one or more result JSON files")
    loaded = [(p, read_json(p)) for p in paths]
    floors = [r for _, r in loaded if kind_of(r) == "floor"]
    floor = floors[0] if floors else None
    md: list[str] = [f"## {title}", ""] if title else []
    sweeps = [(Path(p).stem, r) for p, r in loaded if kind_of(r) == "sweep"]
    if len(sweeps) > 1:
        md += _sweep_compare_md(sweeps)
    pdir = Path(plots_dir) if plots_dir else None
    if pdir:
        pdir.mkdir(parents=True, exist_ok=True)
    base = Path(out).parent if out else Path.cwd()
    for p, r in loaded:
        kind = kind_of(r)
        stem = Path(p).stem
        if kind == "sweep":
            md += _sweep_md(r, floor)
            if pdir:
                _plot_sweep(r, pdir / f"{stem}.png", floor)
                md += [f"![sweep {stem}]({os.path.relpath(pdir / f'{stem}.png', base)})", ""]
        elif kind == "stream-rate":
            md += _stream_md(r)
            if pdir:
                _plot_stream(r, pdir / f"{stem}.png")
                md += [f"![stream delivery {stem}]({os.path.relpath(pdir / f'{stem}.png', base)})", ""]
        elif kind == "gates":
            md += _gates_md(r)
        elif kind == "panel-score":
            md += _panel_score_md(r)
        elif kind == "panel":
            md += _panel_md(r)
        elif kind == "floor":
            md += _floor_md(r)
        else:
            raise UserError(f"{p}: unknown result kind {r.get('kind')!r}")
    text = "\n".join(md).rstrip() + "\n"
    if out:
        try:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            if append and Path(out).exists():
                with open(out, "a") as fh:
                    fh.write("\n" + text)
            else:
                Path(out).write_text(text)
        except OSError as exc:
            raise UserError(f"cannot write {out}: {exc.strerror or exc}") from exc
    return text
