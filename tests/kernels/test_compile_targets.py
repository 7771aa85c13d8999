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

Each Triton that users get runs the same checks: the installed one (the newest, with the
newest torch) for every target, and those the older supported torch versions pin (PINNED_TRITONS)
for sm_86 (PINNED_TARGETS), since a kernel can compile on one and not another. Why sm_86 alone
there: it is the 24 GB cards' target with the least shared memory (sm_89's limit is the same), and
the pinned Triton's sm_90 builds run on the GPU machine every time its test suite runs (its torch
pins that Triton); compiling all three doubled this check's time in the CI suite. A pinned Triton is installed once, alone (no dependencies:
one wheel from the package index), under ~/.cache/tiermoe/triton-VERSION (or
$TIERMOE_TRITON_CACHE/triton-VERSION, where a prepared copy may be put) and imported ahead of
the installed one by the compiling subprocess; torch is only used there for CPU tensors. Where
the index cannot be reached the check is skipped with the reason
(TIERMOE_REQUIRE_PINNED_TRITON=1 makes that a failure).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tiermoe

HELPER = Path(__file__).with_name("_aot_compile.py")
# Tritons that supported torch versions install besides the newest: torch 2.11 -> Triton 3.6
PINNED_TRITONS = ("3.6.0",)
PINNED_TARGETS = ("sm_86",)  # the pinned Tritons' targets (module doc)
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


def pinned_triton_site(version: str) -> Path:
    """A directory holding Triton `version` alone (installed with pip on first use, then reused);
    skips the test where it cannot be had (no package index), fails instead if asked to."""
    base = Path(os.environ.get("TIERMOE_TRITON_CACHE") or Path.home() / ".cache" / "tiermoe")
    site = base / f"triton-{version}"
    if (site / "triton" / "__init__.py").is_file():
        return site
    base.mkdir(parents=True, exist_ok=True)
    tmp = base / f".triton-{version}-{os.getpid()}"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(tmp),
           f"triton=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        why = f"cannot install triton=={version}: {(proc.stderr.strip().splitlines() or ['pip failed'])[-1]}"
        if os.environ.get("TIERMOE_REQUIRE_PINNED_TRITON") == "1":
            pytest.fail(why)
        pytest.skip(why)
    try:
        tmp.rename(site)  # whole or not at all (another run may have won the race: keep its copy)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    if not (site / "triton" / "__init__.py").is_file():
        pytest.fail(f"{site} exists but holds no Triton: remove it")
    return site


def _installed_triton() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


TRITONS = ["installed", *(pytest.param(v, marks=pytest.mark.slow, id=f"triton-{v}") for v in PINNED_TRITONS)]


@pytest.fixture(scope="module", params=TRITONS)
def report(request, tmp_path_factory) -> dict:
    """Record and compile every launch (one subprocess: it must import Triton with the
    interpreter off), in a Triton cache of its own, with the installed Triton or a pinned one."""
    reason = _cannot_compile_for_cuda()
    if reason:
        pytest.skip(f"cannot compile CUDA kernels offline: {reason}")
    version = request.param
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    if version != "installed":
        if _installed_triton() == version:
            pytest.skip(f"Triton {version} is the installed one (compiled by the 'installed' run)")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pinned_triton_site(version)), env.get("PYTHONPATH")]))
    tmp = tmp_path_factory.mktemp("compile_targets")
    out = tmp / "report.json"
    env["TRITON_CACHE_DIR"] = str(tmp / "triton-cache")
    cmd = [sys.executable, str(HELPER), str(out)] + ([] if version == "installed" else [",".join(PINNED_TARGETS)])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, f"{HELPER.name} failed:\n{proc.stderr[-6000:]}"
    rep = json.loads(out.read_text())
    assert version in ("installed", rep["triton"]), f"compiled with Triton {rep['triton']}, not the pinned {version}"
    print(f"Triton {rep['triton']}\n" + _table(rep["results"]))
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
                   + "\n".join(launches))
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
