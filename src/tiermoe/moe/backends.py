"""Expert backends chosen once, by name, from a small typed registry.

    name            class (module)                          when (engine/settle.py decides)
    store-torch     StoreTorchExperts (store_backends.py)   the torch path: CPU, or records or
                                                            activations the kernel does not take
    store-triton    StoreTritonExperts (store_backends.py)  CUDA, a store the fused kernel reads,
                                                            host RAM too small for every expert
    device-cache    DeviceCacheExperts (device_cache.py)    the fused kernel and host RAM for
                                                            every expert: no host sync per layer

`open_expert_backend(ExpertsConfig)` opens the store and builds the named backend; in fast mode
the CPU lane wraps it (lane.LaneExperts). A new strategy is one more `@EXPERT_BACKENDS.register`.
`choose_expert_kernel` and `triton_unsupported` are the rules the settling uses to pick between
the torch and the Triton paths.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable, Generic, Protocol, TypeVar

import torch

from tiermoe import env
from tiermoe.config import EXPERT_KERNELS, ExpertsConfig, StoreConfig
from tiermoe.errors import UserError
from tiermoe.moe.experts import ExpertBackend

log = logging.getLogger("tiermoe.moe")

T = TypeVar("T")
SUPPORTED_KINDS = ("bf16", "int4", "int8", "int3")  # records the fused kernel reads


class Registry(Generic[T]):
    """name -> item, filled by `@registry.register(name)`."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(item: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.what} {name!r} registered twice")
            self._items[name] = item
            return item

        return add

    def __getitem__(self, name: str) -> T:
        if name not in self._items:
            raise UserError(f"{self.what} {name!r}: choose one of {', '.join(self._items)}")
        return self._items[name]

    def names(self) -> tuple[str, ...]:
        return tuple(self._items)


class BackendFactory(Protocol):
    def __call__(self, cfg: ExpertsConfig) -> ExpertBackend: ...


EXPERT_BACKENDS: Registry[BackendFactory] = Registry("expert backend")


def open_store(cfg: StoreConfig):
    from tiermoe.store.facade import ExpertStore

    return ExpertStore.open(cfg.path, device=cfg.device, dtype=cfg.dtype, gpu_expert_gb=cfg.gpu_expert_gb,
                            host_expert_gb=cfg.host_expert_gb, policy=cfg.policy, stats_file=cfg.stats_file,
                            direct_io=cfg.direct_io, only=cfg.keys)


@EXPERT_BACKENDS.register("store-torch")
def _store_torch(cfg: ExpertsConfig) -> ExpertBackend:
    from tiermoe.moe.store_backends import StoreTorchExperts

    return StoreTorchExperts(open_store(cfg.store), prefetch=cfg.prefetch)


@EXPERT_BACKENDS.register("store-triton")
def _store_triton(cfg: ExpertsConfig) -> ExpertBackend:
    from tiermoe.moe.store_backends import StoreTritonExperts

    return StoreTritonExperts(open_store(cfg.store), prefetch=cfg.prefetch)


@EXPERT_BACKENDS.register("device-cache")
def _device_cache(cfg: ExpertsConfig) -> ExpertBackend:
    from tiermoe.moe.device_cache import DeviceCacheExperts
    from tiermoe.store.planner import config_top_k, key_rates

    d = cfg.device_cache
    store = open_store(cfg.store)  # every expert in the (pinned) host tier, no slots of its own
    try:
        if torch.device(cfg.store.device).type == "cuda" and not store.wait_pinned():
            raise UserError("--device-cache: the host tier could not be page-locked (cudaHostRegister failed)")
        top_k = config_top_k(store.manifest.config)
        rates, _, _ = key_rates(store.manifest, cfg.store.stats_file, top_k, d.idle_layers)
        if cfg.store.keys is not None:  # an expert-parallel rank: its share alone is placed and warm-started
            rates = {k: r for k, r in rates.items() if k in cfg.store.keys}
        cache = DeviceCacheExperts(store, d.slots, rates, top_k=top_k, max_tokens=d.max_tokens,
                                   prefill_rows=d.prefill_rows, prefill_buffers=d.prefill_buffers,
                                   stage_misses=d.stage_misses, lane_cap=d.lane_cap, borrow_slots=d.borrow_slots,
                                   disk=d.disk, only=cfg.store.keys, measured_rates=cfg.store.stats_file is not None)
    except BaseException:
        store.close()
        raise
    if d.borrow_slots_asked and cache.prefill.lender is None:
        log.info("--prefill-borrow-slots: not used (%s)", "two dedicated staging buffers already"
                 if d.prefill_buffers == 2 else "too few slots or MoE layers to lend a buffer")
    log.info("expert slot cache: on the device, %d slots over %d layers + %d staging rows; prefill staging %d x %d "
             "records%s%s", cache.slots_total, len(cache.caches), cache.stage_rows, cache.prefill.num_buffers,
             cache.prefill_rows, " (the second lent by slots)" if cache.prefill.lender else "",
             f"; host RAM {cache.disk.capacity} records over disk" if cache.disk is not None else "")
    return cache


def open_expert_backend(cfg: ExpertsConfig) -> ExpertBackend:
    """The backend `cfg.backend` over its store; in fast mode wrapped by the CPU lane; on an expert-parallel
    rank (moe/expert_parallel.py) its store holds only the rank's share, and the share's wrapper goes around
    both."""
    shares = _shares(cfg) if cfg.parallel is not None else None
    backend = EXPERT_BACKENDS[cfg.backend](cfg if shares is None else
                                           replace(cfg, store=replace(cfg.store, keys=shares[2])))
    try:
        if cfg.mode != "exact":
            from tiermoe.moe.lane import LaneExperts

            backend = LaneExperts(backend, cfg.lane, cfg.mode)
        if shares is not None:  # outermost: the lane, like the backend, sees only the rank's own picks
            from tiermoe.moe.expert_parallel import ExpertParallelExperts

            backend = ExpertParallelExperts(backend, shares[0], shares[1], cfg.parallel)
    except BaseException:
        backend.close()
        raise
    return backend


def _shares(cfg: ExpertsConfig) -> tuple[dict[int, list[int]], dict[int, list[int]], frozenset[int]]:
    """({MoE layer: owner rank of each expert}, {MoE layer: this rank's fillers}, the record keys of this rank's
    share), dealt by the store's routing statistics (moe/expert_parallel.py)."""
    from tiermoe.moe.expert_parallel import fillers
    from tiermoe.store.planner import config_top_k, key_rates
    from tiermoe.store.records import load_manifest
    from tiermoe.store.shares import deal, rank_keys

    manifest = load_manifest(cfg.store.path)
    top_k = config_top_k(manifest.config)
    rates, _, _ = key_rates(manifest, cfg.store.stats_file, top_k, ())
    owners, per_layer = deal(manifest, rates, cfg.parallel.world)
    try:
        filler = fillers(owners, per_layer, cfg.parallel.rank, top_k)
    except ValueError as exc:
        raise UserError(f"--tensor-parallel-size {cfg.parallel.world}: {exc}") from None
    return owners, filler, rank_keys(manifest, owners, cfg.parallel.rank)


# -- which kernel computes the experts ---------------------------------------------------------------
def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def triton_unsupported(record_layout, act_dtype: torch.dtype, device: str | torch.device) -> str | None:
    """None when the fused Triton kernel can serve records of this layout, else a one-line reason.

    record_layout: a RecordLayout, or a sequence of them (a mixed store's: the kernel serves it
    when it serves every one of its layouts, each with its own launch configuration, and they
    share one block plan: the checks run on the configurations `mixed_configs` gives)."""
    dev = torch.device(device)
    if dev.type != "cuda" and not env.TRITON_INTERPRET.get():
        return f"device {dev.type}: the Triton kernels need CUDA (or TRITON_INTERPRET=1)"
    layouts = list(record_layout) if isinstance(record_layout, (list, tuple)) else [record_layout]
    for lay in layouts:
        if lay.kind not in SUPPORTED_KINDS:
            return f"{lay.kind} records (the kernel reads {', '.join(SUPPORTED_KINDS)})"
    if act_dtype != torch.bfloat16:
        return f"{str(act_dtype).replace('torch.', '')} activations (the kernel takes bfloat16)"
    try:
        import triton  # noqa: F401

        from tiermoe.kernels.layout import layout_from
        from tiermoe.kernels.triton import fused_moe as fm
    except ImportError as exc:
        return f"Triton is not importable ({exc})"
    for record in layouts:
        try:
            lay = layout_from(record)
            for tokens in (1, fm.DECODE_MAX_TOKENS + 1):  # the decode and the prefill bucket
                cfg = fm.get_config(lay, tokens, dev)
                fm._check_config(lay, cfg, tokens)
                _check_pow2(cfg)
        except ValueError as exc:
            kind = f"{record.kind} " if len(layouts) > 1 else ""
            return f"{kind}record shape H={record.hidden} I={record.intermediate}: {exc}"
    if len(layouts) > 1:
        try:
            lays = [layout_from(record) for record in layouts]
            for tokens in (1, fm.DECODE_MAX_TOKENS + 1):
                for cfg in fm.mixed_configs(lays, tokens, dev):
                    _check_pow2(cfg)
        except ValueError as exc:
            return f"mixed record layouts ({'+'.join(lay.kind for lay in layouts)}): {exc}"
    return None


def _check_pow2(cfg: dict) -> None:
    """ValueError unless the block sizes of a launch configuration are powers of two (tl.arange)."""
    stages = [cfg["gate_up"], cfg["down"], *(cfg["gemv"][s] for s in ("gate_up", "down") if "gemv" in cfg)]
    if not all(_pow2(c[b]) for c in stages for b in ("BN", "BK")) or not _pow2(cfg["gate_up"]["BM"]):
        raise ValueError(f"block sizes {cfg} are not powers of two")


def choose_expert_kernel(requested: str | None, layouts, act_dtype: torch.dtype, device: str, where) -> str:
    """'torch' or 'triton' for `--expert-kernel` (else $TIERMOE_EXPERT_KERNEL, else auto) on a store
    whose records have `layouts` (a RecordLayout, or a mixed store's sequence of them) and whose
    activations are `act_dtype`; `where` names the store in an error.

    auto: Triton on CUDA when the store and dtype are supported, else torch. triton: the Triton
    path, or a UserError saying why it cannot run. On a CPU the kernels run only in Triton's
    interpreter, which the user chooses (TRITON_INTERPRET=1, before the kernels are imported;
    tiermoe/env.py): auto never picks it there.
    """
    choice = (requested or env.EXPERT_KERNEL.get() or "auto").lower()
    if choice not in EXPERT_KERNELS:
        raise UserError(f"--expert-kernel {choice!r}: choose one of {', '.join(EXPERT_KERNELS)}")
    if choice == "torch" or (choice == "auto" and torch.device(device).type != "cuda"):
        return "torch"
    reason = triton_unsupported(layouts, act_dtype, device)
    if reason is None:
        return "triton"
    if choice == "triton":
        raise UserError(f"--expert-kernel triton: cannot serve {where}: {reason}")
    return "torch"
