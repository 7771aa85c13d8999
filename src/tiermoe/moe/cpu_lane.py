"""CPU lane (fast mode): routed experts computed on the host, from the record where it sits.

In decode, a handful of a layer's experts miss the device slot cache. Copying a cold expert
over PCIe to use it once costs as much as reading it once on the CPU, so the cost model
(`CpuLane.assign`, or the device cache's kernel) sends the coldest misses to the host while the
device computes the rest. The lane's partial sum (fp32) is added to the device result.

No second copy of the weights, no conversion per use: the compiled kernel
(kernels/cpu/lane_kernel.cpp, through moe/lane_kernel.py) reads the host tier's record bytes in
place (ExpertStore.lane_records holds them so no concurrent fetch evicts them) in the store's own
layout (int4 nibbles, int3 bit planes or int8, with bf16 group scales; bf16), with the GPU
kernels' numerics for a bf16 model (W' = bf16(q * scale), act rounded to bf16 once, fp32 sums)
and fp32 products for an fp32 one. One pool of threads splits each layer's experts by rows, so
one expert uses them all. Where the kernel cannot be built (no C++ compiler) or the records are
fp16/fp32, the lane computes with plain torch (kernels.reference.lane_experts_ref, or the float
weights): the same function, far slower, and each use materializes the weights (counted as
`repacks`).

A mixed store (pack --cold-quant) gives the lane its layouts and each layer's layout index per
expert: a layer's lane experts are computed one layout after the other (the kernel once per
layout), each record read at its own layout.

Not bit-exact against exact mode: the lane sums in another order and the partial sums meet in
fp32, which is why it is only on in `--mode fast`.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tiermoe.config import LaneConfig
from tiermoe.errors import StoreError
from tiermoe.kernels.cpu.native import KINDS as NATIVE_KINDS, LaneTuning
from tiermoe.kernels.layout import expert_layout
from tiermoe.kernels.reference import lane_experts_ref
from tiermoe.moe.lane_cost import lane_count
from tiermoe.store.records import RecordLayout, decode_record


def lane_act_dtype(act: torch.dtype) -> torch.dtype:
    """The dtype whose numerics the lane follows for a model computing in `act`: the model's own
    (bf16: the GPU kernels' bf16 weights and activation; fp32: fp32 throughout), bf16 otherwise."""
    return act if act in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16


def lane_reads_disk(layout: RecordLayout, act: torch.dtype, device: str | torch.device) -> bool:
    """Should the lane also compute experts that are only on disk? Both lanes pay the read; the
    lane then computes from the staging buffer in place (no repack), so yes."""
    return True


def posted_routing(meta: torch.Tensor, lane_cap: int, top_k: int, tokens: int
                   ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """A posted layer's words (CpuLane.compute_posted) -> (lane expert ids, topk ids int32 [T, k],
    routing weights fp32 [T, k]), views of meta."""
    experts = [e for e in meta[:lane_cap].tolist() if e >= 0]
    topk_ids = meta[lane_cap : lane_cap + tokens * top_k].view(tokens, top_k)  # [T, k]
    topk_weights = meta[lane_cap + tokens * top_k : lane_cap + 2 * tokens * top_k].view(torch.float32)
    return experts, topk_ids, topk_weights.view(tokens, top_k)


# -- the lane -------------------------------------------------------------------------------------
@dataclass
class LaneCounters:
    experts: int = 0  # experts computed by the lane
    decode_experts: int = 0  # ... during decode steps
    disk_experts: int = 0  # ... of which were read from disk for it
    layers: int = 0  # layer calls that used the lane
    wait_s: float = 0.0  # time the caller blocked waiting for the lane
    busy_s: float = 0.0  # lane compute time (disk waits excluded)
    weight_bytes: int = 0  # expert weight bytes computed (sections of the records)
    repacks: int = 0  # experts whose weights were converted before use (plain-torch path only)

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
        except StoreError:
            raise  # a record that failed its check on disk: the store's fault, reported as such
        except Exception as exc:
            raise RuntimeError(f"CPU lane failed on layer {self.layer} (experts {self.ids}): {exc}") from exc
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
    """The lane: `threads` CPU threads computing routed experts from host records.

    isa: the most the compiled kernel may use ("avx512bf16", "avx512", "avx2", "scalar";
    benchmarks compare them). device: the engine's device; pin (None: on a CUDA device) pins the
    lane's threads to physical cores (moe/lane_kernel.py). tuning: the compiled kernel's work items
    and prefetches (None: its defaults). beside_disk_reads: a disk tier reads experts on the same
    cores (the pool's workers then spin briefly between jobs: lane_kernel.lane_pool). A mixed store
    passes `layouts` (its record layouts, `layout` first) and `layout_ids` ({layer: layout index of
    each expert id}).
    """

    def __init__(self, layouts: Sequence[RecordLayout], *, max_experts: int = LaneConfig.max_experts,
                 max_tokens: int = LaneConfig.max_tokens, threads: int | None = None,
                 workers: int = LaneConfig.workers, disk: bool | None = None, swiglu_limit: float | None = None,
                 act_dtype: torch.dtype = torch.bfloat16, device: str = "cpu", isa: str = "avx512bf16",
                 pin: bool | None = None, layout_ids: Mapping[int, Sequence[int]] | None = None,
                 tuning: LaneTuning | None = None, beside_disk_reads: bool = False):
        from tiermoe.moe.lane_kernel import lane_pool

        self.layouts = list(layouts)  # the store's record layouts: one, or a mixed store's hot and cold
        if not self.layouts or (len(self.layouts) > 1 and layout_ids is None):
            raise ValueError("a lane takes its store's layouts, and a mixed store's each layer's layout ids")
        self._layout_ids = {int(k): list(v) for k, v in (layout_ids or {}).items()}
        self.act = lane_act_dtype(act_dtype)
        self.round_bf16 = self.act == torch.bfloat16
        self.max_experts = max(0, int(max_experts))
        self.max_tokens = max(1, int(max_tokens))
        self.threads = max(1, int(threads or torch.get_num_threads()))
        self.disk = lane_reads_disk(self.layouts[0], act_dtype, device) if disk is None else bool(disk)
        self.swiglu_limit = swiglu_limit
        self.share: float | None = None  # the cost model's share of a layer's misses (None: max_experts)
        # the compiled kernel's view of each layout (None: a kind it does not read, computed with torch)
        self.klayouts = [expert_layout(lay.kind, lay.hidden, lay.intermediate, lay.group_size or 0)
                         if lay.kind in NATIVE_KINDS else None for lay in self.layouts]
        self.weight_bytes_of = [self._weight_bytes(lay, k) for lay, k in zip(self.layouts, self.klayouts)]
        pin = torch.device(device).type == "cuda" if pin is None else bool(pin)
        native = any(k is not None for k in self.klayouts)
        self.beside_disk_reads = bool(beside_disk_reads)
        self.pool = lane_pool(self.threads, pin, isa, self.beside_disk_reads) if native else None
        if self.pool is not None and tuning is not None:
            self.pool.tune(tuning)
        self.kernel = f"native-{self.pool.isa}" if self.pool is not None else "torch"
        # the core the pinned pool leaves for the thread that calls it (its workers take the others)
        self.caller_cpu = self.pool.cpus[0] if self.pool is not None and self.pool.cpus else None
        # a posted decode layer's routing set-up runs in the compiled kernel (compute_posted) where every layout
        # is one it reads and the lane's inputs are the bf16 activations' own values
        self.posted_native = self.pool is not None and all(k is not None for k in self.klayouts) and \
            self.act in (torch.bfloat16, torch.float32)
        self._layout_of = {layer: torch.tensor(ids, dtype=torch.int8) for layer, ids in self._layout_ids.items()}
        # the native pool computes a whole layer at once; the torch path splits it over workers
        self.workers = 1 if self.pool is not None else max(1, min(int(workers), self.threads))
        self.c = LaneCounters()
        self._count_lock = threading.Lock()  # workers update busy_s / weight_bytes / repacks
        per_worker = max(1, self.threads // self.workers)
        self._exec = ThreadPoolExecutor(self.workers, thread_name_prefix="tiermoe-cpu-lane",
                                        initializer=torch.set_num_threads, initargs=(per_worker,))

    def layout_of(self, layer: int) -> torch.Tensor | None:
        """int8 [E]: the layout index of each expert of a mixed store's `layer` (None: one layout)."""
        return self._layout_of.get(layer)

    def count_posted(self, experts: int, layers: int, busy_s: float, weight_bytes: int) -> None:
        """Add the work a native mailbox server did for this lane (kernels/cpu/native.NativeMailboxServer)
        to its counters: what compute_posted counts when it runs in Python."""
        with self._count_lock:
            self.c.experts += experts
            self.c.decode_experts += experts
            self.c.layers += layers
            self.c.busy_s += busy_s
            self.c.weight_bytes += weight_bytes

    @staticmethod
    def _weight_bytes(layout: RecordLayout, klayout) -> int:
        if klayout is not None:
            return klayout.weight_bytes
        return sum(s.nbytes for s in layout.sections)

    def _layout_index(self, layer: int, expert: int) -> int:
        ids = self._layout_ids.get(layer)
        return ids[expert] if ids is not None else 0

    def assign(self, store, layer: int, expert_ids: list[int]) -> list[int]:
        """Which of this layer's experts the lane computes (ascending ids).

        Experts in device slots stay on the device (reading them there is free). Of the m misses
        the lane takes lane_count(m, share, max_experts): with a measured `share` (moe/lane_cost.py)
        as many as make it finish with the device's PCIe side, else max_experts. Host-resident
        misses come first (the lane reads them where they sit; the device would copy them over
        PCIe), then disk-only ones, if `disk` (both sides pay the read). Within each class the
        coldest by the policy's score go first, since hot misses are the ones worth admitting to
        slots through the normal path.
        """
        if self.max_experts == 0:
            return []
        cands, misses = [], 0
        for e in expert_ids:
            tier = store.tier_of(layer, e)
            misses += tier != "slots"
            if tier == "slots" or (tier == "disk" and not self.disk):
                continue
            cands.append((tier == "disk", store.heat(layer, e), e))
        cands.sort()
        return sorted(e for _, _, e in cands[: lane_count(misses, self.share, self.max_experts)])

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
            xc = x.detach().to("cpu")  # [T, H]
            work = self._work(records, topk_ids, topk_weights, decode)
            for w in range(self.workers):
                share = work[w :: self.workers]
                if share:
                    job.futures.append(self._exec.submit(self._run, layer, xc, share))
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
        step, computed in the calling thread (the device mailbox's server; no store reservation:
        the device cache's host tier holds every record for the engine's life)."""
        work = self._work({e: (buf, None) for e, buf in records.items()}, topk_ids, topk_weights, True)
        return self._run(layer, x, work)

    def compute_posted(self, layer: int, x: torch.Tensor, meta: torch.Tensor, lane_cap: int, top_k: int,
                       rec_of: torch.Tensor, records: Sequence[torch.Tensor]) -> torch.Tensor:
        """`compute` for a decode layer as the device posted it (moe/device_lane.py): x bf16 [T, H];
        meta int32: lane ids [lane_cap] (-1: none) | topk ids [T, k] | routing weights as fp32 bits
        [T, k]; rec_of int64 [E]: each expert's host record address; records: the same records as
        tensors. Where `posted_native`, the routing set-up runs in the compiled kernel instead of
        per-expert torch calls (the same kernel, rows and order: the same bits as `compute`);
        elsewhere the meta is decoded here and `compute` runs. -> fp32 [T, H]."""
        if not self.posted_native or x.dtype != torch.bfloat16:
            experts, topk_ids, topk_weights = posted_routing(meta, lane_cap, top_k, x.shape[0])
            if not experts:
                return torch.zeros(x.shape, dtype=torch.float32)
            return self.compute(layer, x, topk_ids, topk_weights, {e: records[e] for e in experts})
        t0 = time.perf_counter()
        out = torch.zeros(x.shape, dtype=torch.float32)  # [T, H]
        layout_of = self._layout_of.get(layer)
        experts = weight_bytes = 0
        with torch.inference_mode():
            for idx, klay in enumerate(self.klayouts):
                n = self.pool.run_posted(klay, meta, lane_cap, top_k, rec_of, layout_of, idx, x, out, self.round_bf16,
                                         self.swiglu_limit)
                experts, weight_bytes = experts + n, weight_bytes + n * self.weight_bytes_of[idx]
        self.count_posted(experts, 1, time.perf_counter() - t0, weight_bytes)
        return out

    def _run(self, layer: int, x: torch.Tensor, work: list) -> torch.Tensor:
        """Its share of the layer's lane experts -> partial sum fp32 [T, H] (a worker, or compute's caller)."""
        for _, _, fut, _, _ in work:
            if fut is not None:
                fut.result()  # the disk read (sha256-checked) must be done before we read buf
        groups: dict[int, list] = {}  # layout index -> its work items (ascending ids within each)
        for item in work:
            groups.setdefault(self._layout_index(layer, item[0]), []).append(item)
        for idx, items in groups.items():
            need = self.layouts[idx].length
            for e, buf, _, _, _ in items:
                if buf.dtype != torch.uint8 or buf.numel() < need or not buf.is_contiguous():
                    raise RuntimeError(f"layer {layer} expert {e}: not a readable {need}-byte record")
        t0 = time.perf_counter()
        xk = x.detach().to(self.act).to(torch.float32).contiguous()  # [T, H]: the values the device path sees
        out = torch.zeros(xk.shape, dtype=torch.float32)  # [T, H]
        repacks = weight_bytes = 0
        with torch.inference_mode():
            for idx in sorted(groups):
                items, klay = groups[idx], self.klayouts[idx]
                weight_bytes += self.weight_bytes_of[idx] * len(items)
                if self.pool is not None and klay is not None:
                    offsets = torch.tensor([0] + [len(t) for _, _, _, t, _ in items]).cumsum(0).to(torch.int32)
                    rows = torch.cat([t for _, _, _, t, _ in items]).to(torch.int32)  # [m]
                    weights = torch.cat([w for _, _, _, _, w in items]).contiguous()  # [m] fp32
                    self.pool.run(klay, [buf.data_ptr() for _, buf, _, _, _ in items], offsets, rows, weights, xk,
                                  out, self.round_bf16, self.swiglu_limit)
                    continue
                repacks += len(items)
                for _, buf, _, token_idx, weight in items:
                    self._torch_expert(idx, buf, xk, token_idx, weight, out)
        with self._count_lock:
            self.c.busy_s += time.perf_counter() - t0
            self.c.weight_bytes += weight_bytes
            self.c.repacks += repacks
        return out

    def _torch_expert(self, idx: int, buf: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor,
                      out: torch.Tensor) -> None:
        """The plain-torch path: out [T, H] += weight * expert(x[rows]) for one record of layout `idx`."""
        klay = self.klayouts[idx]
        if klay is not None:
            out += lane_experts_ref(x, [buf], [rows], [weight], klay, self.round_bf16, self.swiglu_limit)
            return
        gate_up, down = decode_record(self.layouts[idx], buf, torch.float32)  # fp16/fp32 records: [2I, H], [H, I]
        gate, up = F.linear(x[rows], gate_up).chunk(2, dim=-1)  # [n, I] each
        if self.swiglu_limit is not None:
            gate, up = gate.clamp(max=self.swiglu_limit), up.clamp(-self.swiglu_limit, self.swiglu_limit)
        out.index_add_(0, rows, F.linear(F.silu(gate) * up, down) * weight[:, None])

    def counters(self, decode_tokens: int) -> dict:
        gbs = self.c.weight_bytes / self.c.busy_s / 1e9 if self.c.busy_s > 0 else 0.0
        return {**self.c.as_dict(), "per_decode_token": self.c.decode_experts / max(1, decode_tokens),
                "share": self.share, "repacks_per_expert": self.c.repacks / max(1, self.c.experts), "gbs": gbs,
                "disk": self.disk, "kernel": self.kernel, "act_dtype": str(self.act).removeprefix("torch."),
                "threads": self.threads, "workers": self.workers, "max_experts_per_layer": self.max_experts}

    def close(self) -> None:
        self._exec.shutdown(wait=True)
        if self.pool is not None:
            self.pool.close()
