"""settle_config: the one function that turns the flags (EngineArgs) into an EngineConfig.

MODEL is made a local directory first (model_source.resolve_model: a Hub repo id is fetched, a
GGUF file imported once); everything after works on that directory.

Every "auto" of the engine is decided here, once, before anything is loaded: the device, the
dtype (the checkpoint's), the context length, the step token budget, decode attention and
graphs, and for a packed store which expert backend serves (store-torch, store-triton or
device-cache, by the expert kernel and whether host RAM holds every expert), its prefill staging
buffers, and the CPU lane's threads and disk reads. It reads only small files (the model's
config, the store's manifest) and free memory; errors are one-line UserErrors naming the flag.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from tiermoe.config import (
    DECODE_ATTENTION_CHOICES, DEFAULTS, DEVICE_CACHE_CHOICES, MODES, DeviceCacheConfig, EngineArgs, EngineConfig,
    STORE_ONLY_FIELDS, ExpertsConfig, LaneConfig, RoutingConfig, StoreConfig, default_batched_tokens, lane_share,
)
from tiermoe.errors import UserError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("tiermoe.engine")

GIB = 2**30


def resolve_device(name: str | None) -> str:
    """cpu or cuda[:N]; None or "auto": cuda when available."""
    import torch

    if name in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available here")
    if name != "cpu" and not name.startswith("cuda"):
        raise UserError(f"--device: unknown device '{name}' (use cpu or cuda)")
    return name


def is_packed_store(path: Path) -> bool:
    return (path / "manifest.json").is_file() and (path / "experts.bin").exists()


def settle_config(args: EngineArgs) -> EngineConfig:
    """The engine's configuration for these flags, every "auto" settled (module doc)."""
    from tiermoe.models.loader import checkpoint_dtype, load_spec, parse_dtype

    from tiermoe.model_source import resolve_model

    path = resolve_model(args.model, revision=args.revision)
    spec = load_spec(path)
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype, default=checkpoint_dtype(spec.hf_config))
    ctx = spec.max_position_embeddings
    if args.max_model_len is not None:
        if args.max_model_len < 2 or args.max_model_len > ctx:
            raise UserError(f"--max-model-len {args.max_model_len}: must be between 2 and the model's {ctx}")
        ctx = args.max_model_len
    max_num_seqs = max(1, int(args.max_num_seqs or DEFAULTS.max_num_seqs))
    if args.seed is not None and not -2**63 <= args.seed < 2**64:  # torch.Generator.manual_seed's range
        raise UserError(f"--seed {args.seed}: out of range (a 64-bit integer)")
    attention = args.decode_attention or "auto"
    if attention not in DECODE_ATTENTION_CHOICES:
        raise UserError(f"--decode-attention {attention!r}: choose auto, sdpa or paged")
    paged = attention == "paged" or (attention == "auto" and device != "cpu")
    routing = None
    if args.routing_replay_seed is not None and args.routing_replay_seed < 0:  # numpy's generators take none
        raise UserError(f"--routing-replay-seed {args.routing_replay_seed}: must be >= 0")
    if args.routing_replay or args.record_routing:
        routing = RoutingConfig(replay=args.routing_replay, seed=int(args.routing_replay_seed or 0),
                                record=args.record_routing, record_max_tokens=args.record_routing_max_tokens)
    packed = is_packed_store(path)
    parallel = settle_parallel(args.tensor_parallel_size)  # the joined group checked, this rank's place
    if parallel is not None and args.num_speculative_tokens:
        raise UserError("--tensor-parallel-size: --num-speculative-tokens is not served by several ranks yet")
    if parallel is not None and not packed:
        raise UserError(f"--tensor-parallel-size {parallel.world}: expert parallel serves a packed store "
                        "(`tiermoe pack` first)")
    if not packed:
        _warn_store_only_flags(args, path)
    experts = _settle_experts(args, path, device, dtype, max_num_seqs) if packed else None
    if parallel is not None:
        experts = replace(experts, parallel=parallel)
    return EngineConfig(
        model=path, device=device, dtype=dtype, max_model_len=ctx, max_num_seqs=max_num_seqs,
        max_batched_tokens=args.max_num_batched_tokens or default_batched_tokens(device),
        kv_cache_gb=args.kv_cache_gb or None, seed=args.seed, num_speculative_tokens=args.num_speculative_tokens or 0,
        decode_attention="paged" if paged else "sdpa", paged_attention_required=attention == "paged",
        decode_graphs=not args.enforce_eager and device != "cpu", experts=experts, routing=routing)


def _warn_store_only_flags(args: EngineArgs, path: Path) -> None:
    """One warning naming the expert-store flags given for a checkpoint, which loads whole and reads none of them
    (they were ignored without a word: `--mode fast` on a checkpoint ran exact mode)."""
    given = [f"--{name.replace('_', '-')}" for name in STORE_ONLY_FIELDS
             if getattr(args, name) != getattr(DEFAULTS, name)]
    if given:
        log.warning("%s is a checkpoint, not a packed store: %s apply to packed stores only and are ignored "
                    "(`tiermoe pack %s STORE` makes one)", path, ", ".join(given), path)


def settle_parallel(world: int | None):
    """This process's place in an expert-parallel group of `world` ranks (None: alone); tiermoe/parallel.py."""
    from tiermoe.parallel import settle

    return settle(world)


def settle_lane(args: EngineArgs, device: str, record_layout, dtype: torch.dtype, top_k: int) -> LaneConfig:
    """The CPU lane's settings (flags --cpu-lane-*): threads default to every physical core but
    one beside a CUDA device (moe/lane_kernel.py: lane_threads_beside_gpu) and half of the torch
    threads on a CPU device (the device path computes on the same cores).
    A given share replaces the cost model's measured one beside a GPU; on a CPU device the lane
    keeps its fixed count (the cost model has nothing to split there), so the share is unused."""
    import torch

    from tiermoe.moe.cpu_lane import lane_reads_disk
    from tiermoe.moe.lane_kernel import lane_threads_beside_gpu

    threads = args.cpu_lane_threads
    if threads is None:
        cuda = str(device).startswith("cuda")
        threads = lane_threads_beside_gpu(torch.get_num_threads()) if cuda else max(1, torch.get_num_threads() // 2)
    max_experts = args.cpu_lane_experts
    if max_experts is None:  # beside a GPU the cost model (moe/lane_cost.py) takes fewer: room for a C4 step
        max_experts = top_k * 4 if str(device).startswith("cuda") else 4
    try:
        share = lane_share(args.cpu_lane_share)
    except ValueError as exc:
        raise UserError(f"--cpu-lane-share: {exc}") from None
    if share is not None and not str(device).startswith("cuda"):
        log.info("--cpu-lane-share %g: unused on a CPU device (the lane takes its fixed count)", share)
    lane = LaneConfig(max_experts=int(max_experts), share=share,
                      max_tokens=int(args.cpu_lane_max_tokens or DEFAULTS.cpu_lane_max_tokens),
                      threads=int(threads), workers=int(args.cpu_lane_workers or DEFAULTS.cpu_lane_workers),
                      disk=lane_reads_disk(record_layout, dtype, device) if args.cpu_lane_disk is None
                      else bool(args.cpu_lane_disk), device=str(device))
    if lane.max_experts < 0 or lane.threads < 1 or lane.workers < 1:
        raise UserError("--cpu-lane-*: expert count must be >= 0, threads and workers >= 1")
    return lane


def _settle_experts(args: EngineArgs, path: Path, device: str, dtype: torch.dtype, max_num_seqs: int) -> ExpertsConfig:
    """Which backend serves the packed store at `path` (moe/backends.py), and its settings."""
    from tiermoe.moe.backends import choose_expert_kernel
    from tiermoe.moe.device_cache import prefill_plan, split_budget
    from tiermoe.store.planner import config_top_k, decode_idle_layers, device_cache_plan, key_rates
    from tiermoe.store.records import load_manifest

    mode = args.mode or "exact"
    if mode not in MODES:
        raise UserError(f"--mode {mode!r}: choose exact or fast")
    wanted = (args.device_cache or "auto").lower()
    if wanted not in DEVICE_CACHE_CHOICES:
        raise UserError(f"--device-cache {wanted!r}: choose one of {', '.join(DEVICE_CACHE_CHOICES)}")
    staging = args.prefill_staging_gb
    if staging is not None and not 0 <= staging < float("inf"):
        raise UserError(f"--prefill-staging-gb must be a size >= 0, got {staging}")
    manifest = load_manifest(path)
    lane = settle_lane(args, device, manifest.layout, dtype, config_top_k(manifest.config))
    kernel = choose_expert_kernel(args.expert_kernel, manifest.layouts, dtype, device, path)
    host_expert_gb = args.host_expert_gb
    world = args.tensor_parallel_size or 1
    ranks = world > 1
    if ranks and host_expert_gb is None:  # the ranks share the machine's RAM
        from tiermoe.store.planner import default_host_bytes

        usable, note = default_host_bytes()
        host_expert_gb = usable / world / GIB
        log.info("--tensor-parallel-size %d: each rank's host tier up to %.1f GiB (%s)", world, host_expert_gb, note)
    store = StoreConfig(path=path, device=device, dtype=dtype, gpu_expert_gb=args.gpu_expert_gb,
                        host_expert_gb=host_expert_gb, policy=args.expert_policy or "lfu",
                        stats_file=args.expert_stats, direct_io=not args.no_direct_io)
    slots, host_records, why_not = device_cache_plan(manifest, device=device, gpu_expert_gb=args.gpu_expert_gb,
                                                     host_expert_gb=host_expert_gb)  # a rank's: its part of RAM
    total = len(manifest.records)
    # RAM for some experts: the device cache reads the rest from disk (disk tier); a rank's RAM holds at most
    # its share, the others never picked there
    disk = host_records < total or ranks
    if disk and wanted == "auto" and not why_not:  # opt-in until its speed is measured against the store path
        why_not = ("an expert-parallel rank's host RAM holds its share: the device cache serves it with "
                   "--device-cache on (its disk tier)" if ranks else
                   f"host RAM for {host_records} of the {total} expert records; the device cache reads the rest "
                   "from disk with --device-cache on")
    if kernel != "triton" and not why_not:
        # say why the torch path serves on a GPU (a record kind or shape the kernel does not take)
        from tiermoe.moe.backends import triton_unsupported

        reason = triton_unsupported(manifest.layouts, dtype, device)
        why_not = "the Triton expert kernel is not in use" + (f": it cannot serve {reason}" if reason else "")
    if wanted == "on" and why_not:
        raise UserError(f"--device-cache on: {why_not}")
    if wanted == "off" or why_not:
        log.info("expert slot cache: managed by the store (%s)", "--device-cache off" if wanted == "off" else why_not)
        return ExpertsConfig(backend=f"store-{kernel}", store=store, mode=mode, lane=lane)
    # Every expert (or, with a disk tier, host_records of them) in the (pinned) host tier, sized exactly
    # (free memory read twice could differ); the device cache owns the GPU budget.
    record = manifest.record_bytes  # a host entry: the longest record (mixed stores)
    store = replace(store, gpu_expert_gb=0.0, host_expert_gb=(host_records + 0.5) * record / GIB)
    experts = [manifest.experts_per_layer[layer] for layer in manifest.moe_layers]
    top_k = config_top_k(manifest.config)
    idle = decode_idle_layers(manifest, drafting=bool(args.num_speculative_tokens))
    rates, _, _ = key_rates(manifest, args.expert_stats, top_k, idle)  # the split the device cache will make
    by_record = {(r.layer, r.expert): rates[r.index] for r in manifest.records}
    layer_rates = [[by_record[(layer, e)] for e in range(n)] for layer, n in zip(manifest.moe_layers, experts)]
    _, per_layer = split_budget(slots, experts, top_k, max_num_seqs, args.stage_misses, layer_rates)
    rows, buffers = prefill_plan(experts, per_layer, None if staging is None else int(staging * GIB // record), None)
    if args.expert_policy:
        log.info("--expert-policy %s: the device cache decides its slots itself (CLOCK with frequency admission)",
                 args.expert_policy)
    cache = DeviceCacheConfig(slots=slots, max_tokens=max_num_seqs, prefill_rows=rows, prefill_buffers=buffers,
                              borrow_slots=args.prefill_borrow_slots is not False,
                              borrow_slots_asked=bool(args.prefill_borrow_slots), stage_misses=args.stage_misses,
                              lane_cap=lane.max_experts, disk=disk, idle_layers=idle)
    if idle:
        log.info("device cache: MoE layers %s run only when drafting (--num-speculative-tokens): no slots",
                 list(idle))
    if disk:
        log.info("device cache: host RAM holds %d of the %d expert records; the rest are read from disk when picked",
                 host_records, total)
    return ExpertsConfig(backend="device-cache", store=store, mode=mode, lane=lane, device_cache=cache)
