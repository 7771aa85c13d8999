"""Tier sizing and the tier plan: how many experts go where, and what that should cost.

Sizes come from flags (GB here means GiB, 2**30 bytes) or, by default, from the machine:
slots = free VRAM minus a reserve (0 on a CPU device unless given), host = the memory limit
(cgroup memory.max minus current usage where set, else MemAvailable) minus a margin. Every
expert has one home: slots first, then host, the rest only on disk.

`TierPlan.table()` is what `tiermoe plan` prints and what the store logs at start-up.
Expected hits per token come from routing statistics when given (the hottest experts are
placed in the fastest tier), else from uniform routing.

The decode upper bound it prints (`decode_floor_s`) is what reading the weights alone allows:
every dense weight once per token (the embedding table only where the output head shares it),
plus the routed experts' slowest lane, at bandwidths measured on the project's H200 host. On a
CPU device the CPU computes everything, so it scales the CPU lane's measured rate (51 GB/s at
16 threads) by the threads torch runs with. Attention, sampling and per-step overheads are not
counted, so real decode is slower; a small model on a CPU serves a fraction of the bound.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Collection, Mapping

import torch

from tiermoe import env
from tiermoe.errors import UserError
from tiermoe.config import DEFAULTS
from tiermoe.store.routing_trace import is_trace, trace_counts
from tiermoe.store.slot_split import STAGE_PICKS, staging_rows, static_tiers

GIB = 1 << 30

# Expert-weight bytes/s the CPU computes through per torch thread: the CPU lane's 51 GB/s
# (int4 GEMV, 16 threads on the H200 host) shared out; a CPU device gets this times its threads.
CPU_GBS_PER_THREAD = 51.0 / 16

# Bytes/s per lane (measured on an H200 host; see docs/store-format.md).
DEFAULT_BANDWIDTH = {
    "hbm": 4.26e12,  # slots on a GPU
    "pcie": 55e9,  # pinned host -> GPU (copy or zero-copy read)
    "ram": 51e9,  # CPU lane computing from RAM (int4 GEMV at 16 threads)
    "disk": 1.6e9,  # O_DIRECT reads
}


def host_memory_available() -> tuple[int, str]:
    """(bytes this process may still allocate, where the figure came from)."""
    avail, source = None, "MemAvailable"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    limits = [
        (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
        (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"), Path("/sys/fs/cgroup/memory/memory.usage_in_bytes")),
    ]
    for lim_p, cur_p in limits:
        try:
            raw = lim_p.read_text().strip()
            if raw == "max" or int(raw) >= 1 << 60:
                continue
            room = int(raw) - int(cur_p.read_text().strip())
        except (OSError, ValueError):
            continue
        if avail is None or room < avail:
            avail, source = max(0, room), f"cgroup {lim_p}"
        break
    if avail is None:
        avail, source = 0, "unknown (no /proc/meminfo)"
    return avail, source


def gpu_memory_free(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device; (0, 0) otherwise."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0, 0
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


@dataclass
class TierPlan:
    """Expert placement for one store on one machine (no weights loaded)."""

    device: str
    record_bytes: int
    total_experts: int
    n_slots: int
    n_host: int
    top_k: int
    moe_layers: int
    notes: list[str] = field(default_factory=list)
    hits_per_token: dict[str, float] = field(default_factory=dict)  # slots/host/disk
    floor_s: dict[str, float] = field(default_factory=dict)  # per lane, "dense" and "floor" (s per token)
    stats_source: str = "uniform routing"
    dense_bytes: int = 0  # non-expert weight bytes read per decode token
    cpu_threads: int = 1  # torch threads the CPU lanes were sized for
    read_bytes: dict[str, float] = field(default_factory=dict)  # expert bytes read per token by tier

    @property
    def n_disk(self) -> int:
        return self.total_experts - self.n_slots - self.n_host

    def table(self) -> str:
        gib = lambda n: n * self.record_bytes / GIB  # noqa: E731
        picks = self.top_k * self.moe_layers
        rows = [
            ("slots (" + self.device + ")", self.n_slots, gib(self.n_slots), self.hits_per_token.get("slots", 0.0)),
            ("host RAM", self.n_host, gib(self.n_host), self.hits_per_token.get("host", 0.0)),
            ("disk only", self.n_disk, gib(self.n_disk), self.hits_per_token.get("disk", 0.0)),
        ]
        out = [
            f"tier plan: {self.total_experts} experts of {fmt_bytes(self.record_bytes)}, "
            f"{picks} picks per token (top-{self.top_k} x {self.moe_layers} layers), {self.stats_source}",
            f"{'tier':<20}{'experts':>9}{'GiB':>10}{'hits/token':>12}{'share':>8}",
        ]
        for name, n, g, h in rows:
            out.append(f"{name:<20}{n:>9}{g:>10.2f}{h:>12.1f}{(h / picks if picks else 0):>8.1%}")
        if self.read_bytes:
            r = self.read_bytes
            out.append(f"expert bytes per token: {fmt_bytes(sum(r.values()))} (slots {fmt_bytes(r.get('slots', 0))}, "
                       f"host RAM {fmt_bytes(r.get('host', 0))}, disk {fmt_bytes(r.get('disk', 0))})")
        if self.floor_s:
            out.append(self.bound_line())
        out.extend(f"note: {n}" for n in self.notes)
        return "\n".join(out)


    def bound_line(self) -> str:
        """The decode upper bound: dense weights plus the slowest expert lane (module doc)."""
        f = self.floor_s.get("floor", 0.0)
        rate = f"{1 / f:,.1f} tok/s" if f > 0 else "unbounded"
        lanes = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in self.floor_s.items() if k not in ("floor", "dense"))
        where = ("HBM" if self.device.startswith("cuda")
                 else f"{self.cpu_threads} CPU thread{'s' if self.cpu_threads != 1 else ''}")
        return (f"decode upper bound: {rate} (weight reads only: attention, sampling and overheads make real "
                f"decode slower)\n  per token: dense weights {fmt_bytes(self.dense_bytes)} in "
                f"{self.floor_s.get('dense', 0.0) * 1e3:.2f} ms on {where} + the slowest expert lane "
                f"({lanes or 'none'}) = {f * 1e3:.2f} ms")


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def size_tiers(
    *,
    record_bytes: int,
    total_experts: int,
    device: torch.device,
    gpu_expert_gb: float | None,
    host_expert_gb: float | None,
    gpu_reserve_gb: float | None = None,
    host_margin_gb: float | None = None,
) -> tuple[int, int, list[str]]:
    """(n_slots, n_host, notes) for this machine and these flags."""
    notes: list[str] = []
    for name, v in (("--gpu-expert-gb", gpu_expert_gb), ("--host-expert-gb", host_expert_gb)):
        if v is not None and not 0 <= v < math.inf:  # nan and inf too: a byte count is finite
            raise UserError(f"{name} must be a finite number >= 0, got {v}")
    if gpu_expert_gb is not None:
        n_slots = int(gpu_expert_gb * GIB // record_bytes)
    elif device.type == "cuda":
        free, total = gpu_memory_free(device)
        reserve = gpu_reserve_gb * GIB if gpu_reserve_gb is not None else max(4 * GIB, 0.15 * total)
        n_slots = int(max(0, free - reserve) // record_bytes)
        notes.append(f"slots from free VRAM {free / GIB:.1f} GiB minus reserve {reserve / GIB:.1f} GiB")
    else:
        n_slots = 0
    n_slots = min(n_slots, total_experts)
    left = total_experts - n_slots
    if host_expert_gb is not None:
        n_host = int(host_expert_gb * GIB // record_bytes)
    else:
        usable, note = default_host_bytes(host_margin_gb)
        n_host = int(usable // record_bytes)
        notes.append(note)
    n_host = min(n_host, left)
    return n_slots, n_host, notes


def default_host_bytes(host_margin_gb: float | None = None) -> tuple[int, str]:
    """(bytes of host RAM the experts may take when --host-expert-gb is not given, how that was found): what is
    available less a margin (a tenth, at least 2 GiB, unless given)."""
    avail, source = host_memory_available()
    margin = host_margin_gb * GIB if host_margin_gb is not None else max(2 * GIB, 0.1 * avail)
    return int(max(0, avail - margin)), f"host from {source}: {avail / GIB:.1f} GiB available minus margin " \
                                        f"{margin / GIB:.1f} GiB"


def device_cache_plan(manifest, *, device: str, gpu_expert_gb: float | None,
                      host_expert_gb: float | None) -> tuple[int, int, str | None]:
    """(GPU slot records, host RAM records, None) for a device-side slot cache (moe/device_cache.py):
    the slots keep copies of experts that host RAM holds, or reads from disk when RAM holds only some
    (moe/disk_tier.py). Else (0, 0, why not): not on CUDA (or Triton's interpreter), or RAM for fewer
    records than one MoE layer has (a step may pick every expert of a layer while it must keep them)."""
    dev = torch.device(device)
    if dev.type != "cuda" and not env.TRITON_INTERPRET.get():
        return 0, 0, f"device {dev.type}: the device cache runs on CUDA"
    rec, total = manifest.record_bytes, len(manifest.records)
    n_slots, _, _ = size_tiers(record_bytes=rec, total_experts=total, device=dev, gpu_expert_gb=gpu_expert_gb,
                               host_expert_gb=0.0)
    _, n_host, _ = size_tiers(record_bytes=rec, total_experts=total, device=dev, gpu_expert_gb=0.0,
                              host_expert_gb=host_expert_gb)
    layer = max(manifest.experts_per_layer.values(), default=0)
    if n_host < layer:
        return 0, 0, (f"host RAM for {n_host} expert records, fewer than one MoE layer's {layer} (raise "
                      f"--host-expert-gb to at least {layer * rec / GIB:.3g})")
    return n_slots, min(n_host, total), None


def load_stats(path: str | os.PathLike) -> dict[int, list[float]]:
    """Routing statistics file -> {layer: per-expert pick counts}.

    Format (formats.STATS_FORMAT, which the CLI help repeats): a routing trace recorded by
    `--record-routing` (its decode tokens' picks counted, routing_trace.trace_counts), or a flat
    JSON object whose keys contain "layers.<L>" (e.g. "model.layers.3.mlp") and whose values are
    lists of per-expert counts (index = expert id).
    """
    p = Path(path)
    if is_trace(p):
        return trace_counts(p)
    try:
        data = json.loads(p.read_text())
    except OSError as exc:
        raise UserError(f"{p}: cannot read statistics file ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise UserError(f"{p}: invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise UserError(f"{p}: expected a flat JSON object such as {{\"layers.1\": [120, 4, 0, 37]}} (per-expert "
                        "pick counts per layer) or a routing trace (.npz) from --record-routing")
    out: dict[int, list[float]] = {}
    for key, counts in data.items():
        m = re.search(r"layers\.(\d+)", key)
        if not m or not isinstance(counts, list) or not all(isinstance(c, (int, float)) and c >= 0 for c in counts):
            raise UserError(f"{p}: entry {key!r} is not 'layers.<L>...' -> list of non-negative counts")
        out[int(m.group(1))] = [float(c) for c in counts]
    if not out:
        raise UserError(f"{p}: no layers")
    return out


def spread_layers(n: int, m: int) -> list[int]:
    """Which of m file layers each of a model's n MoE layers takes: evenly spread, first to
    first and last to last, so a model with fewer (or more) layers than the statistics still
    sees the whole range of their layers' skew."""
    return [round(i * (m - 1) / max(1, n - 1)) for i in range(n)]


def counts_for_model(stats: Mapping[int, list[float]], n_layers: int, experts: int) -> list:
    """Per-expert pick counts (float64 [experts] each) for a model of n_layers MoE layers of
    `experts` experts, from statistics of other shapes: file layers (in layer order) spread
    over the model's (`spread_layers`); another expert count resamples each layer's popularity
    curve (linear interpolation over the expert ids), so the skew is kept."""
    import numpy as np

    rows = [np.asarray(stats[L], dtype=np.float64) for L in sorted(stats)]
    picks = [rows[j] for j in spread_layers(n_layers, len(rows))]
    return [r if len(r) == experts else np.interp(np.linspace(0, len(r) - 1, experts), np.arange(len(r)), r)
            for r in picks]


def pick_rates(stats: Mapping[int, list[float]], top_k: int, smoothing: float = 0.0) -> dict[int, list[float]]:
    """Per-layer expected picks per token of each expert (each layer sums to top_k)."""
    rates = {}
    for layer, counts in stats.items():
        c = [x + smoothing for x in counts]
        total = sum(c)
        rates[layer] = [top_k * x / total if total else top_k / len(c) for x in c]
    return rates


def expected_hits(rates: Mapping[int, float], n_slots: int, n_host: int,
                  weight: Mapping[int, float] | None = None) -> dict[str, float]:
    """Static placement by popularity: hottest keys in slots, next in host, rest on disk.

    With `weight` (a key's record length over the tier entry's, for a mixed store) each pick
    counts at its weight: the result is then in entry-sized record reads, which is what the floor
    model multiplies by the entry length."""
    w = weight or {}
    return {t: sum(rates[k] * w.get(k, 1.0) for k in keys) for t, keys in static_tiers(rates, n_slots, n_host).items()}


def decode_floor_s(record_bytes: int, hits: Mapping[str, float], device: str, *, top_k: int = 8,
                   moe_layers: int = 1, bandwidth: Mapping[str, float] | None = None, dense_bytes: int = 0,
                   cpu_threads: int | None = None, disk_gbs: float | None = None) -> dict[str, float]:
    """Seconds per token per expert lane, for the dense weights ("dense") and in all ("floor"):
    the expert lanes overlap, so the slowest bounds them; the dense layers run before and after.

    Uses the project's floor model (store/floor.py, also behind `tiermoe bench floor`) unless
    explicit bandwidths are given, which the local arithmetic below applies (experts only).
    On a GPU, slot hits and the dense weights read HBM and host hits cross PCIe; on a CPU
    device the CPU computes every expert (disk reads too, once read) and the dense weights, at
    CPU_GBS_PER_THREAD per thread (`cpu_threads`, default torch's). Disk reads are bounded by
    the disk (`disk_gbs`, default the H200 host's).
    """
    cuda = device.startswith("cuda")
    tier_hits = ({"gpu": hits.get("slots", 0.0), "ram": hits.get("host", 0.0)} if cuda
                 else {"cpu": hits.get("slots", 0.0) + hits.get("host", 0.0) + hits.get("disk", 0.0)})
    tier_hits["disk"] = hits.get("disk", 0.0)
    if bandwidth is None:
        from tiermoe.store.floor import Bandwidths, decode_floor

        threads = max(1, cpu_threads or torch.get_num_threads())
        bw = Bandwidths(cpu_gbs=min(Bandwidths.cpu_gbs, CPU_GBS_PER_THREAD * threads),
                        disk_gbs=disk_gbs or Bandwidths.disk_gbs)
        dense_s = dense_bytes / ((bw.hbm_gbs if cuda else bw.cpu_gbs) * 1e9)
        res = decode_floor(record_bytes, max(1, top_k), max(1, moe_layers), hits=tier_hits, bandwidths=bw,
                           non_moe_ms=dense_s * 1e3)
        keep = ("hbm", "pcie", "disk", "host") if cuda else ("cpu", "disk", "host")  # no PCIe without a GPU
        lanes = {k: v["ms"] / 1e3 for k, v in res["lanes"].items() if v["bytes_per_token"] > 0 and k in keep}
        lanes["dense"] = dense_s
        lanes["floor"] = max((v for k, v in lanes.items() if k != "dense"), default=0.0) + dense_s
        return lanes
    bw = {**DEFAULT_BANDWIDTH, **(bandwidth or {})}
    if cuda:
        lanes = {
            "hbm": tier_hits["gpu"] * record_bytes / bw["hbm"],
            "pcie": (tier_hits["ram"] + tier_hits["disk"]) * record_bytes / bw["pcie"],
        }
    else:
        lanes = {"cpu": tier_hits["cpu"] * record_bytes / bw["ram"]}
    lanes["disk"] = tier_hits["disk"] * record_bytes / bw["disk"]
    lanes = {k: v for k, v in lanes.items() if v > 0}
    lanes["floor"] = max(lanes.values(), default=0.0)
    return lanes


def dense_bytes_per_token(manifest) -> int:
    """Bytes of non-expert weights a decode token reads: the dense shards' tensors (the dense
    index's total_size, else the shard files' sizes; a checkpoint's description carries
    "dense_bytes"), less the input embedding table where an untied output head is read instead
    (decode reads one embedding row per token)."""
    data, root = manifest.data, manifest.root
    total = data.get("dense_bytes")
    dense = data.get("dense") if isinstance(data.get("dense"), dict) else {}
    if total is None:
        try:
            total = int(json.loads((root / dense["index"]).read_text())["metadata"]["total_size"])
        except (OSError, ValueError, KeyError, TypeError):
            total = sum((root / n).stat().st_size for n in dense.get("shards", []) if (root / n).is_file())
    tc = text_config(manifest.config)
    vocab, hidden = tc.get("vocab_size"), tc.get("hidden_size")
    if not tc.get("tie_word_embeddings", False) and isinstance(vocab, int) and isinstance(hidden, int):
        itemsize = 4 if data.get("source_dtype", data.get("dtype")) == "float32" else 2
        total -= min(total, vocab * hidden * itemsize)
    return int(total)


def text_config(config: Mapping) -> Mapping:
    """The text part of a model config: its text_config where it has one (multimodal checkpoints)."""
    return config.get("text_config") if isinstance(config.get("text_config"), dict) else config


def config_top_k(config: Mapping) -> int:
    """Experts per token from a model config (text part), default 8."""
    tc = text_config(config)
    for key in ("num_experts_per_tok", "moe_top_k", "top_k", "num_selected_experts"):
        v = tc.get(key)
        if isinstance(v, int) and v > 0:
            return v
    return 8


def decode_idle_layers(manifest, drafting: bool) -> tuple[int, ...]:
    """MoE layers that no decode step runs: the MTP layers while drafting is off. Checkpoints number
    them from the trunk's num_hidden_layers on (DeepSeek-V3, GLM); their experts need no GPU slot."""
    if drafting:
        return ()
    tc = text_config(manifest.config)
    trunk = tc.get("num_hidden_layers")
    if not isinstance(trunk, int):
        return ()
    return tuple(layer for layer in manifest.moe_layers if layer >= trunk)


def key_rates(manifest, stats_file: str | os.PathLike | None, top_k: int, idle: Collection[int] = ()
              ) -> tuple[dict[int, float], str, list[str]]:
    """Expected picks per token of every record key, from a stats file or uniform routing.

    Returns (rates, source description, notes). Stats layers are matched to the store's MoE
    layers by layer number; layers the file lacks fall back to uniform. Layers in `idle` (not run
    by decode: `decode_idle_layers`) are picked at rate 0, so placement gives them nothing.
    """
    notes: list[str] = []
    per_layer: dict[int, list[float]] = {}
    source = "uniform routing"
    if stats_file is not None:
        stats = load_stats(stats_file)
        common = set(stats) & set(manifest.moe_layers)
        if not common:
            raise UserError(f"{stats_file}: its layers {min(stats)}..{max(stats)} do not match the store's MoE layers")
        for layer in sorted(common):
            n = manifest.experts_per_layer[layer]
            if len(stats[layer]) != n:
                raise UserError(f"{stats_file}: layer {layer} lists {len(stats[layer])} experts, the store has {n}")
        per_layer = pick_rates({L: stats[L] for L in common}, top_k)
        missing = sorted(set(manifest.moe_layers) - common)
        if missing:
            notes.append(f"statistics lack layers {missing}; uniform routing assumed there")
        source = f"statistics from {Path(stats_file).name}"
    rates: dict[int, float] = {}
    for r in manifest.records:
        layer_rates = per_layer.get(r.layer)
        rates[r.index] = layer_rates[r.expert] if layer_rates else top_k / manifest.experts_per_layer[r.layer]
        if r.layer in idle:
            rates[r.index] = 0.0
    return rates, source, notes


def build_plan(
    manifest,
    *,
    device: str = "cpu",
    gpu_expert_gb: float | None = None,
    host_expert_gb: float | None = None,
    stats_file: str | os.PathLike | None = None,
    gpu_reserve_gb: float | None = None,
    host_margin_gb: float | None = None,
    cpu_threads: int | None = None,
    disk_gbs: float | None = None,
    max_num_seqs: int = DEFAULTS.max_num_seqs,
    ranks: int = 1,
) -> TierPlan:
    """The tier plan of a store (parsed manifest) on this machine; reads no expert data.
    `ranks` > 1: rank 0's plan in an expert-parallel group of that many GPUs (`--tensor-parallel-size`): its
    share of the experts (store/shares.py), the GPU budget its own, RAM split evenly between the ranks; the
    ranks' shares are dealt alike, so the group decodes at about this rank's bound.
    `cpu_threads`: the torch threads decode will run with (default: torch's current count);
    `disk_gbs`: the disk's read rate for the bound (default: the H200 host's O_DIRECT rate);
    `max_num_seqs`: the decode batch, which sizes the device cache's staging rows on CUDA (when host
    RAM holds every expert, serving's default): those rows come out of the slots."""
    dev = torch.device(device)
    rec = manifest.record_bytes  # a tier entry: the longest record
    top_k = config_top_k(manifest.config)
    rates, source, more = key_rates(manifest, stats_file, top_k)
    total = len(manifest.records)
    if ranks > 1:
        from tiermoe.store.shares import check_ranks, rank_rates

        check_ranks(manifest, ranks)
        rates = rank_rates(manifest, rates, ranks)
        more = [*more, f"expert parallel: rank 0's share of {total} experts, one of {ranks} GPUs each with its own "
                       f"slots, PCIe link and 1/{ranks} of host RAM"]
        total = len(rates)
        if host_expert_gb is None:
            host_expert_gb = default_host_bytes(host_margin_gb)[0] / ranks / GIB
    n_slots, n_host, notes = size_tiers(
        record_bytes=rec,
        total_experts=total,
        device=dev,
        gpu_expert_gb=gpu_expert_gb,
        host_expert_gb=host_expert_gb,
        gpu_reserve_gb=gpu_reserve_gb,
        host_margin_gb=host_margin_gb,
    )
    # the device cache serves where settle's auto picks it: its own plan, with RAM for every expert (a rank's
    # auto is the store path)
    dc_plan = device_cache_plan(manifest, device=device, gpu_expert_gb=gpu_expert_gb, host_expert_gb=host_expert_gb) \
        if dev.type == "cuda" and n_slots and ranks == 1 else None
    if dc_plan is not None and dc_plan[2] is None and dc_plan[1] >= total:
        stage = staging_rows(n_slots, top_k, max_num_seqs)
        n_slots, n_host = n_slots - stage, total - (n_slots - stage)
        more = [*more, f"{stage} records of the GPU budget are the device cache's staging rows for misses it does "
                       f"not admit (top-{top_k} x {min(max_num_seqs, STAGE_PICKS)} sequences), not slots"]
    hits = expected_hits(rates, n_slots, n_host)
    if total > n_slots + n_host:  # a disk tier: what a long prompt's prefill reads
        from tiermoe.store.prefill_reads import plan_prefill_note

        more = [*more, plan_prefill_note(manifest, rates, n_slots, n_host, disk_gbs, dev.type, ranks)]
    # a mixed store's reads are each record's own length: the floor gets picks weighted by length
    read_hits = (expected_hits(rates, n_slots, n_host, {r.index: r.length / rec for r in manifest.records})
                 if manifest.mixed else hits)
    if manifest.mixed:
        hot, cold = manifest.layouts[0], manifest.layouts[1]
        n_cold = sum(1 for r in manifest.records if r.layout)
        more = [*more, f"mixed store: {total - n_cold} hot {hot.kind} records of {fmt_bytes(hot.length)}, "
                       f"{n_cold} cold {cold.kind} ones of {fmt_bytes(cold.length)}; tier entries hold the larger; "
                       "the bound counts each read at its record's own length"]
    threads = max(1, cpu_threads or torch.get_num_threads())
    dense = dense_bytes_per_token(manifest)
    floor = decode_floor_s(rec, read_hits, str(dev), top_k=top_k, moe_layers=len(manifest.moe_layers),
                           dense_bytes=dense, cpu_threads=threads, disk_gbs=disk_gbs)
    return TierPlan(str(dev), rec, total, n_slots, n_host, top_k, len(manifest.moe_layers), notes + more, hits, floor,
                    source, dense, threads, {t: v * rec for t, v in read_hits.items()})
