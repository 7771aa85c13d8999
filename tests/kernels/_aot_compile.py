"""Compile every Triton kernel the package launches for real CUDA targets, without a GPU.

Run by test_compile_targets.py as a script in a process of its own, with TRITON_INTERPRET=0:
`triton.jit` picks the interpreter or the compiler when a kernel is decorated, and the test
process has the interpreter on.

1. Record: `JITFunction.run` is replaced by a recorder, then the package's own wrappers
   (fused_moe, paged_decode_attention, ExpertCache.step, gather_records, ResidencyMailbox.ensure,
   Mailbox.post and wait_add, and the glm5_next kernels' wrappers of _aot_glm5.py) are called on small CPU
   tensors. Each launch is kept (kernel, arguments,
   constexprs, num_warps/num_stages) instead of run, so the argument types and launch
   configurations are exactly what those wrappers pass on a GPU without a tuned entry in
   configs.json; the entries tuned for a device are recorded for that device's target only.
2. Compile: each distinct launch goes through Triton's own `JITFunction.run(warmup=True)`
   against a stand-in driver that reports the target GPU, so Triton specialises the
   arguments as a real launch would (16-byte alignment, integers equal to 1) before compiling
   to a cubin with ptxas. That matters: alignment decides whether loads are pipelined through
   shared memory, so a hand-written signature would understate the shared memory a launch needs.

Usage: TRITON_INTERPRET=0 python _aot_compile.py OUT.json   (writes this report as JSON)
  {"targets": [...], "triton": the version that compiled, "launches": recorded, "variants": distinct,
   "errors": [wrapper calls that raised],
   "results": [{"kernel", "variant", "scenario", "target", "shared" (bytes), "seconds", "error"}]}
"""

from __future__ import annotations

import contextlib
import inspect
import json
import multiprocessing
import os
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from tiermoe.kernels.layout import expert_layout
from tiermoe.kernels.triton import fused_moe as fm
from tiermoe.kernels.triton.cache_manager import ExpertCache, gather_records
from tiermoe.kernels.triton.mailbox import Mailbox
from tiermoe.kernels.triton.residency import ResidencyMailbox

from _aot_glm5 import dsa_decode, kda_decode, mhc, mhc_fused, router  # glm5_next's kernels, a file of their own
from tiermoe.kernels.triton.paged_attention import paged_decode_attention

# compute capability of each target; sm_86 / sm_89: RTX 3090 / 4090, sm_90: H100 / H200
TARGETS = {"sm_90": 90, "sm_89": 89, "sm_86": 86}
# devices that configs.json may hold tuned entries for -> the target those entries run on
TUNED_DEVICE_TARGETS = {
    "NVIDIA H200": "sm_90",
    "NVIDIA H100 80GB HBM3": "sm_90",
    "NVIDIA H100 PCIe": "sm_90",
    "NVIDIA GeForce RTX 4090": "sm_89",
    "NVIDIA GeForce RTX 3090": "sm_86",
}
HIDDEN, INTER, TOP_K, EXPERTS = 2048, 768, 8, 128  # a Qwen3-30B-A3B-sized MoE layer; one shared expert on top
PREFILL_TOKENS = 300

_REAL_RUN = JITFunction.run


@dataclass
class Launch:
    kernel: JITFunction
    args: tuple
    kwargs: dict
    scenario: str
    targets: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


class Recorder:
    """Stands in for JITFunction.run: keeps each launch, tagged with the scenario and targets."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []
        self.scenario, self.targets = "", tuple(TARGETS)

    def run(self, kernel: JITFunction, *args, grid, warmup, **kwargs) -> None:
        self.launches.append(Launch(kernel, args, kwargs, self.scenario, set(self.targets)))

    @contextlib.contextmanager
    def tagged(self, scenario: str, targets: tuple[str, ...] = tuple(TARGETS)):
        self.scenario, self.targets = scenario, targets
        try:
            yield
        finally:
            self.scenario, self.targets = "", tuple(TARGETS)


# ----------------------------------------------------------------------------- scenarios


def _moe(layout, tokens: int, config: dict | None = None, swiglu_limit: float | None = None,
         fp32_sum: bool = False) -> None:
    """One fused_moe call: TOP_K routed picks per token plus the shared expert (table row EXPERTS); fp32_sum:
    into an fp32 out (fast mode's GPU part, kept unrounded until the CPU lane's part is added)."""
    ids = (torch.arange(tokens)[:, None] + torch.arange(TOP_K)[None, :]) % EXPERTS
    ids = torch.cat([ids, torch.full((tokens, 1), EXPERTS)], 1).to(torch.int32)  # [T, K + 1]
    x = torch.zeros(tokens, layout.hidden, dtype=torch.bfloat16)
    w = torch.ones(tokens, TOP_K + 1)
    table = torch.zeros(EXPERTS + 1, dtype=torch.int64)
    out = torch.empty(tokens, layout.hidden, dtype=torch.float32) if fp32_sum else None
    fm.fused_moe(x, ids, w, table, layout, config=config, swiglu_limit=swiglu_limit, out=out)


def fused_moe_defaults(rec: Recorder) -> None:
    """Default launch configurations (a device without a tuned entry) of every record kind, at
    decode (1 and 8 tokens: the one-program align kernel at 9 and 72 picks) and prefill sizes.
    int4 with the SwiGLU clamp of GLM models, the others without."""
    for kind, group in (("bf16", 0), ("int4", 128), ("int8", 128), ("int3", 128), ("int3", 32)):
        layout = expert_layout(kind, HIDDEN, INTER, group)
        with rec.tagged(f"fused_moe {kind} G{group} default configs"):
            for tokens in (1, 8, PREFILL_TOKENS):
                _moe(layout, tokens, swiglu_limit=10.0 if kind == "int4" else None)
            if kind == "int4":
                _moe(layout, 1, swiglu_limit=10.0, fp32_sum=True)


def fused_moe_k_tiles_spanning_groups(rec: Recorder) -> None:
    """int4 with groups of 32 (Q4_0 checkpoints) and the default tile shapes with K tiles of
    128 (decode) and 64 (prefill), each spanning several groups: the per-row scale path."""
    layout = expert_layout("int4", HIDDEN, INTER, 32)
    with rec.tagged("fused_moe int4 G32, K tiles spanning groups"):
        for tokens, bk in ((1, 128), (PREFILL_TOKENS, 64)):
            cfg = {stage: {**c, "BK": bk} for stage, c in fm.default_config(layout, tokens).items()}
            _moe(layout, tokens, config=cfg)


def fused_moe_gemv(rec: Recorder) -> None:
    """The few-token matrix-vector path (moe_gemv.py) for every record kind: K tiles within one
    group (G128) and spanning several (int4 G32), the SwiGLU clamp on int4; 1 and 4 tokens."""
    for kind, group, bk in (("bf16", 0, 128), ("int4", 128, 128), ("int4", 32, 128), ("int8", 128, 64),
                            ("int3", 128, 128), ("int3", 32, 128)):
        layout = expert_layout(kind, HIDDEN, INTER, group)
        gemv = {
            st: {"BN": 32, "BK": bk, "num_warps": 4, "num_stages": 4, "acc": acc}
            for st, acc in (("gate_up", "tile"), ("down", "row"))
        }  # both accumulator forms
        cfg = {**fm.default_config(layout, 1), "gemv": {**gemv, "max_tokens": 4}}
        with rec.tagged(f"fused_moe {kind} G{group} gemv"):
            for tokens in (1, 4):
                _moe(layout, tokens, config=cfg, swiglu_limit=10.0 if kind == "int4" else None)


def _layout_from_key(key: str):
    """Inverse of fused_moe.shape_key: 'int4/H4096/I2048/G128' -> ExpertLayout."""
    kind, h, i, g = key.split("/")
    return expert_layout(kind, int(h[1:]), int(i[1:]), int(g[1:]))


def fused_moe_tuned(rec: Recorder) -> None:
    """Every configuration tuned in configs.json, on its device's target only."""
    devices = json.loads(fm.CONFIG_PATH.read_text()).get("devices", {})
    for device, shapes in devices.items():
        if device not in TUNED_DEVICE_TARGETS:
            raise KeyError(f"configs.json has configs tuned for {device!r}: add its target to TUNED_DEVICE_TARGETS")
        for key, buckets in shapes.items():
            for bucket, cfg in buckets.items():
                # decode: T=1, and past a matrix-vector entry's max_tokens so the block config compiles too
                tokens = (
                    [PREFILL_TOKENS]
                    if bucket != "decode"
                    else [1]
                    + ([cfg["gemv"]["max_tokens"] + 1] if "gemv" in cfg and cfg["gemv"]["max_tokens"] < 16 else [])
                )
                with rec.tagged(f"fused_moe {key} {bucket} tuned for {device}", (TUNED_DEVICE_TARGETS[device],)):
                    for t in tokens:
                        _moe(_layout_from_key(key), t, config=cfg)


def paged_attention(rec: Recorder) -> None:
    """Decode attention of a 32/4-head, D=128 model (bf16), and of the embedded default model
    (9/3 heads, D=64) in bf16 and in fp32 (exact fp32 dots); 16-token pages, 4096 positions."""
    page, max_blocks, batch = 16, 256, 4
    for hq, hk, dim, dtype in ((32, 4, 128, torch.bfloat16), (9, 3, 64, torch.bfloat16), (9, 3, 64, torch.float32)):
        q = torch.zeros(batch, hq, dim, dtype=dtype)
        kv = torch.zeros(8 * page, hk, dim, dtype=dtype)
        table = torch.zeros(batch, max_blocks, dtype=torch.int32)
        lens = torch.ones(batch, dtype=torch.int32)
        with rec.tagged(f"paged attention Hq{hq}/Hk{hk}/D{dim} {str(dtype)[6:]}"):
            paged_decode_attention(q, kv, kv, table, lens, dim**-0.5, page)


def expert_cache(rec: Recorder) -> None:
    """One layer's cache step at 1 and 16 tokens (128 picks: the largest step moe/device_cache
    runs), then the record gather with each chunk size the bandwidth probe sweeps (a 2 MiB
    record: a multiple of them all)."""
    record = 2 << 20
    slots = torch.empty(64, 16, dtype=torch.uint8)  # stands in for GPU slots: only the address is used
    scratch = torch.empty(64, 16, dtype=torch.uint8)
    host = torch.arange(EXPERTS, dtype=torch.int64) * record
    cache = ExpertCache(
        host,
        slots.data_ptr(),
        64,
        record,
        extra_ptrs=torch.zeros(1, dtype=torch.int64),
        max_picks=128,
        scratch_base=scratch.data_ptr(),
        scratch_slots=64,
        lane_max=4,
    )
    with rec.tagged("expert cache step + gather"):
        cache.zero_addr = scratch.data_ptr()  # a real (64-bit) address, as the all-zero record's is
        for lane in (0, 4):  # exact mode, and fast mode's lane choice
            cache.lane_max = lane
            for tokens in (1, 16):
                cache.step((torch.arange(tokens)[:, None] + torch.arange(TOP_K)[None, :]) % EXPERTS, lane=lane > 0)
        for chunk in (4096, 16384, 32768):
            gather_records(cache.copy_src, cache.copy_dst, cache.n_copy, record, chunk_bytes=chunk)


class LowAddressMailbox(Mailbox):
    """A mailbox whose raw addresses lie below 2**31, as CPU tensors do in a Python built without
    PIE (its heap follows the executable): Triton types such integer arguments int32."""

    def _req_addr(self, slot: int) -> int:
        return 0x1000_0000 + slot * 0x10_0000

    def _res_addr(self, slot: int) -> int:
        return 0x2000_0000 + slot * 0x10_0000

    def _ctrl_addr(self, slot: int) -> int:
        return 0x3000_0000 + slot * 128

    def _meta_addr(self, slot: int) -> int:
        return 0x3100_0000 + slot * 0x1000


def mailbox(rec: Recorder) -> None:
    """post (with and without side data) and wait_add with bf16 and fp32 rows, through the
    inline-PTX path a CUDA mailbox takes; with 64-bit addresses and with addresses below 2**31
    (the recorded addresses are this Python's own: either kind, whichever it has)."""
    for mb_class, where in ((Mailbox, "this process's addresses"), (LowAddressMailbox, "addresses below 2**31")):
        mb = mb_class(2, HIDDEN, 16, "cpu", meta_words=4 + 2 * 16 * TOP_K)
        mb._asm = True  # a mailbox on a CUDA device publishes and polls with inline PTX (CPU: atomics)
        with rec.tagged(f"mailbox post + wait_add, {where}"):
            for dtype in (torch.bfloat16, torch.float32):
                x = torch.zeros(4, HIDDEN, dtype=dtype)
                mb.post(0, x)
                mb.post(1, x, torch.zeros(4 + 2 * 4 * TOP_K, dtype=torch.int32))
                mb.wait_add(0, x)


class LowAddressResidency(ResidencyMailbox):
    """A residency mailbox whose raw addresses lie below 2**31 (see LowAddressMailbox)."""

    def _ctrl_addr(self) -> int:
        return 0x3000_0000

    def _req_addr(self) -> int:
        return 0x3100_0000

    def _ans_addr(self) -> int:
        return 0x3200_0000


def residency(rec: Recorder) -> None:
    """The disk tier's request, wait, answer and hint kernels for a step of 1 and 16 tokens (128 picks), through
    the inline-PTX path a CUDA device takes, with 64-bit addresses and with addresses below 2**31."""
    tables = [(torch.zeros(EXPERTS, dtype=torch.int64), torch.zeros(EXPERTS, dtype=torch.int64),
               torch.full((EXPERTS,), -1, dtype=torch.int32)) for _ in range(2)]
    for mb_class, where in ((ResidencyMailbox, "this process's addresses"), (LowAddressResidency, "below 2**31")):
        mb = mb_class(tables, max_picks=128, max_answers=256, zero_addr=tables[0][0].data_ptr(), device="cpu")
        mb._asm = True
        with rec.tagged(f"residency ensure, {where}"):
            for tokens in (1, 16):
                picks = (torch.arange(tokens)[:, None] + torch.arange(TOP_K)[None, :]) % EXPERTS
                mb.ensure(1, picks)
                mb.hint_next(0, picks)


SCENARIOS = (
    fused_moe_defaults,
    fused_moe_k_tiles_spanning_groups,
    fused_moe_gemv,
    fused_moe_tuned,
    paged_attention,
    expert_cache,
    mailbox,
    residency,
    mhc,
    mhc_fused,
    router,
    kda_decode,
    dsa_decode,
)


def record() -> tuple[list[Launch], list[str]]:
    """Every launch of every scenario (JITFunction.run swapped for the recorder meanwhile)."""
    rec, errors = Recorder(), []

    def recorded_run(kernel, *args, grid, warmup, **kwargs):
        rec.run(kernel, *args, grid=grid, warmup=warmup, **kwargs)

    JITFunction.run = recorded_run
    try:
        for scenario in SCENARIOS:
            try:
                scenario(rec)
            except Exception:  # noqa: BLE001 - reported, and the other scenarios still run
                errors.append(f"{scenario.__name__}: {traceback.format_exc(limit=4)}")
    finally:
        JITFunction.run = _REAL_RUN
    return rec.launches, errors


# ----------------------------------------------------------------------------- variants


_DTYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.int8: "i8",
    torch.bool: "i1",
}


def _arg_type(value, specialize: bool = True) -> str:
    """What Triton specialises a runtime argument on: its type, 16-alignment, and ints equal to 1
    (only its type for parameters marked do_not_specialize)."""
    if isinstance(value, torch.Tensor):
        dtype = _DTYPES.get(value.dtype, str(value.dtype))
        return f"*{dtype}" + ("" if value.data_ptr() % 16 == 0 else " (unaligned)")
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        if value == 1 and specialize:
            return "1"
        kind = "i32" if -(2**31) <= value < 2**31 else "i64" if -(2**63) <= value < 2**63 else "u64"
        return kind + (":16" if value % 16 == 0 and specialize else "")
    if isinstance(value, float):
        return "fp32"
    return repr(value)


def describe(launch: Launch) -> tuple[str, tuple]:
    """(human-readable variant, dedupe key): runtime argument types, constexprs and options."""
    fn = launch.kernel
    names = [p.name for p in fn.params]
    bound = inspect.signature(fn.fn).bind(*launch.args, **{k: v for k, v in launch.kwargs.items() if k in names})
    bound.apply_defaults()
    types = [
        f"{p.name}: {_arg_type(bound.arguments[p.name], not p.do_not_specialize)}"
        for p in fn.params
        if not p.is_constexpr
    ]
    consts = [f"{p.name}={bound.arguments[p.name]!r}" for p in fn.params if p.is_constexpr]
    opts = [f"{k}={v!r}" for k, v in sorted(launch.kwargs.items()) if k not in names]
    text = f"{launch.name}[{', '.join(opts)}]({', '.join(consts)}) ({', '.join(types)})"
    return text, (launch.name, tuple(types), tuple(consts), tuple(opts))


def distinct(launches: list[Launch]) -> list[tuple[str, Launch]]:
    """One launch per distinct variant; the targets of duplicates are merged."""
    seen: dict[tuple, tuple[str, Launch]] = {}
    for launch in launches:
        text, key = describe(launch)
        if key in seen:
            seen[key][1].targets |= launch.targets
        else:
            seen[key] = (text, Launch(launch.kernel, launch.args, launch.kwargs, launch.scenario, set(launch.targets)))
    return list(seen.values())


# ----------------------------------------------------------------------------- compile


class TargetDriver:
    """The part of a GPU driver that JITFunction.run asks before compiling: which GPU is current."""

    def __init__(self, capability: int) -> None:
        self.capability = capability

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.capability, 32)

    def get_current_device(self) -> int:
        return self.capability  # one kernel cache per target

    def get_current_stream(self, device: int) -> int:
        return 0


def error_text(exc: BaseException) -> str:
    """The exception and its causes, innermost (the reason) first; each is cut to its first
    line and the last three (for a CompilationError: where, and the offending source line)."""
    chain: list[BaseException] = []
    while exc is not None and len(chain) < 8:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    parts = []
    for e in reversed(chain):
        lines = str(e).strip().splitlines() or [""]
        lines = lines if len(lines) <= 4 else [lines[0], "...", *lines[-3:]]
        parts.append(f"{type(e).__name__}: " + "\n    ".join(lines))
    return "\n".join(parts)[:4000]


_VARIANTS: list[tuple[str, Launch]] = []  # filled before the worker processes fork


def compile_one(task: tuple[int, str]) -> dict:
    """Compile variant `index` for `target` through Triton's launch path (warmup: no launch)."""
    index, target = task
    text, launch = _VARIANTS[index]
    driver.set_active(TargetDriver(TARGETS[target]))
    row = {"kernel": launch.name, "variant": text, "scenario": launch.scenario, "target": target}
    start = time.perf_counter()
    try:
        kernel = _REAL_RUN(launch.kernel, *launch.args, grid=(1,), warmup=True, **launch.kwargs)
        row.update(shared=int(kernel.metadata.shared), error=None)
    except Exception as exc:  # noqa: BLE001 - a compile error is the finding
        row.update(shared=None, error=error_text(exc))
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def compile_all(variants: list[tuple[str, Launch]], processes: int, targets: list[str]) -> list[dict]:
    _VARIANTS[:] = variants
    tasks = [(i, t) for i, (_, launch) in enumerate(variants) for t in targets if t in launch.targets]
    tasks.sort(key=lambda task: variants[task[0]][1].name != "_moe_gemm_kernel")  # the slow ones first
    if processes <= 1:
        return [compile_one(task) for task in tasks]
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        return list(pool.imap_unordered(compile_one, tasks))


def main(out_path: str, targets: list[str]) -> None:
    if os.environ.get("TRITON_INTERPRET") != "0":  # read when the kernels were decorated, at import
        sys.exit("run with TRITON_INTERPRET=0: the kernels must be compiled, not interpreted")
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        sys.exit(f"unknown targets {unknown}: {sorted(TARGETS)}")
    launches, errors = record()
    variants = distinct(launches)
    results = compile_all(variants, processes=min(8, os.cpu_count() or 1), targets=targets)
    report = {
        "targets": list(targets),
        "triton": triton.__version__,
        "launches": len(launches),
        "variants": len(variants),
        "errors": errors,
        "results": results,
    }
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":  # OUT.json [TARGETS, comma-separated; default all]
    main(sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 else list(TARGETS))
