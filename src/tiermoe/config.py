"""Typed, frozen configuration: what the user asked for, and what the engine settled it to.

    EngineArgs    the flags as given (None or "auto" where the engine decides); its field
                  defaults are the only copy of the defaults (the argparse flags read them)
        |  engine/settle.py settle_config(): the one function that settles every "auto"
        v  (device, dtype, context, step budget, expert backend and kernel, device cache,
           prefill staging buffers, CPU lane threads and disk reads, decode attention)
    EngineConfig  -> StoreConfig, ExpertsConfig (+ LaneConfig, DeviceCacheConfig), RoutingConfig

Only the engine reads EngineConfig; the expert backends (moe/) read ExpertsConfig and its
parts. This module imports no other part of tiermoe (nor torch), so every package, and the CLI
parser, may depend on it.
"""

from __future__ import annotations

from argparse import Namespace
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # no torch import at run time: the CLI parser reads the defaults here
    import torch

MODES = ("exact", "fast")
DEVICE_CACHE_CHOICES = ("auto", "on", "off")
EXPERT_KERNELS = ("auto", "torch", "triton")
DECODE_ATTENTION_CHOICES = ("auto", "sdpa", "paged")
EXPERT_POLICIES = ("lru", "lfu", "clock", "static")
PAGE_SIZE = 16  # tokens per KV page


@dataclass(frozen=True)
class EngineArgs:
    """The engine flags as a user gives them (`tiermoe serve`, `generate`, `eval`, `bench`)."""

    model: str | None = None  # None: the embedded default model
    revision: str | None = None  # a Hugging Face repo id's branch, tag or commit (model_source.py)
    device: str | None = None  # None/"auto": cuda when available
    dtype: str | None = "auto"  # auto: the checkpoint's
    max_model_len: int | None = None  # None: the model's context
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None  # None: 512 on a CPU, 2048 on CUDA
    kv_cache_gb: float | None = None  # None: sized by the engine
    seed: int | None = None
    enforce_eager: bool = False
    decode_attention: str = "auto"
    num_speculative_tokens: int = 0
    # ranks of one expert-parallel group, each a process that joined torch.distributed (tiermoe/parallel.py)
    tensor_parallel_size: int = 1
    # expert store (packed stores only)
    gpu_expert_gb: float | None = None  # None: free VRAM minus a reserve (store/planner.py)
    host_expert_gb: float | None = None  # None: the memory limit minus a margin
    expert_policy: str | None = None  # None: lfu
    expert_stats: str | None = None
    no_direct_io: bool = False
    expert_kernel: str | None = None  # None: $TIERMOE_EXPERT_KERNEL, else auto
    device_cache: str | None = None  # None: auto
    prefill_staging_gb: float | None = None  # None: one layer's non-resident experts
    prefill_borrow_slots: bool | None = None  # None: on
    stage_misses: bool = True  # device cache: stage misses it does not admit (False: read in place)
    mode: str = "exact"
    cpu_lane_experts: int | None = None  # None: top_k x 4 beside a GPU (the cost model splits), 4 on a CPU
    cpu_lane_share: float | None = None  # beside a GPU: share of a layer's misses for the lane (None: measured)
    cpu_lane_max_tokens: int = 16
    cpu_lane_threads: int | None = None  # None: physical cores - 1 beside CUDA, half the threads on a CPU
    cpu_lane_workers: int = 1
    cpu_lane_disk: bool | None = None  # None: where it pays (moe/cpu_lane.lane_reads_disk)
    # routing replay and recording (benchmarking)
    routing_replay: str | None = None
    routing_replay_seed: int = 0
    record_routing: str | None = None
    record_routing_max_tokens: int = 200_000

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | Namespace | None = None, **explicit: Any) -> EngineArgs:
        """From a CLI namespace (or its vars) plus explicit keywords, which win over the
        namespace's value even when None. Keys that are not engine flags (a server's host and
        port) are ignored; None takes the default."""
        names = {f.name for f in fields(cls)}
        unknown = set(explicit) - names
        if unknown:
            raise TypeError(f"not engine flags: {', '.join(sorted(unknown))}")
        raw = vars(options) if isinstance(options, Namespace) else dict(options or {})
        given = {k: v for k, v in raw.items() if k in names and v is not None}
        for k, v in explicit.items():
            if v is None:
                given.pop(k, None)
            else:
                given[k] = v
        return cls(**given)


DEFAULTS = EngineArgs()
# EngineArgs fields with a flag that only a packed store reads (settle warns when a checkpoint is given them)
STORE_ONLY_FIELDS = ("gpu_expert_gb", "host_expert_gb", "expert_policy", "expert_stats", "no_direct_io",
                     "expert_kernel", "device_cache", "prefill_staging_gb", "prefill_borrow_slots", "mode",
                     "cpu_lane_experts", "cpu_lane_share", "cpu_lane_threads")


def default_batched_tokens(device: str) -> int:
    """Tokens a step takes (the prefill chunk) when --max-num-batched-tokens is not given: 512 on a CPU, 2048 on a
    GPU (serve's setting, and `tiermoe plan`'s for the disk reads of a prefill)."""
    return 512 if str(device) == "cpu" else 2048


def lane_share(value: float | str | None) -> float | None:
    """`--cpu-lane-share` as given (a number, its text, "auto" or None) -> the share, None for
    "auto" (the cost model measures it beside a GPU). One check for the CLI parser and for options
    given as a dict, so both refuse the same values; ValueError says what is wrong."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    try:
        share = float(value)
    except (TypeError, ValueError, OverflowError):
        share = float("nan")
    if not 0.0 <= share <= 1.0:  # nan too
        raise ValueError(f"{value!r} is not auto or a number from 0 to 1")
    return share


@dataclass(frozen=True)
class StoreConfig:
    """A packed expert store and its tier budgets (store/facade.ExpertStore.open)."""

    path: Path
    device: str
    dtype: torch.dtype
    gpu_expert_gb: float | None = None  # None: the store planner sizes it from free memory
    host_expert_gb: float | None = None
    policy: str = "lfu"
    stats_file: str | None = None
    direct_io: bool = True
    keys: frozenset[int] | None = None  # the records this process may hold (an expert-parallel rank's share)


@dataclass(frozen=True)
class LaneConfig:
    """The CPU lane of fast mode (moe/cpu_lane.CpuLane), every value settled."""

    max_experts: int = 4  # per MoE layer and decode step (beside a GPU: the cost model's cap)
    share: float | None = None  # beside a GPU: the lane's fixed share of a layer's misses (None: measured at start)
    max_tokens: int = DEFAULTS.cpu_lane_max_tokens  # decode steps with more tokens run without the lane
    threads: int = 1
    workers: int = DEFAULTS.cpu_lane_workers
    disk: bool = False  # also compute experts that are only on disk
    device: str = "cpu"

    def kwargs(self) -> dict[str, Any]:
        """CpuLane's keyword arguments."""
        return {"max_experts": self.max_experts, "max_tokens": self.max_tokens, "threads": self.threads,
                "workers": self.workers, "disk": self.disk, "device": self.device}


@dataclass(frozen=True)
class DeviceCacheConfig:
    """The slot cache decided on the device (moe/device_cache.DeviceCacheExperts)."""

    slots: int  # GPU records: every layer's slots plus the staging rows
    max_tokens: int  # the largest decode batch
    prefill_rows: int  # staging rows per prefill buffer
    prefill_buffers: int  # 1, or 2 (large chunks copy one layer ahead)
    borrow_slots: bool = True  # the second buffer lent by slots
    borrow_slots_asked: bool = False  # --prefill-borrow-slots given by name (logged when unused)
    stage_misses: bool = True
    lane_cap: int = 0  # most lane experts per layer and step (fast mode)
    disk: bool = False  # host RAM holds only some experts: the rest are read from disk (moe/disk_tier.py)
    idle_layers: tuple[int, ...] = ()  # MoE layers decode never runs (MTP while drafting is off): no slots


@dataclass(frozen=True)
class ParallelConfig:
    """This process's place in an expert-parallel group (tiermoe/parallel.py, moe/expert_parallel.py)."""

    rank: int
    world: int


@dataclass(frozen=True)
class ExpertsConfig:
    """Routed experts served from a packed store: which backend, in which mode."""

    backend: str  # a name in moe/backends.EXPERT_BACKENDS: store-torch, store-triton, device-cache
    store: StoreConfig
    mode: str = "exact"  # fast: the CPU lane wraps the backend (moe/lane.LaneExperts)
    lane: LaneConfig = LaneConfig()
    device_cache: DeviceCacheConfig | None = None  # set for the device-cache backend
    prefetch: bool = True  # store backends: start the next MoE layer's disk reads early
    parallel: ParallelConfig | None = None  # an expert-parallel rank: its share of every layer's experts


@dataclass(frozen=True)
class RoutingConfig:
    """Routing replay and/or recording (moe/replay.py)."""

    replay: str | None = None
    seed: int = 0
    record: str | None = None
    record_max_tokens: int = DEFAULTS.record_routing_max_tokens


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine is built from (engine/build.build_engine), every "auto" settled."""

    model: Path
    device: str
    dtype: torch.dtype
    max_model_len: int
    max_num_seqs: int
    max_batched_tokens: int
    kv_cache_gb: float | None = None  # None: one context per sequence, within a cap (engine/build.py)
    page_size: int = PAGE_SIZE
    seed: int | None = None
    num_speculative_tokens: int = 0
    decode_attention: str = "sdpa"  # sdpa or paged
    paged_attention_required: bool = False  # --decode-attention paged: refuse rather than fall back
    decode_graphs: bool = False  # replay decode steps from CUDA graphs where the model allows
    experts: ExpertsConfig | None = None  # None: every expert resident (a checkpoint)
    routing: RoutingConfig | None = None
