"""Every Triton kernel the package launches compiles for the GPUs it runs on, within their shared memory.

Why: the other kernel tests run through Triton's interpreter, which never compiles a kernel, so
errors that only the compiler raises pass there. One did: a `@triton.jit` helper returning
tensors of two shapes under a constexpr `if` passed every interpreter test and failed to
compile on the GPU (the compiler wants one return type per function). A launch configuration that needs more
shared memory than a card allows per block fails only on that card, at its first launch.

So each launch the package's wrappers make (recorded with their real argument types and
launch configurations, see _aot_compile.py) is compiled ahead of time, down to a cubin, for
  sm_90  H100 / H200: the default configurations and those tuned for these devices in
         configs.json, within 227 KiB of shared memory per block;
  sm_89 / sm_86  RTX 4090 / RTX 3090, the 24 GB cards users own: the default
         configurations (no tuned entry), within 99 KiB per block.
This needs Triton's CUDA backend and its ptxas, no GPU. Every compilation (kernel, target,
shared memory, seconds, launch) is printed as a table: `pytest -rP` shows it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tiermoe

HELPER = Path(__file__).with_name("_aot_compile.py")
SHARED_LIMIT = {"sm_90": 232448, "sm_89": 101376, "sm_86": 101376}  # bytes per block (opt-in maximum)
PACKAGE = Path(tiermoe.__file__).parent
_JIT_DEF = re.compile(r"^@triton\.jit\b.*\n(?:@.*\n)*def (\w+)\(", re.MULTILINE)
_KERNEL_DEF = re.compile(r"^def (_\w*_kernel)\(", re.MULTILINE)


def _cannot_compile_for_cuda() -> str | None:
    """Why the installed Triton cannot build CUDA kernels on this machine, or None if it can."""
    try:
        import triton
        from triton import knobs
        from triton.backends import backends
    except ImportError as exc:
        return f"Triton is not usable here ({exc})"
    if "nvidia" not in backends:
        return f"Triton {triton.__version__} has no CUDA backend"
    try:
        knobs.nvidia.ptxas.version  # noqa: B018 - finding ptxas runs `ptxas --version`
    except (RuntimeError, OSError) as exc:
        return f"Triton {triton.__version__} has no working ptxas ({exc})"
    return None


def _table(results: list[dict]) -> str:
    rows = sorted(results, key=lambda r: (r["kernel"], r["target"], r["variant"]))
    lines = [f"{'kernel':<22} {'target':<6} {'shared':>7} {'s':>6}  variant"]
    for r in rows:
        shared = "FAILED" if r["error"] else r["shared"]
        lines.append(f"{r['kernel']:<22} {r['target']:<6} {shared:>7} {r['seconds']:>6}  {r['variant'][:160]}")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """Record and compile every launch (one subprocess: it must import Triton with the
    interpreter off), in a Triton cache of its own."""
    reason = _cannot_compile_for_cuda()
    if reason:
        pytest.skip(f"cannot compile CUDA kernels offline: {reason}")
    tmp = tmp_path_factory.mktemp("compile_targets")
    out = tmp / "report.json"
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp / "triton-cache")}
    cmd = [sys.executable, str(HELPER), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, f"{HELPER.name} failed:\n{proc.stderr[-6000:]}"
    rep = json.loads(out.read_text())
    print(_table(rep["results"]))
    return rep


def launched_kernels() -> set[str]:
    """The package's kernels: @triton.jit functions launched with a grid (`name[grid](...)`),
    and every `def _..._kernel` of kernels/triton."""
    texts = [p.read_text() for p in PACKAGE.rglob("*.py")]
    jitted = {m.group(1) for text in texts for m in _JIT_DEF.finditer(text)}
    launched = {name for name in jitted if any(re.search(rf"\b{name}\[", text) for text in texts)}
    sources = (PACKAGE / "kernels" / "triton").glob("*.py")
    named = {m.group(1) for p in sources for m in _KERNEL_DEF.finditer(p.read_text())}
    return launched | named


def test_wrappers_record_their_launches(report):
    assert not report["errors"], "calling a kernel wrapper raised:\n\n" + "\n\n".join(report["errors"])


def _failures(results: list[dict]) -> str:
    """Failed compilations grouped by kernel and error: the error once, then where it happened."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        groups.setdefault((r["kernel"], r["error"]), []).append(r)
    out = []
    for (kernel, error), rows in sorted(groups.items()):
        targets = ", ".join(sorted({r["target"] for r in rows}, reverse=True))
        launches = sorted({f"    {r['scenario']}: {r['variant']}" for r in rows})
        out.append(f"{kernel} does not compile for {targets}:\n  " + error.replace("\n", "\n  ") + "\n  launches:\n"
                   + "\n".join(launches))  # fmt: skip
    return "\n\n".join(out)


def test_every_launch_compiles_for_each_target(report):
    failed = [r for r in report["results"] if r["error"]]
    assert not failed, f"{len(failed)} of {len(report['results'])} compilations failed:\n\n{_failures(failed)}"


def test_shared_memory_fits_each_target(report):
    over = [r for r in report["results"] if r["shared"] is not None and r["shared"] > SHARED_LIMIT[r["target"]]]
    msg = "\n".join(
        f"{r['kernel']} on {r['target']}: {r['shared']} bytes of shared memory > {SHARED_LIMIT[r['target']]}"
        f" ({r['scenario']})\n  launch: {r['variant']}"
        for r in over
    )
    assert not over, f"launches that would fail with 'out of resource: shared memory':\n{msg}"


def test_every_launched_kernel_is_compiled(report):
    kernels = launched_kernels()
    assert {"_moe_gemm_kernel", "_split_kernel", "_cache_step_kernel", "_post_kernel"} <= kernels  # the scan works
    seen = {(r["kernel"], r["target"]) for r in report["results"]}
    missing = sorted(f"{k} for {t}" for k in kernels for t in report["targets"] if (k, t) not in seen)
    assert not missing, f"kernels never compiled (add their wrapper to _aot_compile.SCENARIOS): {', '.join(missing)}"
