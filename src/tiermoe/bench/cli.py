"""`tiermoe bench ...`: sweep, stream-rate, gates, panel make|score, floor, report.

All HTTP subcommands work against any OpenAI-compatible server (`--url`). Each writes its
result as JSON (`--out`) and prints a short human summary. Other modules join the same
`bench` group by exposing `register(bench_subparsers)` and being listed in
`BENCH_EXTRA_MODULES`; a listed module that does not exist yet is skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json

from tiermoe.errors import UserError

# The in-process and synthetic-model commands, and the developer benchmarks of benchmarks/ (a
# second package of the distribution; skipped where it is not installed).
BENCH_EXTRA_MODULES = ("tiermoe.bench.decode", "benchmarks.moe_gpu", "tiermoe.bench.tune_moe",
                       "tiermoe.bench.synthetic_qwen3", "tiermoe.bench.synthetic_glm5", "tiermoe.bench.mtp",
                       "tiermoe.bench.lane")
DEFAULT_URL = "http://127.0.0.1:8000"


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks, quality panels and acceptance gates")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")
    sub.required = True
    _add_sweep(sub)
    _add_stream_rate(sub)
    _add_gates(sub)
    _add_panel(sub)
    _add_floor(sub)
    _add_report(sub)
    for name in BENCH_EXTRA_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and (exc.name == name or name.startswith(exc.name + ".")):
                continue  # not part of this build yet
            raise
        module.register(sub)


def _server_args(p: argparse.ArgumentParser, out_help: str = "write the result JSON here") -> None:
    p.add_argument("--url", default=DEFAULT_URL, help=f"server base URL (default {DEFAULT_URL})")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None, help="bearer token, if the server wants one")
    p.add_argument("--timeout", type=float, default=900.0, help="per-request timeout in seconds")
    p.add_argument("--seed", type=int, default=None, help="seed for the random prompts")
    p.add_argument("--out", default=None, help=out_help)


def _positive(kind):
    def conv(text: str):
        try:
            value = kind(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from exc
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return value

    return conv


def _connection(args, seed: bool = True) -> dict:
    """The config fields every HTTP subcommand takes from the `_server_args` options."""
    kw = {"url": args.url, "model": args.model, "timeout": args.timeout, "api_key": args.api_key}
    if seed:
        kw["seed"] = args.seed
    return kw


def _measure(coro, out: str | None) -> dict:
    """Run one bench coroutine to its result and write that to `out` (when given). An `out` that
    cannot be written is refused first: found only at the end, it would lose the run's figures."""
    from tiermoe.bench.results import check_out, write_json

    try:
        check_out(out)
    except Exception:
        coro.close()  # never started: no "never awaited" warning
        raise
    result = asyncio.run(coro)
    write_json(result, out)
    return result


def _print_json_path(out: str | None) -> None:
    if out:
        print(f"wrote {out}")


# ---------------------------------------------------------------- sweep
def _add_sweep(sub) -> None:
    p = sub.add_parser("sweep", help="prefill and decode speed (C = 1, 2, 4) over HTTP")
    _server_args(p)
    p.add_argument("--prefill-sizes", default="8k,32k", help="prompt sizes in tokens, e.g. 8k,32k or 256,512")
    p.add_argument("--reps", type=_positive(int), default=3, help="prompts per prefill size (median)")
    p.add_argument("--concurrency", default="1,2,4", help="simultaneous decode streams per round")
    p.add_argument("--decode-reps", type=_positive(int), default=1, help="decode rounds per C (median)")
    p.add_argument("--max-tokens", type=_positive(int), default=None, help="cap decode length (default: natural end)")
    p.add_argument(
        "--long-prompt",
        type=int,
        default=None,
        help="tokens before the C1-after-long-prompt run (default: largest prefill size; 0 skips)",
    )
    p.add_argument("--prefill-endpoint", choices=("auto", "completions", "chat"), default="auto",
                   help="endpoint of the prefill measurements (auto: completions where the server has it)")
    p.add_argument("--decode-prompts", choices=("story", "random"), default="story",
                   help="what the decode streams are asked: story requests, or random words (another mix of "
                        "routed experts, to check that a speed does not depend on the prompts)")
    p.set_defaults(handler=_run_sweep)


def _run_sweep(args) -> int:
    from tiermoe.bench.results import parse_ints, parse_sizes
    from tiermoe.bench.sweep import SweepConfig, run_sweep, summary_lines

    cfg = SweepConfig(
        **_connection(args),
        prefill_sizes=parse_sizes(args.prefill_sizes, "--prefill-sizes"),
        reps=args.reps,
        concurrency=parse_ints(args.concurrency, "--concurrency"),
        decode_reps=args.decode_reps,
        max_tokens=args.max_tokens,
        long_prompt_tokens=args.long_prompt,
        prefill_endpoint=args.prefill_endpoint,
        decode_prompts=args.decode_prompts,
    )
    result = _measure(run_sweep(cfg), args.out)
    print("\n".join(summary_lines(result)))
    _print_json_path(args.out)
    return 0


# ---------------------------------------------------------------- stream-rate
def _add_stream_rate(sub) -> None:
    p = sub.add_parser("stream-rate", help="is streamed text delivered evenly? (PASS/FAIL)")
    _server_args(p)
    p.add_argument("--max-tokens", type=_positive(int), default=None, help="cap the story (default: natural end)")
    p.add_argument("--prompt-tokens", type=int, default=0, help="random text before the request (long-prompt check)")
    p.add_argument(
        "--min-tokens", type=int, default=0, help="ask the server (vLLM-style min_tokens) not to stop before N tokens"
    )
    p.add_argument("--mid-fraction", type=float, default=0.40, help="min share of text by the time midpoint")
    p.add_argument("--tail-seconds", type=_positive(float), default=1.0, help="length of the final window")
    p.add_argument("--tail-fraction", type=float, default=0.10, help="max share of text in the final window")
    p.add_argument("--bin-seconds", type=_positive(float), default=10.0, help="bin width of the delivery table")
    p.set_defaults(handler=_run_stream_rate)


def _run_stream_rate(args) -> int:
    from tiermoe.bench.stream_rate import StreamRateConfig, run_stream_rate

    cfg = StreamRateConfig(
        **_connection(args),
        max_tokens=args.max_tokens,
        prompt_tokens=args.prompt_tokens,
        min_tokens=args.min_tokens,
        mid_fraction_min=args.mid_fraction,
        tail_seconds=args.tail_seconds,
        tail_fraction_max=args.tail_fraction,
        bin_seconds=args.bin_seconds,
    )
    r = _measure(run_stream_rate(cfg), args.out)
    by_mid, tail = r.get("fraction_by_midpoint"), r.get("fraction_in_tail")
    detail = f"{by_mid:.0%} by midpoint, {tail:.0%} in last {cfg.tail_seconds:g} s" if by_mid is not None else ""
    rate = f", {r['per_stream_tok_s']:.1f} tok/s" if r.get("per_stream_tok_s") else ""
    print(f"{r['verdict']}: {r['reason']} ({detail}{rate}, {r['completion_tokens']} tokens)")
    _print_json_path(args.out)
    return 0 if r["verdict"] == "PASS" else 1


# ---------------------------------------------------------------- gates
def _add_gates(sub) -> None:
    from tiermoe.bench.gates import GATE_NAMES

    p = sub.add_parser("gates", help="the six acceptance gates: load chat reasoning tools context speed")
    _server_args(p)
    p.add_argument(
        "--context", type=_positive(int), default=None, help="context window (default: max_model_len of /v1/models)"
    )
    p.add_argument("--context-fraction", type=float, default=0.85, help="prompt size as a share of the window")
    p.add_argument(
        "--needle-depth", type=float, default=0.0, help="vault code position in the filler, 0 start .. 1 end"
    )
    p.add_argument(
        "--speed-window", type=_positive(float), default=30.0, help="seconds of stream the speed gate measures"
    )
    p.add_argument("--speed-min", type=float, default=15.0, help="tok/s the speed gate requires")
    p.add_argument("--max-tokens", type=_positive(int), default=None, help="cap every answer (default: server default)")
    p.add_argument("--load-wait", type=float, default=0.0, help="keep retrying /v1/models this many seconds")
    p.add_argument("--only", default=",".join(GATE_NAMES), help="comma-separated subset of gates to run")
    p.set_defaults(handler=_run_gates)


def _run_gates(args) -> int:
    from tiermoe.bench.gates import GATE_NAMES, GatesConfig, run_gates

    only = tuple(x.strip() for x in args.only.split(",") if x.strip())
    bad = [x for x in only if x not in GATE_NAMES]
    if bad or not only:
        raise UserError(f"--only: unknown gate(s) {bad}; choose from {', '.join(GATE_NAMES)}")
    if not 0 < args.context_fraction <= 1:
        raise UserError("--context-fraction must be in (0, 1]")
    cfg = GatesConfig(
        **_connection(args),
        context=args.context,
        context_fraction=args.context_fraction,
        needle_depth=args.needle_depth,
        speed_window_s=args.speed_window,
        speed_min_tok_s=args.speed_min,
        max_tokens=args.max_tokens,
        load_wait_s=args.load_wait,
        only=only,
    )
    r = _measure(run_gates(cfg), args.out)
    for g in r["gates"]:
        print(f"{g['verdict']:4}  {g['name']:<9} {g['reason']}")
    print(f"{r['verdict']}: {r['passed']}/{r['total']} gates passed")
    _print_json_path(args.out)
    return 0 if r["verdict"] == "PASS" else 1


# ---------------------------------------------------------------- panel
def _add_panel(sub) -> None:
    p = sub.add_parser("panel", help="quality panel: make from a reference, score another server")
    psub = p.add_subparsers(dest="panel_command", metavar="PANEL_COMMAND")
    psub.required = True
    mk = psub.add_parser("make", help="greedy completions + top-k logprobs from a reference server")
    _server_args(mk, out_help="write the panel JSON here (required)")
    mk.add_argument("--prompts", default=None, help="prompts .json/.jsonl (default: a built-in set)")
    mk.add_argument("--max-tokens", type=_positive(int), default=64, help="completion length per prompt")
    mk.add_argument("--top-logprobs", type=int, default=20, help="alternatives recorded per position")
    mk.add_argument("--concurrency", type=_positive(int), default=4, help="requests in flight at once")
    mk.add_argument("--no-token-ids", action="store_true", help="do not record token ids (return_tokens_as_token_ids)")
    mk.set_defaults(handler=_run_panel_make)
    sc = psub.add_parser("score", help="teacher-forced top-1 agreement, KL and greedy match vs a panel")
    _server_args(sc)
    sc.add_argument("--panel", required=True, help="panel JSON from 'bench panel make'")
    sc.add_argument(
        "--mode",
        choices=("auto", "token-ids", "echo", "per-position"),
        default="auto",
        help="how teacher forcing is done (auto: token-ids, then echo, then per-position)",
    )
    sc.add_argument("--concurrency", type=_positive(int), default=8, help="parallel requests in per-position mode")
    sc.add_argument("--no-greedy", action="store_true", help="skip the free-running greedy comparison")
    sc.set_defaults(handler=_run_panel_score)


def _run_panel_make(args) -> int:
    from tiermoe.bench.panel import PanelMakeConfig, make_panel

    if not args.out:
        raise UserError("bench panel make: --out is required")
    if not 1 <= args.top_logprobs <= 20:
        raise UserError("--top-logprobs must be in 1..20")
    cfg = PanelMakeConfig(
        **_connection(args, seed=False),
        prompts_file=args.prompts,
        max_tokens=args.max_tokens,
        top_logprobs=args.top_logprobs,
        concurrency=args.concurrency,
        token_ids=not args.no_token_ids,
    )
    panel = _measure(make_panel(cfg), args.out)
    n = sum(len(it["tokens"]) for it in panel["items"])
    ids = "with token ids" if panel["has_token_ids"] else "text only"
    print(
        f"panel: {len(panel['items'])} prompts, {n} positions, top-{panel['top_logprobs_returned']} ({ids}) "
        f"from {panel['model']}"
    )
    _print_json_path(args.out)
    return 0


def _run_panel_score(args) -> int:
    from tiermoe.bench.panel import validate_panel
    from tiermoe.bench.panel_score import PanelScoreConfig, score_panel
    from tiermoe.bench.results import read_json

    panel = read_json(args.panel)
    validate_panel(panel, args.panel)
    cfg = PanelScoreConfig(
        **_connection(args, seed=False),
        panel=panel,
        mode=args.mode,
        concurrency=args.concurrency,
        greedy=not args.no_greedy,
    )
    r = _measure(score_panel(cfg), args.out)

    def f(x, nd):
        return "-" if x is None else f"{x:.{nd}f}"

    print(
        f"top-1 agreement {f(r['top1_agreement'], 4)}, mean KL {f(r['mean_kl'], 5)}, "
        f"greedy match {f(r['greedy_match_fraction'], 3)} (exact {f(r['greedy_exact_fraction'], 3)}) "
        f"over {r['positions']} positions, teacher forcing: {', '.join(r['teacher_forcing'])}"
    )
    if r["positions_misaligned"]:
        print(f"{r['positions_misaligned']} positions left out: the text re-tokenized differently from the reference")
    _print_json_path(args.out)
    return 0


# ---------------------------------------------------------------- floor
def _add_floor(sub) -> None:
    from tiermoe.store.floor import Bandwidths

    d = Bandwidths()
    p = sub.add_parser("floor", help="decode ms/token floor of a tier plan from bandwidths")
    p.add_argument("--bytes-per-expert", required=True, help="e.g. 13.4MB, 9.44MB, 9MiB")
    p.add_argument("--top-k", type=_positive(int), required=True, help="routed experts per token per layer")
    p.add_argument("--moe-layers", type=_positive(int), required=True, help="MoE layers of the model")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--hits", help="expert reads per token per tier, e.g. gpu=120,ram=175,disk=23")
    g.add_argument("--fractions", help="share of top_k x layers reads per tier, e.g. gpu=0.385,ram=0.615")
    p.add_argument("--hbm-gbs", type=_positive(float), default=d.hbm_gbs, help="GPU memory GB/s (slot hits)")
    p.add_argument("--pcie-gbs", type=_positive(float), default=d.pcie_gbs,
                   help="host-to-GPU GB/s (host hits, disk reads)")
    p.add_argument("--cpu-gbs", type=_positive(float), default=d.cpu_gbs, help="CPU-lane expert-weight GB/s")
    p.add_argument("--disk-gbs", type=_positive(float), default=d.disk_gbs, help="disk read GB/s (O_DIRECT)")
    p.add_argument("--host-gbs", type=_positive(float), default=None, help="shared host-RAM read GB/s (optional lane)")
    p.add_argument("--non-moe-ms", type=float, default=0.0, help="measured non-MoE ms per token")
    p.add_argument("--balance-host", action="store_true", help="split ram+cpu reads optimally between PCIe and CPU")
    p.add_argument(
        "--measured-tok-s", type=_positive(float), default=None, help="state a measured rate as a share of the floor"
    )
    p.add_argument("--out", default=None, help="write the result JSON here")
    p.set_defaults(handler=_run_floor)


def _run_floor(args) -> int:
    from tiermoe.store.floor import Bandwidths, decode_floor, parse_bytes, parse_tier_map, table_lines
    from tiermoe.bench.results import envelope, write_json

    floor = decode_floor(
        parse_bytes(args.bytes_per_expert),
        args.top_k,
        args.moe_layers,
        hits=parse_tier_map(args.hits, "--hits") if args.hits else None,
        fractions=parse_tier_map(args.fractions, "--fractions") if args.fractions else None,
        bandwidths=Bandwidths(args.hbm_gbs, args.pcie_gbs, args.cpu_gbs, args.disk_gbs, args.host_gbs),
        non_moe_ms=args.non_moe_ms,
        balance_host=args.balance_host,
    )
    if args.measured_tok_s:
        floor["measured_tok_s"] = args.measured_tok_s
        floor["fraction_of_floor"] = args.measured_tok_s / floor["tok_s"]
    result = envelope("floor", **floor)
    write_json(result, args.out)
    print("\n".join(table_lines(floor)))
    if args.measured_tok_s:
        print(f"measured {args.measured_tok_s:g} tok/s = {floor['fraction_of_floor']:.0%} of the floor")
    if not args.out:
        print(json.dumps(floor, indent=2))
    _print_json_path(args.out)
    return 0


# ---------------------------------------------------------------- report
def _add_report(sub) -> None:
    p = sub.add_parser("report", help="render result JSON files as markdown tables and PNG plots")
    p.add_argument("results", nargs="+", help="result JSON files from the other bench commands")
    p.add_argument("--out", default=None, help="markdown file (default: print to stdout)")
    p.add_argument("--append", action="store_true", help="append to --out instead of replacing it")
    p.add_argument("--plots-dir", default=None, help="write PNG plots here (default: no plots)")
    p.add_argument("--title", default=None, help="a '## title' line above the tables")
    p.set_defaults(handler=_run_report)


def _run_report(args) -> int:
    from tiermoe.bench.report import render

    text = render(args.results, out=args.out, plots_dir=args.plots_dir, title=args.title, append=args.append)
    if args.out:
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0
