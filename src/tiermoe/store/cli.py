"""Store subcommands: pack, verify, plan, sim."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tiermoe.errors import UserError


def _pack(args: argparse.Namespace) -> int:
    if str(args.src).endswith(".gguf"):
        return _pack_gguf(args)
    from tiermoe.store.pack import pack

    res = pack(args.src, args.out, quant=args.quant, group_size=args.group_size,
               shard_bytes=int(args.shard_size_gb * 1e9), direct_io=not args.no_direct_io, progress=not args.quiet,
               log=lambda s: print(s, file=sys.stderr))
    for note in res.notes:
        print(f"note: {note}", file=sys.stderr)
    resumed = res.records - res.written
    print(f"packed {res.records} expert records into {res.out} ({args.quant}); "
          f"{res.written} written, {resumed} resumed, all read back and checksummed")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from tiermoe.store.verify import verify_store

    def on_bad(rec, got) -> None:
        print(f"BAD layer {rec.layer} expert {rec.expert} offset {rec.offset} length {rec.length}: "
              f"sha256 {got[:16]}... expected {rec.sha256[:16]}...")

    n, bad = verify_store(args.store, direct_io=not args.no_direct_io, threads=args.threads,
                          progress=not args.quiet, on_bad=on_bad)
    if bad:
        print(f"{len(bad)} of {n} records are corrupt in {args.store}", file=sys.stderr)
        return 1
    print(f"ok: {n} records verified")
    return 0


def _plan_manifest(model: str, quant: str, group_size: int):
    """A store's manifest, or a manifest-shaped description of an unpacked checkpoint."""
    from tiermoe.store.records import FORMAT_VERSION, MANIFEST_NAME, Manifest, RecordLayout, load_manifest

    root = Path(model)
    if (root / MANIFEST_NAME).is_file():
        return load_manifest(root)
    if not (root / "config.json").is_file():
        raise UserError(f"{root}: neither a packed store (manifest.json) nor a checkpoint (config.json)")
    from tiermoe.store.catalog import Checkpoint

    ck = Checkpoint(root)  # headers only
    layout = RecordLayout.build(quant, ck.hidden, ck.intermediate, group_size)
    keys = ck.expert_keys()
    data = {
        "format_version": FORMAT_VERSION, "model_config": ck.config, "dtype": "bfloat16",
        "moe_layers": ck.layers, "experts_per_layer": {str(k): v for k, v in ck.experts_per_layer.items()},
        "layouts": [layout.to_json()],
        "records": [{"layer": L, "expert": e, "offset": i * layout.length, "length": layout.length, "sha256": ""}
                    for i, (L, e) in enumerate(keys)],
    }
    return Manifest(data, root)


def _plan(args: argparse.Namespace) -> int:
    import torch

    from tiermoe.store.planner import build_plan

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    m = _plan_manifest(args.model, args.quant, args.group_size)
    plan = build_plan(m, device=device, gpu_expert_gb=args.gpu_expert_gb, host_expert_gb=args.host_expert_gb,
                      stats_file=args.stats)
    print(plan.table())
    return 0


def _sim(args: argparse.Namespace) -> int:
    from tiermoe.store.sim import SIM_POLICIES, format_results, simulate

    policies = list(SIM_POLICIES) if args.policy == "all" else [p.strip() for p in args.policy.split(",")]
    results = simulate(args.stats, slots=args.slots, policies=policies, tokens=args.tokens, seed=args.seed,
                       host_experts=args.host_experts, top_k=args.top_k, warmup=args.warmup,
                       warm_start=not args.no_warm_start, static_hot=args.static_hot, trace_file=args.trace)
    print(format_results(results, slots=args.slots, host_experts=args.host_experts, picks=results[0].picks))
    return 0


# Mirrors store.records.QUANT_KINDS; spelled out so building the CLI parser imports no torch
# (a test checks the two agree).
QUANT_CHOICES = ("bf16", "fp16", "fp32", "int8", "int4")


def _pack_gguf(args: argparse.Namespace) -> int:
    """A GGUF source is imported to a Hugging Face checkpoint (dequantised) in a temporary
    directory next to OUT, then packed like any checkpoint."""
    import shutil
    import tempfile

    from tiermoe.importers import gguf_to_hf

    src = Path(args.src)
    if not src.is_file():
        raise UserError(f"{src}: no such file")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gguf-import-", dir=out.parent))
    try:
        print(f"importing {src} ...", file=sys.stderr)
        gguf_to_hf(src, tmp / "hf")
        args.src = str(tmp / "hf")
        return _pack(args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def register(subparsers) -> None:
    p = subparsers.add_parser("pack", help="pack a Hugging Face MoE checkpoint into an expert store")
    p.add_argument("src", help="checkpoint directory (config.json + *.safetensors) or a .gguf file")
    p.add_argument("out", help="output store directory")
    p.add_argument("--quant", choices=QUANT_CHOICES, default="bf16", help="routed-expert storage format (default bf16)")
    p.add_argument("--group-size", type=int, default=128, help="int8/int4 group size along the input dim (default 128)")
    p.add_argument("--shard-size-gb", type=float, default=2.0, help="size of non-expert safetensors shards (default 2)")
    p.add_argument("--no-direct-io", action="store_true", help="buffered writes/reads instead of O_DIRECT")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(handler=_pack)

    p = subparsers.add_parser("verify", help="re-read every expert record of a store and check its sha256")
    p.add_argument("store", help="store directory written by `tiermoe pack`")
    p.add_argument("--no-direct-io", action="store_true", help="buffered reads (page cache dropped after each)")
    p.add_argument("--threads", type=int, default=8, help="reader threads (default 8)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=_verify)

    p = subparsers.add_parser("plan", help="print the expert tier plan for this machine (loads no weights)")
    p.add_argument("model", help="packed store, or a checkpoint directory (planned as if packed with --quant)")
    p.add_argument("--device", default=None, help="compute device (default: cuda if available, else cpu)")
    p.add_argument("--gpu-expert-gb", type=float, default=None, help="GiB of device memory for expert slots")
    p.add_argument("--host-expert-gb", type=float, default=None, help="GiB of host RAM for experts")
    p.add_argument("--stats", default=None, help="routing statistics JSON (layers.<L> -> per-expert counts)")
    p.add_argument("--quant", choices=QUANT_CHOICES, default="bf16",
                   help="for an unpacked checkpoint: format to plan for")
    p.add_argument("--group-size", type=int, default=128)
    p.set_defaults(handler=_plan)

    p = subparsers.add_parser("sim", help="simulate expert-cache policies on routing statistics or a recorded trace")
    p.add_argument("--stats", default=None, help="routing statistics JSON (layers.<L> -> per-expert counts)")
    p.add_argument(
        "--trace",
        default=None,
        help="routing trace recorded by --record-routing (replayed in order; --stats then only warm-starts the caches)",
    )
    p.add_argument("--slots", type=int, required=True, help="slot-tier capacity in experts, shared by all layers")
    p.add_argument(
        "--policy",
        default="all",
        help="lru, lfu, clock, static, device (the GPU device cache's own policy), belady, a comma list, "
        "or all (default)",
    )
    p.add_argument("--tokens", type=int, default=2000, help="decode tokens to simulate (default 2000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host-experts", type=int, default=0, help="host-tier capacity in experts (default 0)")
    p.add_argument("--top-k", type=int, default=8, help="experts per token per layer (default 8)")
    p.add_argument("--warmup", type=int, default=None, help="tokens excluded from the figures (default 10%%)")
    p.add_argument("--no-warm-start", action="store_true", help="start with empty tiers instead of the hottest experts")
    p.add_argument("--static-hot", type=int, default=0, help="hottest experts pinned in the slots for good")
    p.set_defaults(handler=_sim)
