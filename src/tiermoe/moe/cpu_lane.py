"""CPU lane (fast mode): routed experts computed on the host, from the record where it sits.

In decode, a handful of a layer's experts miss the device slot cache. Copying a cold expert
over PCIe to use it once costs as much as reading it once on the CPU, so the cost model
(`CpuLane.assign`) sends the coldest misses (host-resident first, then disk-only ones, coldest
by the replacement policy's score; see `assign`) to host threads, at most `max_experts` per layer, while the
device computes the rest. The lane's partial sum (fp32) is added to the device result.

No second copy of the weights: the lane reads the host tier's record bytes in place
(ExpertStore.lane_records holds them so no concurrent fetch evicts them). torch's CPU kernels
want their own weight layouts, so quantized records are repacked for them:
  int4: `_weight_int4pack_mm_for_cpu` (weight-only int4 GEMM, fp32 accumulation); our
        symmetric nibbles map onto its (q - 8) * scale + zero form with zero = 0, so the
        repack only moves nibbles and transposes the scales.
  int8: `_weight_int8pack_mm` takes per-row scales only, so each group of G input columns is
        one call on a group-major copy of q, with that group's scales; partials sum in fp32.
  bf16/fp16/fp32: matmul on the record views (no repack): fp32, or the record's own dtype
        when the model computes in it (oneDNN's bf16 GEMM sums in fp32; upcasting the weights
        costs about 6x on a CPU).
  anything the kernels refuse (int4 group size outside 32..256, rows not a multiple of 16):
        dequantize (quant.py reference) + fp32 matmul.
A repack costs far more than the GEMV it feeds (see README), so repacked experts are cached
while they stay in the host tier (bounded by `cache_bytes`; dropped when the expert leaves the
host tier or the budget needs room); disk-only experts are repacked on the fly and dropped.

Not bit-exact: activations enter the kernels in the model's dtype (bf16: torch's only fast int4
path), weights are not rounded to it first, and the lane sums in another order, which is why
it is only on in `--mode fast`. Threads: `threads` torch intra-op threads split over `workers`
Python workers (torch.set_num_threads is per calling thread), so on a CPU run the lane leaves
the device path its own cores.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tiermoe.config import LaneConfig
from tiermoe.store.quant import dequantize_groupwise, unpack_int4
from tiermoe.store.records import FLOAT_KINDS, RecordLayout, section_view

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts


def lane_kernel(layout: RecordLayout, act: torch.dtype = torch.bfloat16) -> str:
    """Which CPU kernel computes records of this layout at activation dtype `act`: int4pack,
    int8pack, float or dequant. int8pack only for bf16 (torch's int8 kernel has no vectorized
    fp32 path: per-group calls in fp32 are slower than dequantize + matmul)."""
    if layout.kind in FLOAT_KINDS:
        return "float"
    rows_ok = (2 * layout.intermediate) % 16 == 0 and layout.hidden % 16 == 0
    if layout.bits == 4 and layout.group_size in INT4_GROUP_SIZES and rows_ok \
            and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return "int4pack"
    if layout.bits == 8 and act == torch.bfloat16 and hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return "int8pack"
    return "dequant"


def lane_act_dtype(act: torch.dtype) -> torch.dtype:
    """The dtype the lane feeds its kernels for a model computing in `act`: the model's own
    precision (bf16 is the fast path, and what a bf16 model computes in anyway; an fp32 model gets
    fp32 inputs, slower but not coarser), bf16 for anything else."""
    return act if act in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16


def lane_reads_disk(layout: RecordLayout, act: torch.dtype, device: str | torch.device) -> bool:
    """Should the lane also compute experts that are only on disk? Both lanes pay the read; the
    CPU also pays a repack (int kernels), worth it only where the device path is dequantize +
    matmul on the same CPU."""
    repacks = lane_kernel(layout, lane_act_dtype(act)) in ("int4pack", "int8pack")
    return not repacks or torch.device(device).type == "cpu"


# -- int4 repack --------------------------------------------------------------------------------
_BLOCK_HALVES: int | None | bool = False  # False: not probed yet; None: use torch's converter


def _int4pack_blocked(q: torch.Tensor, halves: int) -> torch.Tensor:
    """Our nibbles uint8 [N, K/2] (low nibble = even k) -> torch's blocked CPU int4 layout.

    torch packs blocks of 32*halves rows, k-major inside a block, two rows per byte:
    byte[nb, k, h, d] = nib[nb*B + h*16 + d, k] | nib[nb*B + (h + halves)*16 + d, k] << 4.
    Pure uint8 work (no int32 [N, K] temporary), about twice as fast as the converter.
    """
    n, k2 = q.shape
    a = q.view(n // (32 * halves), 2, halves, 16, k2)  # [NB, low/high rows, h, d, K/2]
    lo, hi = a[:, 0], a[:, 1]
    tmp = torch.empty((n // (32 * halves), 2, halves, 16, k2), dtype=torch.uint8)  # [NB, parity, h, d, j]
    torch.bitwise_and(lo, 15, out=tmp[:, 0])
    tmp[:, 0] |= hi << 4
    torch.bitwise_right_shift(lo, 4, out=tmp[:, 1])
    tmp[:, 1] |= hi & 0xF0
    return tmp.permute(0, 4, 1, 2, 3).reshape(n, k2)  # k = 2j + parity


def _int4pack_torch(q: torch.Tensor) -> torch.Tensor:
    nib = unpack_int4(q).to(torch.int32).add_(8)  # [N, K] values 0..15
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(nib, 1)


def _probe_block_layout() -> int | None:
    """Which blocked layout this CPU's int4 kernels use (2: AVX-512, 1: AVX2), checked
    against torch's own converter; None if neither matches (then always use the converter)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 256, (128, 32), dtype=torch.uint8, generator=g)
    ref = _int4pack_torch(q)
    for halves in (2, 1):
        if torch.equal(_int4pack_blocked(q, halves), ref):
            return halves
    return None


def repack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] record nibbles -> the weight operand of _weight_int4pack_mm_for_cpu."""
    global _BLOCK_HALVES
    if _BLOCK_HALVES is False:
        _BLOCK_HALVES = _probe_block_layout()
    halves = _BLOCK_HALVES
    if halves and q.shape[0] % (32 * halves) == 0:
        return _int4pack_blocked(q, halves)
    return _int4pack_torch(q)


def int4_scales_and_zeros(scales: torch.Tensor, act: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """bf16 scales [N, K/G] -> [K/G, N, 2] (scale, zero=0) in the activation dtype:
    w = (nibble - 8) * scale + 0 (exact: bf16 scales convert losslessly to fp32)."""
    s = scales.t().to(act)
    return torch.stack((s, torch.zeros_like(s)), dim=-1).contiguous()


# -- one expert -----------------------------------------------------------------------------------
@dataclass
class PackedExpert:
    """Kernel operands of one expert: gate_up and down, each a tuple for `linear`."""

    kernel: str
    gate_up: tuple
    down: tuple
    nbytes: int = 0  # memory owned (0 when the operands are views of the record)
    act: torch.dtype = torch.bfloat16  # activation dtype the kernels are fed


def pack_expert(layout: RecordLayout, rec: torch.Tensor, kernel: str,
                act: torch.dtype = torch.bfloat16) -> PackedExpert:
    """Record bytes (uint8 [record_bytes], CPU) -> kernel operands. float/dequant operands are
    views into `rec` (valid only while the record is held); int4/int8 ones own their memory."""
    if kernel == "float":
        gate_up, down = section_view(layout, rec, "gate_up"), section_view(layout, rec, "down")
        return PackedExpert(kernel, (gate_up,), (down,), 0, act)
    ops = []
    nbytes = 0
    for prefix in ("gate_up", "down"):
        q, s = section_view(layout, rec, prefix + "_q"), section_view(layout, rec, prefix + "_s")
        if kernel == "int4pack":
            op = (repack_int4(q), int4_scales_and_zeros(s, act))
        elif kernel == "int8pack":
            n, k = q.shape
            g = layout.group_size
            # [K/G, N, G] int8, [K/G, N] scales
            op = (q.view(n, k // g, g).transpose(0, 1).contiguous(), s.t().to(act).contiguous())
        else:
            op = (q, s)
        ops.append(op)
        if kernel != "dequant":
            nbytes += sum(t.numel() * t.element_size() for t in op)
    return PackedExpert(kernel, ops[0], ops[1], nbytes, act)


def linear(x: torch.Tensor, op: tuple, kernel: str, layout: RecordLayout,
           act: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [n, K] fp32 -> x @ W.T [n, N] fp32 with W given by a PackedExpert operand; the
    quantized kernels see x rounded to `act` and round their fp32 sums to `act`."""
    g = layout.group_size
    if kernel == "int4pack":
        w, sz = op
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(act).contiguous(), w, g, sz).float()
    if kernel == "int8pack":
        qg, sg = op  # [K/G, N, G] int8, [K/G, N] act
        xb = x.to(act)
        acc = torch.zeros(x.shape[0], qg.shape[1], dtype=torch.float32)  # [n, N]
        for j in range(qg.shape[0]):
            acc += torch.ops.aten._weight_int8pack_mm(xb[:, j * g : (j + 1) * g].contiguous(), qg[j], sg[j])
        return acc
    if kernel == "float":
        w = op[0]  # the record's own dtype, a view
        if w.dtype == act and act != torch.float32:
            return F.linear(x.to(act), w).float()  # oneDNN/cpublas reduced-precision GEMM: fp32 sums
        return F.linear(x, w.float())
    q, s = op
    return F.linear(x, dequantize_groupwise(q, s, layout.bits, g, torch.float32))


def expert_forward(p: PackedExpert, x: torch.Tensor, layout: RecordLayout, swiglu_limit: float | None) -> torch.Tensor:
    """One SwiGLU expert on the CPU: x [n, H] fp32 -> [n, H] fp32 (same math as expert_mlp)."""
    gate, up = linear(x, p.gate_up, p.kernel, layout, p.act).chunk(2, dim=-1)  # [n, I] each
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return linear(F.silu(gate) * up, p.down, p.kernel, layout, p.act)


# -- repack cache -------------------------------------------------------------------------------
class PackCache:
    """Repacked experts, LRU within a byte budget; thread-safe (workers fill, main prunes)."""

    def __init__(self, budget_bytes: int):
        self.budget = max(0, int(budget_bytes))
        self.bytes = 0
        self._items: OrderedDict[tuple[int, int], PackedExpert] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: tuple[int, int], touch: bool = True) -> PackedExpert | None:
        with self._lock:
            p = self._items.get(key)
            if p is not None and touch:
                self._items.move_to_end(key)
            return p

    def put(self, key: tuple[int, int], p: PackedExpert) -> None:
        if p.nbytes == 0 or p.nbytes > self.budget:
            return
        with self._lock:
            if key in self._items:
                return
            while self.bytes + p.nbytes > self.budget and self._items:
                _, old = self._items.popitem(last=False)
                self.bytes -= old.nbytes
            self._items[key] = p
            self.bytes += p.nbytes

    def prune(self, keep) -> int:
        """Drop entries whose key fails keep(key) (e.g. experts that left the host tier)."""
        with self._lock:
            gone = [k for k in self._items if not keep(k)]
            for k in gone:
                self.bytes -= self._items.pop(k).nbytes
            return len(gone)


# -- the lane -------------------------------------------------------------------------------------
@dataclass
class LaneCounters:
    experts: int = 0  # experts computed by the lane
    decode_experts: int = 0  # ... during decode steps
    disk_experts: int = 0  # ... of which were read from disk for it
    layers: int = 0  # layer calls that used the lane
    wait_s: float = 0.0  # time the caller blocked waiting for the lane
    busy_s: float = 0.0  # lane worker time (repack + compute)
    repacks: int = 0
    cache_hits: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class LaneJob:
    """One layer's lane work in flight; `wait()` returns the partial sum fp32 [T, H] (CPU)."""

    lane: "CpuLane"
    store: object
    layer: int
    ids: list[int]
    futures: list[Future] = field(default_factory=list)
    done: bool = False

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            parts = [f.result() for f in self.futures]
        finally:
            self.done = True
            self.lane.c.wait_s += time.perf_counter() - t0
            self.store.lane_release(self.layer, self.ids)
        out = parts[0]
        for p in parts[1:]:
            out += p
        return out

    def cancel(self) -> None:
        """Settle a job whose caller failed: wait for the workers, ignore their errors."""
        if not self.done:
            try:
                self.wait()
            except Exception:
                pass


class CpuLane:
    def __init__(self, layout: RecordLayout, *, max_experts: int = LaneConfig.max_experts,
                 max_tokens: int = LaneConfig.max_tokens, threads: int | None = None,
                 workers: int = LaneConfig.workers, cache_bytes: int = LaneConfig.cache_bytes, disk: bool | None = None,
                 swiglu_limit: float | None = None, act_dtype: torch.dtype = torch.bfloat16, device: str = "cpu"):
        self.layout = layout
        self.act = lane_act_dtype(act_dtype)
        self.kernel = lane_kernel(layout, self.act)
        self.max_experts = max(0, int(max_experts))
        self.max_tokens = max(1, int(max_tokens))
        self.workers = max(1, int(workers))
        self.threads = max(self.workers, int(threads or torch.get_num_threads()))
        self.disk = lane_reads_disk(layout, act_dtype, device) if disk is None else bool(disk)
        self.swiglu_limit = swiglu_limit
        self.cache = PackCache(cache_bytes)
        self.c = LaneCounters()
        self._count_lock = threading.Lock()  # workers update busy_s / repacks / cache_hits
        per_worker = max(1, self.threads // self.workers)
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="tiermoe-cpu-lane",
                                        initializer=torch.set_num_threads, initargs=(per_worker,))

    def assign(self, store, layer: int, expert_ids: list[int]) -> list[int]:
        """The cost model: which of this layer's experts the lane computes (ascending ids).

        Experts in device slots stay on the device (reading them there is free). Of the misses,
        host-resident ones come first (the lane reads them where they sit; the device would have
        to copy them over PCIe): those whose repack is cached (GEMV only), then the others (a
        repack costs several GEMVs); then disk-only ones, if `disk` (both lanes pay the read).
        Within each class the coldest by the policy's score go first, since hot misses are the
        ones worth admitting to slots through the normal path. At most max_experts per layer.
        """
        if self.max_experts == 0:
            return []
        cands = []
        for e in expert_ids:
            tier = store.tier_of(layer, e)
            if tier == "slots" or (tier == "disk" and not self.disk):
                continue
            rank = 2 if tier == "disk" else (0 if self.cache.get((layer, e), touch=False) is not None else 1)
            cands.append((rank, store.heat(layer, e), e))
        cands.sort()
        return sorted(e for _, _, e in cands[: self.max_experts])

    def submit(self, store, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               expert_ids: list[int], decode: bool = True) -> LaneJob | None:
        """Start computing `expert_ids` of this layer on the lane; None if none could be taken.

        x [T, H], topk_ids/topk_weights [T, k] (any device). One device->host copy of x and the
        routing per layer; the workers never touch the store or the device.
        """
        records = store.lane_records(layer, expert_ids, disk=self.disk)
        if not records:
            return None
        ids = list(records)
        job = LaneJob(self, store, layer, ids)
        try:
            xc = x.detach().to("cpu", torch.float32)  # [T, H]
            work = self._work(records, topk_ids, topk_weights, decode)
            for w in range(self.workers):
                share = work[w :: self.workers]
                if share:
                    job.futures.append(self._pool.submit(self._run, layer, xc, share))
        except BaseException:
            job.cancel()
            raise
        return job

    def _work(self, records: dict, topk_ids: torch.Tensor, topk_weights: torch.Tensor, decode: bool) -> list:
        """Per lane expert (ascending ids): (id, record bytes, disk read future or None, token
        rows, routing weights fp32), counted in the lane's counters."""
        tk = topk_ids.detach().cpu()  # [T, k]
        tw = topk_weights.detach().to("cpu", torch.float32)  # [T, k]
        work = []
        for e in sorted(records):
            top_k_pos, token_idx = torch.where((tk == e).t())  # same visiting order as combine_experts
            buf, fut = records[e]
            work.append((e, buf, fut, token_idx, tw[token_idx, top_k_pos]))
            self.c.disk_experts += fut is not None
        self.c.experts += len(work)
        self.c.decode_experts += len(work) if decode else 0
        self.c.layers += 1
        return work

    def compute(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                records: dict[int, torch.Tensor]) -> torch.Tensor:
        """The partial sum fp32 [T, H] of `records` ({expert: host record bytes}) for a decode
        step, computed in the calling thread (the device mailbox's server; no pool, no store
        reservation: the device cache's host tier holds every record for the engine's life)."""
        work = self._work({e: (buf, None) for e, buf in records.items()}, topk_ids, topk_weights, True)
        return self._run(layer, x.to(torch.float32), work)

    def _run(self, layer: int, x: torch.Tensor, work: list) -> torch.Tensor:
        """Worker: the partial sum fp32 [T, H] of its share of the layer's lane experts."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = torch.zeros(x.shape, dtype=torch.float32)  # [T, H]
            repacks = hits = 0
            for e, buf, fut, token_idx, weight in work:
                if fut is not None:
                    fut.result()  # the disk read (sha256-checked) must be done before we read buf
                p = self.cache.get((layer, e))
                if p is None:
                    p = pack_expert(self.layout, buf, self.kernel, self.act)
                    repacks += p.nbytes > 0
                    if fut is None:  # host-resident: keep the repack while it stays there
                        self.cache.put((layer, e), p)
                else:
                    hits += 1
                y = expert_forward(p, x[token_idx], self.layout, self.swiglu_limit)  # [n, H]
                out.index_add_(0, token_idx, y * weight[:, None])
        with self._count_lock:
            self.c.busy_s += time.perf_counter() - t0
            self.c.repacks += repacks
            self.c.cache_hits += hits
        return out

    def prune(self, store) -> None:
        """Drop cached repacks of experts no longer in the host tier (their entry's lifetime)."""
        if len(self.cache):
            self.cache.prune(lambda key: store.tier_of(*key) == "host")

    def counters(self, decode_tokens: int) -> dict:
        return {**self.c.as_dict(), "per_decode_token": self.c.decode_experts / max(1, decode_tokens),
                "disk": self.disk, "kernel": self.kernel, "act_dtype": str(self.act).removeprefix("torch."),
                "threads": self.threads, "workers": self.workers, "max_experts_per_layer": self.max_experts,
                "cache_entries": len(self.cache), "cache_bytes": self.cache.bytes}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
