"""`tiermoe bench moe-gpu`: the product's GPU expert path on a synthetic GLM-5.3-Flash-shaped stack.

Builds L MoE layers of GLM-5.3-Flash's shape (hidden 4096, 288 routed experts of intermediate
2048, top-8, one shared expert) with random int4 records, every routed expert in pinned host
RAM and GPU slots for a fraction of the experts per layer (default: the 24 GB-card case),
routing sampled from the real model's per-layer expert popularity. The routed experts run on
the engine's own device cache (moe/device_cache.py through expert_stack.py), so what is
measured is what serves. In one run:

  - bandwidths: HBM copy, pinned host -> GPU copy (copy engine), zero-copy read by a kernel;
  - exactness: final hidden states bit-identical for GPU budgets of 100 %, 10 % and 0 %;
  - decode at batch 1, 2, 4: whole steps (cache kernel + gather + fused MoE per layer)
    captured as one CUDA graph; time per step / token / layer, hit rates, bytes per lane;
  - prefill of large chunks with the device cache's staging of non-resident experts;
  - the hardware floor of the same work from the measured bandwidths and hit rates;
  - the simplest alternative (static top-k residency, each layer's missing experts copied on
    demand with plain torch copies, plain-torch compute, no graph) and the ratio to it.

Results go to --out as JSON and a summary to stdout. A developer's benchmark of the kernels
and the cache; users measure a served model with `bench sweep`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

from tiermoe.bench.real_routing import REAL_STATS

GLM = dict(hidden=4096, inter=2048, experts=288, top_k=8, group=128)
TINY = dict(hidden=64, inter=32, experts=16, top_k=4, group=32)
TINY_INT3 = dict(TINY, hidden=128, inter=64)  # int3 block tiles take K >= 64 (four phase dots of K >= 16)


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("moe-gpu", help="GPU expert path on a synthetic GLM-5.3-Flash MoE stack")
    add_arguments(p)
    p.set_defaults(handler=_handler)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=0, help="MoE layers (0: as many as --host-gib allows, >= 12)")
    p.add_argument("--max-layers", type=int, default=24, help="upper bound for --layers 0")
    p.add_argument("--host-gib", type=float, default=72.0, help="pinned host RAM for expert records, GiB")
    p.add_argument("--budget", type=float, default=0.11, help="GPU expert slots as a fraction of the experts")
    p.add_argument("--kind", choices=("int4", "int3", "bf16"), default="int4", help="record kind")
    p.add_argument("--batches", default="1,2,4", help="decode batch sizes")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps per batch size")
    p.add_argument("--warmup", type=int, default=24, help="untimed decode steps before timing (cache settles)")
    p.add_argument("--baseline-steps", type=int, default=12, help="timed decode steps of the baseline")
    p.add_argument("--prefill-tokens", type=int, default=8192, help="tokens per prefill chunk (0 skips prefill)")
    p.add_argument("--prefill-reps", type=int, default=3, help="timed prefill chunks (median)")
    p.add_argument("--exact-layers", type=int, default=6, help="layers of the exactness check (0 skips)")
    p.add_argument("--exact-steps", type=int, default=12, help="decode steps of the exactness check")
    p.add_argument("--no-baseline", action="store_true", help="skip the plain-torch baseline")
    p.add_argument("--stage-misses", action=argparse.BooleanOptionalAction, default=True,
                   help="gather misses that are not admitted into scratch rows (default) instead of reading "
                        "them in place")
    p.add_argument("--tune", action="store_true", help="tune launch configs first (written next to --out)")
    p.add_argument("--stats", default=str(REAL_STATS), help="per-layer expert pick counts (JSON)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and routing")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (runs on CPU through the Triton interpreter)")
    p.add_argument("--out", default=None, help="write the result JSON here")


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (python -m benchmarks.moe_gpu ...), same flags as the subcommand."""
    from tiermoe.errors import UserError

    p = argparse.ArgumentParser(prog="tiermoe bench moe-gpu", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return _handler(args)
    except UserError as exc:  # the CLI turns UserError into one line; do the same here
        print(f"tiermoe: error: {exc}", file=sys.stderr)
        return 2


def _handler(args) -> int:
    from tiermoe.errors import UserError

    try:
        batches = [int(b) for b in str(args.batches).split(",") if b.strip()]
    except ValueError:
        raise UserError(f"--batches: expected comma-separated integers, got {args.batches!r}") from None
    if not batches or min(batches) < 1 or max(batches) > 16:
        raise UserError("--batches: sizes must be between 1 and 16")
    if not 0.0 <= args.budget <= 1.0:
        raise UserError("--budget must be a fraction between 0 and 1")
    if not Path(args.stats).is_file():
        raise UserError(f"--stats: no such file {args.stats}")
    import torch

    from benchmarks.moe_gpu_floors import summary

    if not torch.cuda.is_available():
        if not args.tiny:
            raise UserError("moe-gpu needs a CUDA GPU (use --tiny for a CPU smoke run through the Triton interpreter)")
        from tiermoe.env import use_triton_interpreter

        use_triton_interpreter()  # before any kernel module is imported: on a CPU only the interpreter runs them
    result = run(args, batches)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(summary(result))
    if args.out:
        print(f"wrote {args.out}")
    return 0


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def layer_count(args, layer_bytes: int) -> int:
    if args.layers:
        return args.layers
    fit = int(args.host_gib * 2**30 // layer_bytes)
    return max(12, min(args.max_layers, fit)) if not args.tiny else 2


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def wall(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ============================================================================ measurement
# (torch and the kernels are imported lazily: registering the subcommand stays cheap)


def run(args, batches: list[int]) -> dict:
    import torch

    from benchmarks.expert_stack import ExpertStack, pin_host
    from benchmarks.moe_gpu_floors import add_floors
    from benchmarks.naive_offload import NaiveExperts
    from tiermoe.bench.records import random_records
    from tiermoe.kernels.layout import expert_layout
    from tiermoe.kernels.triton import fused_moe as fm

    dims = (TINY_INT3 if args.kind == "int3" else TINY) if args.tiny else GLM
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = dev.type == "cuda"
    lay = expert_layout(args.kind, dims["hidden"], dims["inter"], dims["group"])
    e_n, k, r, wb = dims["experts"], dims["top_k"], lay.length, lay.weight_bytes
    n_layers = layer_count(args, e_n * r)
    slots = int(round(args.budget * e_n))
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    res: dict = {"date": now_utc(), "argv": sys.argv[1:],
                 "args": {k_: v for k_, v in vars(args).items() if k_ != "handler"}}
    res["env"] = _env(torch, dev)
    res["model"] = dict(dims, layers=n_layers, shared_experts=1, kind=args.kind, record_bytes=r, weight_bytes=wb,
                        slots_per_layer=slots, budget=slots / e_n)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    log(f"building {n_layers} layers x {e_n} experts in pinned host RAM ({n_layers * e_n * r / 2**30:.1f} GiB)")
    pools, shared = [], []
    for _ in range(n_layers):  # random records made on the device, then parked in pinned host RAM
        pool = pin_host(e_n * r).view(e_n, r)  # [E, R]
        pool.copy_(random_records(lay, e_n, dev, gen))
        pools.append(pool)
        shared.append(random_records(lay, 1, dev, gen)[0])  # [R] on the device
    res["build_s"] = round(time.perf_counter() - t0, 1)
    pop = load_popularity(args.stats, n_layers, e_n).to(dev)  # [L, E]
    top = torch.argsort(pop, dim=1, descending=True).tolist()  # most popular first
    if gpu:
        log("bandwidths")
        from benchmarks.probe import measure_bandwidth

        res["bandwidth"] = measure_bandwidth(pools[0], r)
        shown = {k_: v for k_, v in res["bandwidth"].items() if k_ != "gather_sweep_GBps"}
        log(json.dumps({k_: round(v, 1) if isinstance(v, float) else v for k_, v in shown.items()}))
    # what the package's launch table gives (the stack runs with it unless --tune replaces it)
    cfgs = {"decode": fm.get_config(lay, 1, dev), "prefill": fm.get_config(lay, max(args.prefill_tokens, 17), dev)}
    tuned = False
    if args.tune and gpu:
        from tiermoe.kernels.triton import tuning

        log("tuning launch configurations")
        recs = pools[0].to(dev)
        cfgs, res["tuning"] = tuning.tune(lay, recs, pop[0], k, args.prefill_tokens, gen)
        del recs
        torch.cuda.empty_cache()
        cfg_path = Path(args.out).with_name("moe_configs.json") if args.out else Path("moe_configs.json")
        tuning.save_configs(cfg_path, torch.cuda.get_device_name(dev), lay, cfgs)
        res["tuning"]["written"] = str(cfg_path)
        tuned = True
    res["configs"] = cfgs
    rates = pop * k  # [L, E] expected picks per token: warm start of the slots and the admission filter
    gather = res.get("bandwidth", {}).get("gather")

    def new_stack(n_l: int, s: int, stage: bool = bool(args.stage_misses), phase: str = "decode") -> ExpertStack:
        """A stack of n_l layers with s slots each; a tuned run gives it the phase's tuned launch
        configuration (the engine takes one per backend; None: the package's table by tokens)."""
        return ExpertStack(lay, pools[:n_l], shared[:n_l], s, k, max(batches), dev, rates[:n_l], gather=gather,
                           stage_misses=stage, config=cfgs[phase] if tuned else None)

    if args.exact_layers:
        log("exactness: budgets 100 / 10 / 0 %")
        res["exactness"] = exactness(torch, new_stack, pop, args, lay, k, gen, gpu, batches, pools, shared)
    stack = new_stack(n_layers, slots)
    res["model"]["stage_rows"] = stack.experts.stage_rows
    res["decode"] = {}
    for t in batches:
        log(f"decode T={t}")
        d = res["decode"][str(t)] = decode_bench(torch, stack, pop, t, args.warmup, args.steps, k, gen, gpu)
        log(f"  {d['step_ms']:.2f} ms/step, hit rate {d['hit_rate']:.3f}")
    if not args.no_baseline:
        base = NaiveExperts(lay, pools, shared, [t_[:slots] for t_ in top], k, dev)
        for t in batches:
            log(f"baseline decode T={t}")
            d = res["decode"][str(t)]
            d["baseline"] = baseline_decode(torch, base, pop, t, args.baseline_steps, k, gen, gpu, "torch")
            d["baseline_copy_triton"] = baseline_decode(torch, base, pop, t, args.baseline_steps, k, gen, gpu,
                                                        "triton")
        del base
    if args.prefill_tokens:
        log(f"prefill {args.prefill_tokens} tokens")
        if tuned:  # the tuned prefill configuration: a stack of its own, warm-started like the first
            del stack
            torch.cuda.empty_cache()
            stack = new_stack(n_layers, slots, phase="prefill")
        res["prefill"] = prefill_bench(torch, stack, pop, args, k, gen, gpu, lay, pools, shared, top, slots)
    add_floors(res, lay)
    res["total_s"] = round(time.perf_counter() - t0, 1)
    return res


def _env(torch, dev) -> dict:
    import platform

    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "host": platform.node()}
    if dev.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(dev)
        env["gpu_mem_gib"] = round(torch.cuda.get_device_properties(dev).total_memory / 2**30, 1)
    return env


def load_popularity(path: str, layers: int, experts: int):
    """[L, E] pick probabilities: L rows spread evenly over the real model's MoE layers."""
    import torch

    rows = list(json.loads(Path(path).read_text()).values())
    idx = [round(i * (len(rows) - 1) / max(layers - 1, 1)) for i in range(layers)]
    counts = torch.tensor([rows[i][:experts] for i in idx], dtype=torch.float64) + 0.01  # never-picked stay rare
    return (counts / counts.sum(1, keepdim=True)).float()


def sample_routing(torch, pop, tokens: int, k: int, gen):
    """Routed picks of `tokens` tokens in every layer: ids int32 [L, N, K], weights fp32 [L, N, K]."""
    n_l, e_n = pop.shape
    ids = torch.stack([torch.multinomial(pop[l].expand(tokens, e_n).contiguous(), k, False, generator=gen)
                       for l in range(n_l)])
    w = torch.softmax(torch.randn(n_l, tokens, k, device=pop.device, generator=gen), -1)
    return ids.to(torch.int32), w.float()


def decode_routing(torch, pop, steps: int, t: int, k: int, gen):
    """Per-step routing ids / weights [steps, L, T, K] for decode."""
    ids, w = sample_routing(torch, pop, steps * t, k, gen)
    n_l = pop.shape[0]

    def per_step(a):
        return a.view(n_l, steps, t, k).permute(1, 0, 2, 3).contiguous()

    return per_step(ids), per_step(w)


def make_stepper(torch, stack, ids, w, h0, gpu: bool):
    """step(i) runs decode step i (graph replay on GPU) and returns the step's output."""
    if gpu:
        g, sh, sids, sw, sout = stack.capture_decode(ids[0], w[0], h0)

        def step(i):
            sids.copy_(ids[i])
            sw.copy_(w[i])
            g.replay()
            sh.copy_(sout)
            return sout

        return step
    state = {"h": h0.clone()}

    def step_eager(i):
        state["h"] = stack.decode_step(state["h"], ids[i], w[i])
        return state["h"]

    return step_eager


def _timed(gpu: bool, fn) -> float:
    """Seconds for fn(), with device events on GPU."""
    if not gpu:
        return wall(fn)
    from benchmarks.probe import timed

    return timed(fn)


def decode_bench(torch, stack, pop, t, warmup, steps, k, gen, gpu) -> dict:
    ids, w = decode_routing(torch, pop, warmup + steps, t, k, gen)
    h0 = torch.randn(t, stack.layout.hidden, device=pop.device, generator=gen).to(torch.bfloat16)
    step = make_stepper(torch, stack, ids, w, h0, gpu)
    for i in range(warmup):
        step(i)
    s0 = stack.stats().clone()
    sec = _timed(gpu, lambda: [step(i) for i in range(warmup, warmup + steps)])
    d = (stack.stats() - s0).sum(0).tolist()  # lookups, hits, misses, admitted over all layers
    n_l = len(stack.caches)
    prof = _profile(stack, ids[warmup], w[warmup], h0) if gpu and t == 1 else None
    out = {"tokens": t, "steps": steps, "step_ms": 1e3 * sec / steps, "per_token_ms": 1e3 * sec / steps / t,
           "per_layer_ms": 1e3 * sec / steps / n_l, "tok_s": steps * t / sec}
    out.update(per_step_counts(d, steps, n_l))
    if prof:
        out["kernels_us_per_step"] = prof
    return out


def _profile(stack, ids, w, h0) -> dict:
    """GPU microseconds per kernel name for one eager decode step (diagnostic)."""
    from benchmarks.probe import kernel_times

    return kernel_times(lambda: stack.decode_step(h0, ids, w))


def per_step_counts(d, steps, n_l) -> dict:
    lookups, hits, misses, admitted = (x / steps for x in d)
    return {"unique_per_layer": lookups / n_l, "hits_per_step": hits, "misses_per_step": misses,
            "admitted_per_step": admitted, "hit_rate": hits / lookups if lookups else 0.0}


def exactness(torch, new_stack, pop, args, lay, k, gen, gpu, batches, pools, shared) -> dict:
    """Decode outputs bit-identical for budgets 100 %, 10 %, 0 % (same routing, same input).

    The 0 % run also reads its misses in place (no staging rows: nothing of the experts on the
    GPU), the others stage them as --stage-misses says; the bytes read are the same either way.
    """
    from benchmarks.naive_offload import NaiveExperts

    n_l, e_n = min(args.exact_layers, pop.shape[0]), pop.shape[1]
    out = {"layers": n_l, "steps": args.exact_steps, "budgets": [1.0, 0.10, 0.0], "batches": {}}
    for t in sorted({1, max(batches)}):
        ids, w = decode_routing(torch, pop[:n_l], args.exact_steps, t, k, gen)
        h0 = torch.randn(t, lay.hidden, device=pop.device, generator=gen).to(torch.bfloat16)
        runs, timing = [], {}
        for b in out["budgets"]:
            stack = new_stack(n_l, int(round(b * e_n)), stage=bool(args.stage_misses) and b > 0)
            step = make_stepper(torch, stack, ids, w, h0, gpu)
            runs.append(torch.stack([step(i).clone() for i in range(args.exact_steps)]))
            if gpu and b == 1.0:  # all experts in HBM: the kernels' own speed against the HBM floor
                if t == 1:
                    timing["kernels_us_per_step"] = _profile(stack, ids[0], w[0], h0)
                s0 = stack.stats().clone()
                sec = _timed(gpu, lambda: [step(i % args.exact_steps) for i in range(20)])
                d = (stack.stats() - s0).sum(0).tolist()
                timing.update({"per_layer_ms_all_resident": 1e3 * sec / 20 / n_l, "unique_per_layer": d[0] / 20 / n_l})
            del stack, step
            if gpu:
                torch.cuda.empty_cache()
        same = [bool(torch.equal(runs[0], r)) for r in runs[1:]]
        if t == 1:  # the whole path against the plain-torch twins (tolerance: fp32 summation order)
            naive = NaiveExperts(lay, pools[:n_l], shared[:n_l], [[] for _ in range(n_l)], k, pop.device)
            hh, errs = h0.clone(), []
            for i in range(min(2, args.exact_steps)):
                hh = naive.forward(hh, ids[i], w[i])
                errs.append(((runs[0][i].float() - hh.float()).norm() / hh.float().norm()).item())
                hh = runs[0][i].clone()  # continue from the kernel's state: per-step error, not drift
            timing["twin_rel_err"] = max(errs)
            del naive
        out["batches"][str(t)] = {"bit_identical_10pct": same[0], "bit_identical_0pct": same[1],
                                  "finite": bool(torch.isfinite(runs[0].float()).all()), **timing}
    out["all_bit_identical"] = all(v["bit_identical_10pct"] and v["bit_identical_0pct"]
                                   for v in out["batches"].values())
    return out


def prefill_bench(torch, stack, pop, args, k, gen, gpu, lay, pools, shared, top, slots) -> dict:
    from benchmarks.naive_offload import NaiveExperts

    n = args.prefill_tokens
    ids, w = sample_routing(torch, pop, n, k, gen)
    h0 = torch.randn(n, lay.hidden, device=pop.device, generator=gen).to(torch.bfloat16)
    stack.prefill(h0, ids, w)  # warm-up: compiles the prefill configs
    times = [_timed(gpu, lambda: stack.prefill(h0, ids, w)) for _ in range(max(1, args.prefill_reps))]
    used = torch.zeros(pop.shape[0], pop.shape[1], dtype=torch.bool, device=pop.device)  # [L, E]
    used.scatter_(1, ids.reshape(pop.shape[0], -1).long(), True)
    resident = torch.stack([c.expert_slot >= 0 for c in stack.caches])  # [L, E]
    out = {"tokens": n, "reps": len(times), "chunk_ms": 1e3 * median(times), "tok_s": n / median(times),
           "used_experts_per_layer": used.sum().item() / pop.shape[0],
           "staged_per_layer": (used & ~resident).sum().item() / pop.shape[0],
           "resident_used_per_layer": (used & resident).sum().item() / pop.shape[0]}
    if not args.no_baseline:
        base = NaiveExperts(lay, pools, shared, [t_[:slots] for t_ in top], k, pop.device)
        for name, compute in (("baseline", "torch"), ("baseline_copy_triton", "triton")):
            base.compute = compute
            sec = _timed(gpu, lambda: base.forward(h0, ids, w))
            out[name] = {"chunk_ms": 1e3 * sec, "tok_s": n / sec}
    return out


def baseline_decode(torch, base, pop, t, steps, k, gen, gpu, compute) -> dict:
    """The naive path (blocking copies per layer, no cache, no graph) on the same workload."""
    base.compute = compute
    ids, w = decode_routing(torch, pop, steps + 2, t, k, gen)
    state = {"h": torch.randn(t, base.layout.hidden, device=pop.device, generator=gen).to(torch.bfloat16)}

    def step(i):
        state["h"] = base.forward(state["h"], ids[i], w[i])

    for i in range(2):
        step(i)
    c0 = base.copied
    sec = _timed(gpu, lambda: [step(i) for i in range(2, 2 + steps)])
    return {"compute": compute, "steps": steps, "step_ms": 1e3 * sec / steps, "per_token_ms": 1e3 * sec / steps / t,
            "tok_s": steps * t / sec, "copied_per_step": (base.copied - c0) / steps}


if __name__ == "__main__":
    sys.exit(main())
