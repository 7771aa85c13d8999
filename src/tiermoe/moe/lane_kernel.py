"""Where the CPU lane's compiled kernel comes from, and which cores its threads run on.

`lane_pool(threads, pin)` gives a kernels.cpu.native.LanePool, or None where the kernel cannot be
built or loaded (no C++ compiler, a failed build): the lane then computes with its plain-torch
twin, and one log line per process says why. The library is built once per source version and
compiler into $TIERMOE_KERNEL_DIR (default: tiermoe's cache root + /kernels); `make install`
builds it ahead (`python -m tiermoe.moe.lane_kernel`), otherwise the first fast-mode start does
(a few seconds).

Pinning: a lane beside a GPU owns the host's cores, so its workers are pinned one per physical
core (hyperthread siblings left out: two threads of one core share its load ports), taken in
turn from each NUMA node so that a pool smaller than the machine still draws on every node's
memory controllers. On a CPU device the lane shares the cores with the device path and is not
pinned.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

from tiermoe import env
from tiermoe.kernels.cpu import native

log = logging.getLogger("tiermoe.moe")

_STATE: dict[str, object] = {}  # "lib": ctypes.CDLL, or "error": why not (once per process)
_LOCK = threading.Lock()


def kernel_dir() -> Path:
    """$TIERMOE_KERNEL_DIR, else tiermoe's cache root ($TIERMOE_CACHE_DIR, $XDG_CACHE_HOME/tiermoe or
    ~/.cache/tiermoe) + /kernels."""
    explicit = env.KERNEL_DIR.get()
    if explicit is not None:
        return explicit
    root = env.CACHE_DIR.get() or (env.XDG_CACHE_HOME.get() or Path.home() / ".cache") / "tiermoe"
    return root / "kernels"


def native_library():
    """The loaded kernel library, or None (logged once with the reason)."""
    with _LOCK:
        if "lib" not in _STATE and "error" not in _STATE:
            try:
                _STATE["lib"] = native.load_library(native.build_library(kernel_dir()))
            except native.NativeUnavailable as exc:
                _STATE["error"] = str(exc)
                log.warning("CPU lane: compiled kernel unavailable (%s); the lane computes with the plain-torch "
                            "path, much slower", exc)
        return _STATE.get("lib")


def native_error() -> str | None:
    """Why the compiled kernel is not used (None: it is, or was not asked for yet)."""
    return _STATE.get("error")  # type: ignore[return-value]


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _cpulist(text: str) -> list[int]:
    out: list[int] = []
    for part in text.strip().split(","):
        if "-" in part:
            a, b = part.split("-")
            out.extend(range(int(a), int(b) + 1))
        elif part:
            out.append(int(part))
    return out


def physical_cores(sys_root: Path = Path("/sys/devices/system")) -> list[int]:
    """Usable logical CPUs, one per physical core, interleaved over NUMA nodes (node 0's first
    core, node 1's first, ..., node 0's second, ...)."""
    usable = sorted(os.sched_getaffinity(0))
    nodes: dict[int, list[int]] = {}
    for node_dir in sorted(sys_root.glob("node/node[0-9]*")):
        try:
            cpus = _cpulist((node_dir / "cpulist").read_text())
        except (OSError, ValueError):
            continue
        for cpu in cpus:
            nodes.setdefault(cpu, int(node_dir.name[4:]))
    seen: set[tuple[int, int]] = set()
    by_node: dict[int, list[int]] = {}
    for cpu in usable:
        topo = sys_root / "cpu" / f"cpu{cpu}" / "topology"
        core = (_read_int(topo / "physical_package_id") or 0, _read_int(topo / "core_id"))
        if core[1] is not None and core in seen:
            continue  # a hyperthread sibling of a core already listed
        seen.add(core)
        by_node.setdefault(nodes.get(cpu, 0), []).append(cpu)
    lists = [by_node[n] for n in sorted(by_node)]
    out: list[int] = []
    for i in range(max(map(len, lists), default=0)):
        out.extend(cpus[i] for cpus in lists if i < len(cpus))
    return out


def lane_threads_beside_gpu(torch_threads: int) -> int:
    """Lane threads beside a GPU: every physical core but one (at most `torch_threads`). The
    engine's thread waits for each decode step spinning on a core (CUDA's default wait); with a
    lane thread on every core one of them shares that core, and a lane step, which lasts as long
    as its slowest thread, then waits for the scheduler's time slices."""
    return max(1, min(len(physical_cores()), int(torch_threads)) - 1)


PINNED_SPIN_US = 5000  # a pinned pool's workers spin this long after a job before they sleep
SHARED_SPIN_US = 500


def lane_pool(threads: int, pin: bool, isa: str = "avx512bf16", beside_disk_reads: bool = False):
    """A LanePool of `threads` threads (pinned to physical cores when `pin`), or None where the
    compiled kernel is unavailable. A pinned pool owns its cores, so its workers spin longer
    between jobs: a decode step's MoE layers hand the lane a job every one or two milliseconds,
    and a job that finds a worker asleep waits for its wake-up (a futex call, tens of
    microseconds in a VM) before it can end. On shared cores they sleep sooner, and so they do
    `beside_disk_reads` (a disk tier serves some experts): decode layers then come about every
    10-15 ms (docs/results.md section 33: 4.5 tok/s over 16 layers), so a 5 ms spin never meets
    the next job, and it takes the cores the disk tier's reader threads need for their reads and
    the crc32 of each."""
    lib = native_library()
    if lib is None:
        return None
    cpus = physical_cores() if pin else None
    spin = PINNED_SPIN_US if pin and not beside_disk_reads else SHARED_SPIN_US
    return native.LanePool(lib, threads, cpus=cpus, isa=isa, spin_us=spin)


def main() -> int:
    """`python -m tiermoe.moe.lane_kernel`: build the kernel now (make install). Never fails the
    install: without a compiler the lane runs its plain-torch path, which this says."""
    try:
        lib = native.build_library(kernel_dir())
        native.load_library(lib)
        print(f"CPU lane kernel ready: {lib}")
    except native.NativeUnavailable as exc:
        print(f"CPU lane kernel not built ({exc}); fast mode's CPU lane will use the plain-torch path", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
