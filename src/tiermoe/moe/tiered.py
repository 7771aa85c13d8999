"""Tiered expert backend: routed experts served from the packed expert store.

The MoE layer calls forward(layer, ...) exactly as with resident experts; the weights come from
ExpertStore.fetch (GPU slot, host RAM or disk), and `combine_experts` runs the identical
arithmetic, so a bf16 store gives bit-identical logits whatever the tier sizes (exact mode).

Expert kernel (`--expert-kernel`, options "expert_kernel"): on CUDA, stores the Triton kernel
reads (bf16/int4/int8 records, bf16 activations, a SwiGLU clamp only if the kernel has one) are computed by
triton_backend.TritonExperts: one fused MoE call per layer over a pointer table into the tiers,
host-tier records read in place. Exact mode is then bit-identical across tier sizes within that
backend; the torch path (`combine_experts`, dequantized tensors) stays the default elsewhere.

Device cache (`--device-cache auto|on|off`): with the Triton kernel and host RAM for every
expert, the store keeps all experts in its pinned host tier and device_cache.DeviceCacheExperts
owns the GPU budget, deciding admissions on the device: no host sync per MoE layer.

Layer-ahead prefetch: before computing layer L, the next MoE layer's router is applied to
layer L's input and the predicted experts' disk reads are started, so they overlap compute.

Fast mode (`mode="fast"`): in decode steps, the CPU lane (cpu_lane.py) computes the coldest
misses from the host tier's record bytes while the device computes the rest; the two partial
sums are added. Exact mode never touches the lane, so its arithmetic is unchanged.
CUDA hand-off on the store path: one device->host copy of the layer input when the lane has
work, and one host wait per layer (LaneJob.wait) before the lane's pinned partial sum is copied
up and added. On the device cache the hand-off has no host sync (device_lane.DeviceLane: a
mapped-memory mailbox the GPU polls), so fast-mode decode steps are captured in CUDA graphs too.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from tiermoe.errors import UserError
from tiermoe.moe.experts import combine_experts, expert_mlp

log = logging.getLogger("tiermoe.moe")

MODES = ("exact", "fast")
DEVICE_CACHE_CHOICES = ("auto", "on", "off")
STAGE_ENV = "TIERMOE_DEVICE_CACHE_STAGE"  # "0": misses not admitted are read in place (a diagnostic knob)


def lane_options(options: dict, device: str) -> dict:
    """CpuLane keyword arguments from engine options (flag names cpu_lane_*)."""
    threads = options.get("cpu_lane_threads")
    if threads is None:
        # On a CPU run the device path computes on the same cores: give the lane half of them.
        threads = torch.get_num_threads() if str(device).startswith("cuda") else max(1, torch.get_num_threads() // 2)
    cache_gb = options.get("cpu_lane_cache_gb")
    out = {
        "max_experts": int(options.get("cpu_lane_experts") if options.get("cpu_lane_experts") is not None else 4),
        "max_tokens": int(options.get("cpu_lane_max_tokens") or 16),
        "threads": int(threads),
        "workers": int(options.get("cpu_lane_workers") or 1),
        "cache_bytes": int((1.0 if cache_gb is None else float(cache_gb)) * 2**30),
        "disk": options.get("cpu_lane_disk"),  # None: auto (see CpuLane)
        "device": str(device),
    }
    if out["max_experts"] < 0 or out["threads"] < 1 or out["workers"] < 1 or out["cache_bytes"] < 0:
        raise UserError("--cpu-lane-*: expert count and cache size must be >= 0, threads and workers >= 1")
    return out


class TieredExperts:
    def __init__(self, store, swiglu_limit: float | None = None, prefetch: bool = True, mode: str = "exact",
                 lane: dict | None = None, kernel: str = "torch", kernel_requested: bool = False,
                 device_cache=None):
        self.store = store
        self.device_cache = device_cache  # DeviceCacheExperts: the slot cache decided on the device
        self.kernel = None  # TritonExperts when kernel == "triton", else the torch path
        self._kernel_requested = kernel_requested  # chosen explicitly: refuse rather than fall back
        if kernel == "triton":
            from tiermoe.moe.triton_backend import TritonExperts

            self.kernel = TritonExperts(store)
        self.swiglu_limit = swiglu_limit
        self.prefetch = prefetch
        self.next_router: dict[int, tuple[int, object]] = {}  # layer -> (next MoE layer, that layer's module)
        self.lane = None
        self.device_lane = None  # DeviceLane: fast mode on the device cache (created on the first switch)
        self._lane_args = lane or {}
        self._lane_step = False  # the current step is a decode step the lane may serve
        self._decode = True
        self._fast_decode_tokens = 0  # decode tokens computed in fast mode (for lane experts/token)
        self.graph_replays = 0  # decode steps replayed from CUDA graphs (runner/decode_graph.py)
        self._step_start: tuple = (0, False, 0, 0)  # (tokens, lane step, device cache steps, lane calls)
        self._graph_counts: dict[tuple[int, bool], tuple[int, int]] = {}  # per recorded program
        self.mode = "exact"
        self.set_mode(mode)

    @classmethod
    def open(cls, path: Path, *, device: str, dtype: torch.dtype, options: dict) -> "TieredExperts":
        from types import SimpleNamespace

        from tiermoe.moe.triton_backend import ENV_VAR, choose_expert_kernel
        from tiermoe.store.facade import ExpertStore
        from tiermoe.store.planner import config_top_k, inclusive_host_plan, key_rates
        from tiermoe.store.records import load_manifest

        mode = options.get("mode") or "exact"
        if mode not in MODES:
            raise UserError(f"--mode {mode!r}: choose exact or fast")
        wanted = (options.get("device_cache") or "auto").lower()
        if wanted not in DEVICE_CACHE_CHOICES:
            raise UserError(f"--device-cache {wanted!r}: choose one of {', '.join(DEVICE_CACHE_CHOICES)}")
        staging = options.get("prefill_staging_gb")
        if staging is not None and not 0 <= staging < float("inf"):
            raise UserError(f"--prefill-staging-gb must be a size >= 0, got {staging}")
        lane = lane_options(options, device)
        manifest = load_manifest(path)
        requested = options.get("expert_kernel") or os.environ.get(ENV_VAR)
        kernel = choose_expert_kernel(requested, SimpleNamespace(layout=manifest.layout, dtype=dtype or manifest.dtype,
                                                                 path=Path(path)), device)  # fmt: skip
        open_store = lambda gpu_gb, host_gb: ExpertStore.open(  # noqa: E731
            path, device=device, dtype=dtype, gpu_expert_gb=gpu_gb, host_expert_gb=host_gb,
            policy=options.get("expert_policy") or "lfu", stats_file=options.get("expert_stats"),
            direct_io=not options.get("no_direct_io", False),
        )
        slots, why_not = inclusive_host_plan(manifest, device=device, gpu_expert_gb=options.get("gpu_expert_gb"),
                                             host_expert_gb=options.get("host_expert_gb"))
        if kernel != "triton":
            why_not = why_not or "the Triton expert kernel is not in use"
        if wanted == "on" and why_not:
            raise UserError(f"--device-cache on: {why_not}")
        if wanted == "off" or why_not:
            log.info("expert slot cache: managed by the store (%s)",
                     "--device-cache off" if wanted == "off" else why_not)
            return cls(open_store(options.get("gpu_expert_gb"), options.get("host_expert_gb")), mode=mode, lane=lane,
                       kernel=kernel, kernel_requested=(requested or "").lower() == "triton")
        # Every expert in the (pinned) host tier, sized exactly (the check above found room; free
        # memory read twice could differ); the device cache owns the GPU budget.
        store = open_store(0.0, (len(manifest.records) + 0.5) * manifest.layout.length / 2**30)
        try:
            if torch.device(device).type == "cuda" and not store.wait_pinned():
                raise UserError("--device-cache: the host tier could not be page-locked (cudaHostRegister failed)")
            from tiermoe.moe.device_cache import DeviceCacheExperts

            rates, _, _ = key_rates(manifest, options.get("expert_stats"), config_top_k(manifest.config))
            staging_gb = options.get("prefill_staging_gb")
            rows = None if staging_gb is None else int(staging_gb * 2**30 // store.record_bytes)
            cache = DeviceCacheExperts(store, slots, rates, top_k=config_top_k(manifest.config),
                                       max_tokens=int(options.get("max_num_seqs") or 8), prefill_rows=rows,
                                       stage_misses=os.environ.get(STAGE_ENV, "1") != "0", lane_cap=lane["max_experts"],
                                       borrow_slots=options.get("prefill_borrow_slots") is not False)
        except BaseException:
            store.close()
            raise
        if options.get("prefill_borrow_slots") and cache.prefill.lender is None:  # asked for by name
            log.info("--prefill-borrow-slots: not used (%s)", "two dedicated staging buffers already"
                     if cache.prefill.num_buffers == 2 else "too few slots or MoE layers to lend a buffer")
        log.info("expert slot cache: on the device, %d slots over %d layers + %d staging rows; "
                 "prefill staging %d x %d records%s", cache.slots_total, len(cache.caches), cache.stage_rows,
                 cache.prefill.num_buffers, cache.prefill_rows, " (the second lent by slots)" if cache.prefill.lender else "")
        return cls(store, mode=mode, lane=lane, kernel=kernel, kernel_requested=(requested or "").lower() == "triton",
                   device_cache=cache)

    def set_mode(self, mode: str) -> None:
        """Switch between exact (no lane) and fast (lane on in decode); the lane's threads and
        repack cache are created on the first switch to fast and kept afterwards."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "fast" and self.lane is None:
            from tiermoe.moe.cpu_lane import CpuLane

            self.lane = CpuLane(self.store.layout, swiglu_limit=self.swiglu_limit, act_dtype=self.store.dtype,
                                **self._lane_args)
        if self.device_cache is not None:
            if mode == "fast" and self.device_lane is None:
                from tiermoe.moe.device_lane import DeviceLane

                self.device_lane = DeviceLane(self.device_cache, self.lane, self.lane.max_tokens)
            self.device_cache.set_lane(self.lane.max_experts if mode == "fast" else 0)
        self.mode = mode
        self._lane_step = False

    def attach(self, moe_layers: list) -> None:
        """Called by the loader with the model's MoE layers in order (for layer-ahead prefetch)."""
        for cur, nxt in zip(moe_layers, moe_layers[1:]):
            self.next_router[cur.layer] = (nxt.layer, nxt)
        if moe_layers and moe_layers[0].moe.swiglu_limit is not None:
            self.swiglu_limit = moe_layers[0].moe.swiglu_limit
            if self.lane is not None:
                self.lane.swiglu_limit = self.swiglu_limit
        if self.kernel is not None:
            self.kernel.swiglu_limit = self.swiglu_limit  # fused_moe clamps in its epilogue
        if self.device_cache is not None:
            self.device_cache.swiglu_limit = self.swiglu_limit

    def begin_step(self, tokens: int, decode: bool) -> None:
        self.store.begin_step(tokens=tokens, decode=decode)
        if self.device_cache is not None:
            self.device_cache.begin_step(tokens, decode)
        self._decode = decode
        self._lane_step = self.mode == "fast" and decode and tokens <= self.lane.max_tokens
        if self.mode == "fast" and decode:
            self._fast_decode_tokens += tokens
        if self._lane_step:
            if self.device_lane is not None:  # the host tier holds every expert for good: nothing to prune
                self.device_lane.begin()
            else:
                self.lane.prune(self.store)
        if self.device_cache is not None:  # what this step counts, so a graph replay can count it again
            self._step_start = (tokens, self._lane_step, self.device_cache.steps, self.device_cache.lane_calls)

    def end_step(self) -> None:
        """After the step's device work is queued (ModelRunner.check_step): a fast-mode step on the
        device cache raises here if its CPU lane failed (DeviceLane.check), before its tokens are used."""
        if self._lane_step and self.device_lane is not None:
            self.device_lane.check()

    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self.device_cache is not None:
            return self._forward_device_cache(layer, x, topk_ids, topk_weights)
        ahead = self.next_router.get(layer)
        if self.prefetch and ahead is not None:
            next_layer, module = ahead
            next_ids = module.predict_ids(x)  # [T, k] the next MoE layer's picks (under replay: its rows)
            self.store.prefetch(next_layer, torch.unique(next_ids).tolist())
        fetch = lambda ids: self.store.fetch(layer, ids)  # noqa: E731
        if not self._lane_step:
            if self.kernel is not None:
                return self.kernel.combine(layer, x, topk_ids, topk_weights)
            return combine_experts(x, topk_ids, topk_weights, fetch, self.swiglu_limit)
        expert_ids = torch.unique(topk_ids).tolist()  # sorted ascending
        job = self.lane.submit(self.store, layer, x, topk_ids, topk_weights,
                               self.lane.assign(self.store, layer, expert_ids), decode=self._decode)
        if job is None:
            if self.kernel is not None:
                return self.kernel.combine(layer, x, topk_ids, topk_weights)
            return combine_experts(x, topk_ids, topk_weights, fetch, self.swiglu_limit)
        try:
            on_lane = set(job.ids)
            if self.kernel is not None:
                out = self.kernel.combine(layer, x, topk_ids, topk_weights, skip=on_lane)
            else:
                out = combine_subset(x, topk_ids, topk_weights, [e for e in expert_ids if e not in on_lane], fetch,
                                     self.swiglu_limit)
        except BaseException:
            job.cancel()
            raise
        return _add_lane_partial(out, job, x.dtype)

    def graph_safe(self) -> bool:
        """May the current step's MoE layers be captured in a CUDA graph (runner/decode_graph.py)?
        Only device-cache decode steps (the CPU lane's included: it answers through the mailbox);
        the store path syncs with the host."""
        return self.device_cache is not None and self._decode

    def graph_key(self) -> bool:
        """What else a captured decode program depends on: whether its layers hand work to the
        CPU lane (fast mode, few enough tokens) or not."""
        return self._lane_step

    def graph_recorded(self) -> None:
        """A decode step was recorded (its kernels queued into graphs, not run): uncount what the
        recording counted (cache steps, lane hand-offs) and keep it for the replays."""
        tokens, lane, steps, lane_calls = self._step_start
        dc = self.device_cache
        delta = (dc.steps - steps, dc.lane_calls - lane_calls)
        self._graph_counts[(tokens, lane)] = delta
        dc.steps -= delta[0]
        dc.lane_calls -= delta[1]

    def graph_replayed(self) -> None:
        """A captured decode step was replayed: count what its recording would have counted."""
        self.graph_replays += 1
        steps, lane_calls = self._graph_counts.get((self._step_start[0], self._step_start[1]), (0, 0))
        self.device_cache.steps += steps
        self.device_cache.lane_calls += lane_calls

    def _forward_device_cache(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                              topk_weights: torch.Tensor) -> torch.Tensor:
        """Every expert is in pinned host RAM (nothing to prefetch from disk); the slot cache is
        decided on the device, and fast mode's CPU lane answers through a mailbox: no host sync."""
        if not self._lane_step:
            return self.device_cache.forward(layer, x, topk_ids, topk_weights, decode=self._decode)
        return self.device_lane.forward(layer, x, topk_ids, topk_weights)

    def counters(self) -> dict:
        c = self.store.counters()
        if self.device_cache is not None:
            stats = self.device_cache.stats()
            c = self.device_cache.merge_store_counters(c, stats)
            c["device_cache"] = {**self.device_cache.counters(stats), "graph_replays": self.graph_replays}
            if self.device_lane is not None:  # lane experts are read by the CPU where they sit, not over PCIe
                per, tok = c.setdefault("per_decode_token", {}), max(1, int(c.get("decode_tokens") or 0))
                moved = per.get("bytes_moved", 0.0) - self.lane.c.experts * self.store.record_bytes / tok
                per["bytes_moved"] = max(0.0, moved)
        c["mode"] = self.mode
        c["expert_kernel"] = "torch" if self.kernel is None else "triton"
        if self.kernel is not None:
            c["triton"] = self.kernel.counters()
        if self.lane is not None:
            c["cpu_lane"] = self.lane.counters(self._fast_decode_tokens)
        return c

    def close(self) -> None:
        if self.device_lane is not None:
            self.device_lane.close()
        if self.lane is not None:
            self.lane.close()
        self.store.close()


def _add_lane_partial(out: torch.Tensor, job, dtype: torch.dtype) -> torch.Tensor:
    """out [T, H] + the lane's partial sum: the one host wait of a lane layer (LaneJob.wait)."""
    partial = job.wait()  # [T, H] fp32 on the CPU
    if out.device.type != "cpu":
        partial = partial.pin_memory().to(out.device, non_blocking=True)
    return (out.float() + partial).to(dtype)


def combine_subset(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_ids: list[int],
                   weights_of, swiglu_limit: float | None) -> torch.Tensor:
    """combine_experts restricted to `expert_ids` (the ones the lane does not compute):
    x [T, H] -> [T, H], same per-expert arithmetic and ascending visiting order."""
    out = torch.zeros_like(x)
    if not expert_ids:
        return out
    weights = weights_of(expert_ids)
    for e in expert_ids:
        top_k_pos, token_idx = torch.where((topk_ids == e).t())
        gate_up, down = weights[e]
        y = expert_mlp(x[token_idx], gate_up, down, swiglu_limit)
        y = y * topk_weights[token_idx, top_k_pos, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out
