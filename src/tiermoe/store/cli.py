"""Store subcommands: pack, verify, plan, sim."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tiermoe.config import DEFAULTS
from tiermoe.errors import StoreError, UserError
from tiermoe.store.pack_checks import DEFAULT_HOT_SHARE


def _pack(args: argparse.Namespace) -> int:
    _pack_prechecks(args)
    if str(args.src).endswith(".gguf"):
        return _pack_gguf(args)
    return _pack_checkpoint(args)


def _pack_prechecks(args: argparse.Namespace) -> None:
    """What can be refused in a second, before torch is imported or a GGUF file converted: a
    --group-size that does not divide the shapes, or no group size that would, or int3 shapes
    that are not multiples of 8 (from config.json or the GGUF header), an OUT that holds other
    files, an OUT whose store a running process is reading."""
    from tiermoe.store.lock import LOCK_NAME, StoreLock
    from tiermoe.store.pack_checks import INT_QUANTS, check_target, choose_group_size, source_shapes

    if args.shard_size_gb is not None and not 0 < args.shard_size_gb < float("inf"):
        raise UserError(f"--shard-size-gb must be a finite number > 0, got {args.shard_size_gb}")
    if args.quant in INT_QUANTS:
        shapes = source_shapes(args.src)
        if shapes is not None:
            choose_group_size(*shapes, args.group_size, args.quant)
    elif args.group_size is not None:
        print(f"note: --group-size applies to int8/int4/int3 only; {args.quant} ignores it", file=sys.stderr)
        args.group_size = None
    if args.cold_quant is not None:
        from tiermoe.store.pack_checks import check_cold_args

        if args.hot_share is None:
            args.hot_share = DEFAULT_HOT_SHARE
        check_cold_args(args.quant, args.cold_quant, args.expert_stats, args.hot_share)
        shapes = source_shapes(args.src) if args.cold_quant in INT_QUANTS else None
        if shapes is not None:
            choose_group_size(*shapes, args.cold_group_size, args.cold_quant, "--cold-group-size")
    elif args.expert_stats is not None or args.cold_group_size is not None or args.hot_share is not None:
        raise UserError("--expert-stats, --hot-share and --cold-group-size choose and shape the cold experts: "
                        "give --cold-quant too")
    check_target(args.out)
    if (Path(args.out) / LOCK_NAME).is_file():
        StoreLock.exclusive(args.out).release()


def _pack_checkpoint(args: argparse.Namespace, source: str | None = None) -> int:
    from tiermoe.store.pack import pack

    res = pack(args.src, args.out, quant=args.quant, group_size=args.group_size,
               shard_bytes=int(args.shard_size_gb * 1e9), direct_io=not args.no_direct_io, progress=not args.quiet,
               log=lambda s: print(s, file=sys.stderr), source=source, cold_quant=args.cold_quant,
               cold_group_size=args.cold_group_size, expert_stats=args.expert_stats,
               hot_share=DEFAULT_HOT_SHARE if args.hot_share is None else args.hot_share)
    for note in res.notes:
        print(f"note: {note}", file=sys.stderr)
    resumed = res.records - res.written
    kind = args.quant if res.group_size is None else f"{args.quant}, group size {res.group_size}"
    if args.cold_quant is not None:
        hot, cold = res.layout_counts
        cold_kind = args.cold_quant if res.cold_group_size is None else f"{args.cold_quant} G{res.cold_group_size}"
        kind += f"; {hot} hot experts, {cold} cold ones {cold_kind}"
    print(f"packed {res.records} expert records into {res.out} ({kind}); "
          f"{res.written} written, {resumed} resumed, all read back and checksummed")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from tiermoe.store.verify import open_manifest, verify_dense, verify_store

    def on_bad(rec, got) -> None:
        print(f"BAD layer {rec.layer} expert {rec.expert} offset {rec.offset} length {rec.length}: "
              f"sha256 {got[:16]}... expected {rec.sha256[:16]}...")

    if args.threads < 1:
        raise UserError("--threads must be at least 1")
    m = open_manifest(args.store)
    shards, bad_shards = verify_dense(m, on_bad=lambda name, why: print(f"BAD dense shard {name}: {why}"))
    n, bad = verify_store(args.store, direct_io=not args.no_direct_io, threads=args.threads,
                          progress=not args.quiet, on_bad=on_bad)
    if bad or bad_shards:
        print(f"{args.store}: {len(bad)} of {n} expert records and {len(bad_shards)} of {shards} dense shards are "
              "missing or corrupt", file=sys.stderr)
        return 1
    print(f"ok: {n} records and {shards} dense shard{'s' if shards != 1 else ''} verified")
    return 0


def _plan_manifest(model: str, quant: str, group_size: int | None):
    """A store's manifest, or a manifest-shaped description of an unpacked checkpoint."""
    from tiermoe.store.pack_checks import INT_QUANTS, choose_group_size, incomplete_store
    from tiermoe.store.records import FORMAT_VERSION, MANIFEST_NAME, Manifest, RecordLayout, load_manifest

    root = Path(model)
    if (root / MANIFEST_NAME).is_file():
        return load_manifest(root)
    problem = incomplete_store(root)
    if problem:
        raise UserError(problem)
    if not (root / "config.json").is_file():
        raise UserError(f"{root}: neither a packed store (manifest.json) nor a checkpoint (config.json)")
    from tiermoe.store.catalog import Checkpoint

    ck = Checkpoint(root)  # headers only
    if quant in INT_QUANTS:
        group_size = choose_group_size(ck.hidden, ck.intermediate, group_size, quant)
    layout = RecordLayout.build(quant, ck.hidden, ck.intermediate, group_size)
    keys = ck.expert_keys()
    data = {
        "format_version": FORMAT_VERSION, "model_config": ck.config, "dtype": "bfloat16",
        "dense_bytes": ck.dense_nbytes(),
        "moe_layers": ck.layers, "experts_per_layer": {str(k): v for k, v in ck.experts_per_layer.items()},
        "layouts": [layout.to_json()],
        "records": [{"layer": L, "expert": e, "offset": i * layout.length, "length": layout.length, "sha256": ""}
                    for i, (L, e) in enumerate(keys)],
    }
    return Manifest(data, root)


def _plan(args: argparse.Namespace) -> int:
    if args.device and args.device != "cpu" and not args.device.startswith("cuda"):  # as generate's check
        raise UserError(f"--device: unknown device '{args.device}' (use cpu or cuda)")
    if args.cpu_threads is not None and args.cpu_threads < 1:
        raise UserError("--cpu-threads must be at least 1")
    if args.max_num_seqs < 1:
        raise UserError("--max-num-seqs must be at least 1")
    if args.tensor_parallel_size < 1:
        raise UserError(f"--tensor-parallel-size {args.tensor_parallel_size}: must be >= 1")
    print(plan_table(args.model, device=args.device, gpu_expert_gb=args.gpu_expert_gb,
                     host_expert_gb=args.host_expert_gb, stats=args.stats, cpu_threads=args.cpu_threads,
                     max_num_seqs=args.max_num_seqs, disk_gbs=args.disk_gbs, quant=args.quant,
                     group_size=args.group_size, ranks=args.tensor_parallel_size))
    return 0


def plan_table(model: str, *, device: str | None = None, gpu_expert_gb: float | None = None,
               host_expert_gb: float | None = None, stats: str | None = None, cpu_threads: int | None = None,
               max_num_seqs: int = DEFAULTS.max_num_seqs, disk_gbs: float | None = None, quant: str = "bf16",
               group_size: int | None = None, ranks: int = 1) -> str:
    """`tiermoe plan`'s table for a store (or checkpoint) on this machine (also `tiermoe doctor --store`):
    with disk-only experts and no `disk_gbs`, the store's own experts.bin is read to measure the disk."""
    import torch

    from tiermoe.store.planner import build_plan

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    m = _plan_manifest(model, quant, group_size)
    kw = dict(device=device, gpu_expert_gb=gpu_expert_gb, host_expert_gb=host_expert_gb, stats_file=stats,
              cpu_threads=cpu_threads, max_num_seqs=max_num_seqs, ranks=ranks)
    plan = build_plan(m, **kw, disk_gbs=disk_gbs)
    if disk_gbs is None and plan.n_disk:  # auto: the disk's rate matters, so measure it on the store itself
        gbs, note = _measure_disk(m)
        if gbs is not None:
            plan = build_plan(m, **kw, disk_gbs=gbs)
        plan.notes.append(note)
    return plan.table()


def _disk_gbs(text: str) -> float | None:
    """--disk-gbs: "auto" (None) or a rate in GB/s above 0."""
    if text.strip().lower() == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not auto or a rate in GB/s above 0")
    return value


def _measure_disk(m) -> tuple[float | None, str]:
    """`plan --disk-gbs auto` with disk-only experts: the read rate of the store's own experts.bin
    (read only; a checkpoint is not packed yet, so its disk rate is assumed)."""
    from tiermoe.store.disk import measure_read_gbs
    from tiermoe.store.floor import Bandwidths
    from tiermoe.store.planner import fmt_bytes

    path = m.experts_path
    if not path.is_file() or not any(r.sha256 for r in m.records[:1]):
        return None, f"disk: {Bandwidths.disk_gbs} GB/s assumed (a checkpoint: `plan` measures a packed store's disk)"
    try:  # a bad disk or file is reported in the note; the plan is still printed
        gbs, nbytes, mode = measure_read_gbs(path, m.records)
    except OSError as exc:
        return None, f"disk: not measured ({exc.strerror or exc}); {Bandwidths.disk_gbs} GB/s assumed"
    except StoreError as exc:
        return None, f"disk: not measured ({exc}); {Bandwidths.disk_gbs} GB/s assumed"
    return gbs, f"disk: {gbs:.2f} GB/s measured now ({mode} reads of {fmt_bytes(nbytes)} of {path})"


def _sim(args: argparse.Namespace) -> int:
    from tiermoe.store.sim import SIM_POLICIES, format_results, simulate

    policies = list(SIM_POLICIES) if args.policy == "all" else [p.strip() for p in args.policy.split(",")]
    results = simulate(args.stats, slots=args.slots, policies=policies, tokens=args.tokens, seed=args.seed,
                       host_experts=args.host_experts, top_k=args.top_k, warmup=args.warmup,
                       warm_start=not args.no_warm_start, static_hot=args.static_hot, trace_file=args.trace,
                       ram_rules=tuple(r.strip() for r in args.ram_rule.split(",")), reserve=args.reserve,
                       lost_reserve=args.lost_reserve)
    print(format_results(results, slots=args.slots, host_experts=args.host_experts, picks=results[0].picks))
    return 0


# Mirrors store.records.QUANT_KINDS; spelled out so building the CLI parser imports no torch
# (a test checks the two agree).
QUANT_CHOICES = ("bf16", "fp16", "fp32", "int8", "int4", "int3")


def _pack_gguf(args: argparse.Namespace) -> int:
    """A GGUF source is imported to a Hugging Face checkpoint (dequantised) in a temporary
    directory next to OUT, then packed like any checkpoint."""
    import shutil
    import tempfile

    from tiermoe.importers import gguf_to_hf

    from tiermoe.importers import CONVERTER_VERSION

    src = Path(args.src)
    if not src.is_file():
        raise UserError(f"{src}: no such file")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gguf-import-", dir=out.parent))
    # the import is redone on every run: the GGUF file, not the temporary copy, is the source
    # a resumed pack must share with the first run
    stat = src.stat()
    source = f"gguf {src.resolve()} {stat.st_size} {int(stat.st_mtime)} converter {CONVERTER_VERSION}"
    try:
        print(f"importing {src} ...", file=sys.stderr)
        gguf_to_hf(src, tmp / "hf")
        _note_q3_k(tmp / "hf", args)
        args.src = str(tmp / "hf")
        return _pack_checkpoint(args, source)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _note_q3_k(imported: Path, args: argparse.Namespace) -> None:
    """One note when the GGUF's experts are (partly) Q3_K and the pack is not int3 with group size
    16, the format that keeps their codes (docs/store-format.md, "Q3_K sources")."""
    import json

    try:
        types = json.loads((imported / "tiermoe_import.json").read_text()).get("expert_source_types") or {}
    except (OSError, ValueError):
        return
    q3, total = types.get("Q3_K", 0), sum(types.values())
    if q3 and not (args.quant == "int3" and args.group_size == 16):
        print(f"note: {q3} of the GGUF's {total} expert tensors are Q3_K; --quant int3 --group-size 16 gives each of "
              "their 16-weight sub-blocks its own scale and re-quantizes them nearly losslessly "
              "(docs/store-format.md, Q3_K sources)", file=sys.stderr)


def register(subparsers) -> None:
    from tiermoe.store.formats import STATS_FORMAT

    p = subparsers.add_parser(
        "pack", help="pack a Hugging Face MoE checkpoint (or a GGUF file) into an expert store",
        description="Pack SRC into an expert store at OUT: every routed expert becomes one aligned record of "
                    "experts.bin (read back and checksummed before pack reports success), the other weights go "
                    "to safetensors shards, manifest.json is written last. OUT must be new, empty, or an "
                    "interrupted pack of the same SRC and settings (which is resumed); while a server or any "
                    "other process uses the store in OUT, pack refuses to write there.")
    p.add_argument("src", help="checkpoint directory (config.json + *.safetensors) or a .gguf file")
    p.add_argument("out", help="output store directory (new, empty, or an unfinished pack to resume)")
    p.add_argument("--quant", choices=QUANT_CHOICES, default="bf16",
                   help="routed-expert storage format: bf16/fp16/fp32 as is, or group-wise int8, int4 or int3 "
                        "(8, 4 or 3 bits per weight plus one bf16 scale per group; docs/store-format.md)")
    p.add_argument("--group-size", type=int, default=None,
                   help="int8/int4/int3: input columns sharing one scale; it must divide the hidden size and the "
                        "experts' intermediate size (default: the largest of 128, 64, 32, 16 that does; for int3 "
                        "the largest of 64, 32, 16). --quant int3 --group-size 16 re-quantizes a GGUF's Q3_K experts "
                        "nearly losslessly (one group per 16-weight sub-block; docs/store-format.md)")
    p.add_argument("--cold-quant", choices=QUANT_CHOICES, default=None,
                   help="mixed precision: pack the experts that --expert-stats shows picked least in this kind (e.g. "
                        "--quant int4 --cold-quant int3): fewer bytes for the experts that are mostly read on a miss")
    p.add_argument("--cold-group-size", type=int, default=None,
                   help="--cold-quant's group size (default: picked for that kind as --group-size's default is, "
                        "e.g. 64 for int3 where it divides the shapes)")
    p.add_argument("--hot-share", type=float, default=None,
                   help="with --cold-quant: per layer, the most-picked experts that together take this share of the "
                        f"layer's picks stay --quant (default {DEFAULT_HOT_SHARE}: a quarter of GLM-5.3-Flash's "
                        "experts)")
    p.add_argument("--expert-stats", default=None, metavar="FILE",
                   help=f"with --cold-quant: the routing statistics that rank the experts: {STATS_FORMAT}")
    p.add_argument("--shard-size-gb", type=float, default=2.0, help="size of the non-expert safetensors shards, GB")
    p.add_argument("--no-direct-io", action="store_true",
                   help="buffered writes and reads instead of O_DIRECT (filesystems without it, e.g. tmpfs)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(handler=_pack)

    p = subparsers.add_parser(
        "verify", help="check a store: its manifest, every expert record's sha256 and every dense shard",
        description="Check the store at STORE against its manifest.json: the manifest itself (present, records "
                    "complete and aligned), every expert record of experts.bin (re-read and compared with its "
                    "sha256) and every dense safetensors shard (present, holding its tensors, matching its "
                    "sha256). Exit 0: all good; 1: something is missing or corrupt (listed as BAD lines); "
                    "2: not a store.")
    p.add_argument("store", help="store directory written by `tiermoe pack`")
    p.add_argument("--no-direct-io", action="store_true", help="buffered reads (page cache dropped after each)")
    p.add_argument("--threads", type=int, default=8, help="reader threads")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=_verify)

    p = subparsers.add_parser(
        "plan", help="print the expert tier plan for this machine (loads no weights)",
        description="Print where the routed experts of MODEL would live on this machine (GPU slots, host RAM, "
                    "disk), the expert picks per token each tier serves, and an upper bound on decode speed "
                    "from the weight reads alone (dense weights plus the slowest expert lane). Reads only the "
                    "manifest (or a checkpoint's headers) and free memory.")
    p.add_argument("model", help="packed store, or a checkpoint directory (planned as if packed with --quant)")
    p.add_argument("--device", default=None, help="compute device: cpu or cuda (default: cuda if available, else cpu)")
    p.add_argument("--gpu-expert-gb", type=float, default=None,
                   help="GiB of device memory for expert slots (default: free VRAM minus a reserve; 0 on a CPU)")
    p.add_argument("--host-expert-gb", type=float, default=None,
                   help="GiB of host RAM for experts (default: the memory limit minus a margin)")
    p.add_argument("--stats", default=None, metavar="FILE",
                   help=f"routing statistics placing the hottest experts in the fastest tier: {STATS_FORMAT} "
                        "(default: uniform routing)")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch threads decode will run with, for the bound on a CPU (default: torch's count here)")
    p.add_argument("--max-num-seqs", type=int, default=DEFAULTS.max_num_seqs,
                   help="sequences decoded together, as `serve`'s: on CUDA the device cache keeps staging rows "
                        "for that many out of the GPU budget")
    p.add_argument("--quant", choices=QUANT_CHOICES, default="bf16",
                   help="for an unpacked checkpoint: the format to plan for")
    p.add_argument("--group-size", type=int, default=None,
                   help="for an unpacked checkpoint and int8/int4/int3: as `tiermoe pack --group-size`")
    p.add_argument("--disk-gbs", type=_disk_gbs, default=None, metavar="auto|GBS",
                   help="the disk's read rate for the bound, GB/s (default: auto: when some experts live only on "
                        "disk, measured by reading up to 256 MiB of the store's experts.bin as the disk tier does)")
    p.add_argument("--tensor-parallel-size", "--gpus", "-tp", type=int, default=1, metavar="N",
                   help="plan one GPU of N serving the store together (`tiermoe serve --tensor-parallel-size N`): "
                        "its share of the experts, its own GPU budget and 1/N of host RAM")
    p.set_defaults(handler=_plan)

    p = subparsers.add_parser(
        "sim", help="simulate expert-cache policies on routing statistics or a recorded trace",
        description="Replay expert picks through the slot (and host) tiers under each replacement policy and "
                    "print the hits and misses per token: picks drawn from --stats counts, or a recorded "
                    "--trace in order. No model is loaded.")
    p.add_argument("--stats", default=None, metavar="FILE",
                   help=f"routing statistics to draw picks from (with --trace: only to warm-start the tiers): "
                        f"{STATS_FORMAT}")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="routing trace (.npz) recorded by `tiermoe serve --record-routing FILE`, replayed in "
                        "order (--stats then only warm-starts the tiers)")
    p.add_argument("--slots", type=int, required=True, help="slot-tier capacity in experts, shared by all layers")
    p.add_argument("--policy", default="all",
                   help="lru, lfu, clock, static, device (the GPU device cache's own policy), belady, a comma "
                        "list, or all")
    p.add_argument("--tokens", type=int, default=2000, help="decode tokens to simulate")
    p.add_argument("--seed", type=int, default=0, help="seed of the picks drawn from --stats")
    p.add_argument("--host-experts", type=int, default=0, help="host-tier capacity in experts")
    p.add_argument("--top-k", type=int, default=8, help="experts per token per layer (a --trace sets its own)")
    p.add_argument("--warmup", type=int, default=None,
                   help="tokens excluded from the figures (default: the first 10%%)")
    p.add_argument("--no-warm-start", action="store_true", help="start with empty tiers instead of the hottest experts")
    p.add_argument("--static-hot", type=int, default=0,
                   help="hottest experts pinned in the slots for good (those beyond --slots in the host tier; "
                        "beyond both tiers, or every expert: as many as they hold)")
    p.add_argument("--ram-rule", default="heat",
                   help="with --policy device and --host-experts: how host RAM caches the disk (heat: as served; "
                        "prior: the statistics' order for good; exclusive: slot victims back to RAM), a comma list")
    p.add_argument("--reserve", type=int, default=0,
                   help="host entries kept free for reads ahead (as the served disk tier keeps); each keeps the "
                        "record it held until a read takes it")
    p.add_argument("--lost-reserve", action="store_true",
                   help="the reserve's entries hold nothing (the disk tier before it parked them)")
    p.set_defaults(handler=_sim)
