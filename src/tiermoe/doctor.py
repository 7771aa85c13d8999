"""`tiermoe doctor`: check this machine and say what tiermoe will do here, and why.

Where each expert can live depends on the hardware: a GPU gives a slot cache in VRAM, host RAM
(pinned when a GPU is there to DMA from it) holds the warm experts, the disk holds the rest and
is worth streaming from only if O_DIRECT reads are fast, and without a GPU a CPU engine computes
everything from RAM. The doctor measures the few numbers those choices hang on (GPU and VRAM,
available RAM under any cgroup limit, the memlock limit, CPU vector features, O_DIRECT support
and read speed of the cache disk) and prints them with the resulting plan. It never fails on a
missing capability: a check that cannot run says why. `--json` prints the same as one object.
"""

from __future__ import annotations

import argparse
import errno
import json
import mmap
import os
import resource
import shutil
import time
from pathlib import Path

GiB = 1 << 30
MiB = 1 << 20
_UNLIMITED = 1 << 60  # cgroup "no limit" values are near 2**63
CPU_FLAGS = (
    "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8",
)


# --------------------------------------------------------------------------- checks
def check_gpu() -> dict:
    """CUDA devices as torch sees them; if none, whether that is the hardware or the torch build."""
    try:
        import torch
    except ImportError as exc:  # torch is a dependency; say so rather than crash
        return {"available": False, "reason": f"torch not importable ({exc})", "devices": []}
    info: dict = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "devices": []}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            info["devices"].append(
                {
                    "index": i,
                    "name": p.name,
                    "capability": f"{p.major}.{p.minor}",
                    "vram_total_bytes": int(total),
                    "vram_free_bytes": int(free),
                    **pci_link(_pci_address(p)),
                }
            )
        info["available"] = True
        info["reason"] = f"{len(info['devices'])} CUDA device(s)"
    else:
        info["available"] = False
        has_nodes = any(Path("/dev").glob("nvidia[0-9]*"))
        if torch.version.cuda is None:
            present = " (an NVIDIA device is present)" if has_nodes else ""
            info["reason"] = "this torch build has no CUDA support" + present
        elif has_nodes:
            info["reason"] = "NVIDIA device present but CUDA is not usable (driver or permissions)"
        else:
            info["reason"] = "no NVIDIA GPU found"
    return info


def _pci_address(props) -> str | None:
    """The device's PCI address (domain:bus:device.0) from torch's properties; None where torch has none."""
    try:
        return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except AttributeError:  # an older torch
        return None


def pci_link(address: str | None, devices: Path = Path("/sys/bus/pci/devices")) -> dict:
    """A GPU's PCIe link and NUMA node from sysfs: each GPU copies its misses over its own link, and its
    pinned host pages are best on its own node. Values that cannot be read are None."""
    out: dict = {"pci": address, "numa_node": None, "link": None, "link_max": None}
    if address is None:
        return out
    folder = devices / address

    def read(name: str) -> str | None:
        try:
            return (folder / name).read_text().strip()
        except OSError:
            return None

    node = read("numa_node")
    out["numa_node"] = int(node) if node not in (None, "-1") and node.lstrip("-").isdigit() else None
    for key, prefix in (("link", "current"), ("link_max", "max")):
        speed, width = read(f"{prefix}_link_speed"), read(f"{prefix}_link_width")
        if speed and width:
            out[key] = f"{speed.split(' PCIe')[0]} x{width}"
    return out


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _cgroup_paths(v2_file: str, v1_controller: str, v1_file: str) -> list[Path]:
    """Candidate files for this process' cgroup (v2 unified first, then v1), most specific first."""
    rel_v2, rel_v1 = "", ""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hid, controllers, path = line.split(":", 2)
            if hid == "0" and controllers == "":
                rel_v2 = path.lstrip("/")
            elif v1_controller in controllers.split(","):
                rel_v1 = path.lstrip("/")
    except (OSError, ValueError):
        pass
    root = Path("/sys/fs/cgroup")
    cands = [root / rel_v2 / v2_file, root / v2_file]
    cands += [root / v1_controller / rel_v1 / v1_file, root / v1_controller / v1_file]
    return [p for p in cands if p.is_file()]


def cgroup_memory_limit() -> int | None:
    """Bytes this process' cgroup may use, or None when unlimited/unknown."""
    for path in _cgroup_paths("memory.max", "memory", "memory.limit_in_bytes"):
        try:
            raw = path.read_text().strip()
        except OSError:
            continue
        if raw == "max":
            return None
        value = int(raw)
        return None if value >= _UNLIMITED else value
    return None


def check_memory() -> dict:
    mi = _meminfo()
    limit = cgroup_memory_limit()
    available = mi.get("MemAvailable", 0)
    usable = min(available, limit) if limit is not None else available
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    as_int = lambda v: None if v == resource.RLIM_INFINITY else int(v)  # noqa: E731
    return {
        "total_bytes": mi.get("MemTotal", 0),
        "available_bytes": available,
        "cgroup_limit_bytes": limit,
        "usable_bytes": usable,
        "memlock_soft_bytes": as_int(soft),
        "memlock_hard_bytes": as_int(hard),
    }


def _cpu_quota() -> float | None:
    for path in _cgroup_paths("cpu.max", "cpu", "cpu.cfs_quota_us"):
        try:
            raw = path.read_text().split()
            if path.name == "cpu.max":
                if raw[0] == "max":
                    return None
                return int(raw[0]) / int(raw[1])
            quota = int(raw[0])
            period = int((path.parent / "cpu.cfs_period_us").read_text())
            return None if quota <= 0 else quota / period
        except (OSError, ValueError, IndexError):
            continue
    return None


def check_cpu() -> dict:
    flags: set[str] = set()
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.partition(":")[2].split())
            elif line.startswith("model name") and model == "unknown":
                model = line.partition(":")[2].strip()
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cpu_quota()
    return {
        "model": model,
        "cores": cores,
        "cgroup_cpu_quota": quota,
        "usable_cores": max(1, min(cores, int(quota))) if quota else cores,
        "flags": {f: f in flags for f in CPU_FLAGS},
    }


def _fstype(path: Path) -> str:
    """Filesystem type of the mount holding `path` (longest matching mount point)."""
    best, fstype = "", "unknown"
    target = str(path.resolve())
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3:
                mnt = parts[1].replace("\\040", " ")
                if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, fstype = mnt, parts[2]
    except OSError:
        pass
    return fstype


def check_disk(directory: Path, size_mib: int = 64) -> dict:
    """Write a temp file of `size_mib` in `directory`, then read it back with O_DIRECT (page cache
    bypassed, so the speed is the device's); if O_DIRECT is refused, drop the file's cached pages
    and read it buffered instead."""
    info: dict = {"path": str(directory), "test_bytes": size_mib * MiB}
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        info.update(ok=False, reason=f"cannot create {directory}: {exc.strerror}")
        return info
    info["fstype"] = _fstype(directory)
    info["free_bytes"] = shutil.disk_usage(directory).free
    chunk = 4 * MiB
    if info["free_bytes"] < size_mib * MiB * 2:
        info.update(ok=False, reason="not enough free space for the read test")
        return info
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT requires
    buf.write(os.urandom(chunk))
    path = directory / f".doctor-{os.getpid()}.tmp"
    try:
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for _ in range(size_mib * MiB // chunk):
                os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)
        info["write_mib_s"] = round(size_mib / (time.perf_counter() - t0), 1)
        info["o_direct"], info["o_direct_reason"] = _try_o_direct(path, buf)
        if info["o_direct"]:
            info["read_mode"] = "O_DIRECT"
            info["read_mib_s"] = round(_read_speed(path, buf, os.O_DIRECT, size_mib), 1)
        else:
            info["read_mode"] = "buffered (page cache dropped)"
            info["read_mib_s"] = round(_read_speed(path, buf, 0, size_mib, drop_cache=True), 1)
        info["ok"] = True
    except OSError as exc:
        info.update(ok=False, reason=f"disk test failed: {exc.strerror or exc}")
    finally:
        buf.close()
        path.unlink(missing_ok=True)
    return info


def _try_o_direct(path: Path, buf: mmap.mmap) -> tuple[bool, str]:
    if not hasattr(os, "O_DIRECT"):
        return False, "this platform has no O_DIRECT"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        return False, f"open(O_DIRECT) refused: {errno.errorcode.get(exc.errno, exc.errno)}"
    try:
        os.readv(fd, [memoryview(buf)[:4096]])
    except OSError as exc:
        return False, f"O_DIRECT read refused: {errno.errorcode.get(exc.errno, exc.errno)}"
    finally:
        os.close(fd)
    return True, "supported"


def _read_speed(path: Path, buf: mmap.mmap, flags: int, size_mib: int, drop_cache: bool = False) -> float:
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        if drop_cache and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        total = 0
        while (n := os.readv(fd, [buf])) > 0:
            total += n
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
    return total / MiB / max(dt, 1e-9)


# --------------------------------------------------------------------------- plan
def plan(report: dict) -> dict:
    """What tiermoe will do with this hardware, each decision with its reason."""
    gpu, mem, cpu, disk = report["gpu"], report["memory"], report["cpu"], report["disk"]
    decisions: list[dict] = []
    warnings: list[str] = []
    usable = mem["usable_bytes"]
    limit = mem["cgroup_limit_bytes"]
    limit_note = " (cgroup limit)" if limit is not None and limit <= mem["available_bytes"] else ""
    if gpu.get("available"):
        dev = gpu["devices"][0]
        decisions.append(
            {
                "what": f"GPU engine on {dev['name']}",
                "why": f"CUDA device with {dev['vram_free_bytes'] / GiB:.1f} GiB of VRAM free: attention, dense"
                " weights and the KV cache live there, the rest of VRAM becomes the expert slot cache",
            }
        )
        if len(gpu["devices"]) > 1:
            n = len(gpu["devices"])
            nodes = sorted({d.get("numa_node") for d in gpu["devices"] if d.get("numa_node") is not None})
            decisions.append(
                {
                    "what": f"{n} GPUs: `tiermoe serve --tensor-parallel-size {n}` gives each a share of every MoE "
                            "layer's experts",
                    "why": "each GPU has its own PCIe link for misses and its own VRAM for slots"
                           + (f"; NUMA nodes {', '.join(map(str, nodes))}" if nodes else ""),
                }
            )
        decisions.append(
            {
                "what": f"warm experts in pinned host RAM (up to ~{usable * 0.7 / GiB:.1f} GiB)",
                "why": f"{usable / GiB:.1f} GiB of RAM usable{limit_note}; pinned pages copy to the GPU at full"
                " PCIe speed; misses the GPU cannot hide are computed by the CPU lane",
            }
        )
    else:
        decisions.append({"what": "CPU engine; experts resident in RAM", "why": f"no GPU: {gpu.get('reason')}"})
        decisions.append(
            {
                "what": f"models up to ~{usable * 0.8 / GiB:.1f} GiB are held wholly in RAM",
                "why": f"{usable / GiB:.1f} GiB of RAM usable{limit_note}; larger ones keep cold experts on disk",
            }
        )
    if disk.get("ok"):
        speed = disk["read_mib_s"]
        if disk["o_direct"]:
            what = f"cold experts stream from disk with O_DIRECT (~{speed:.0f} MiB/s measured)"
            why = f"{disk.get('fstype')} at {disk['path']} accepts O_DIRECT, so reads bypass the page cache"
        else:
            what = f"cold experts read through the page cache (~{speed:.0f} MiB/s measured)"
            why = f"O_DIRECT unavailable on {disk.get('fstype')}: {disk.get('o_direct_reason')}"
        decisions.append({"what": what, "why": why})
        if disk.get("fstype") in ("tmpfs", "ramfs"):
            warnings.append(f"{disk['path']} is on {disk['fstype']}: a disk tier there would take RAM, not spare it")
        elif speed < 200:
            warnings.append(f"disk reads at {speed:.0f} MiB/s: models that do not fit in RAM will decode slowly")
    else:
        decisions.append({"what": "no disk tier", "why": disk.get("reason", "disk test did not run")})
    flags = cpu["flags"]
    if flags.get("avx512_bf16"):
        decisions.append(
            {"what": "CPU lane (fast mode) multiplies bf16 pairs in its compiled kernel",
             "why": "the CPU has AVX512-BF16: the records' weights meet bf16 activations with vdpbf16ps"}
        )
    elif flags.get("avx2"):
        decisions.append(
            {"what": "CPU lane (fast mode) upcasts bf16 weights to fp32 in its compiled kernel",
             "why": f"{'AVX-512' if flags.get('avx512f') else 'AVX2'} but no native bf16 dot products"}
        )
    else:
        warnings.append("CPU lacks AVX2: CPU compute will be very slow")
    decisions.append(
        {"what": f"{cpu['usable_cores']} CPU threads", "why": f"{cpu['cores']} cores visible"
         + (f", cgroup quota {cpu['cgroup_cpu_quota']:.1f}" if cpu["cgroup_cpu_quota"] else "")}
    )
    memlock = mem["memlock_soft_bytes"]
    if gpu.get("available") and memlock is not None and memlock < usable // 2:
        warnings.append(
            f"memlock limit is {memlock / MiB:.0f} MiB: if pinning host RAM fails, raise it"
            " (ulimit -l unlimited, or LimitMEMLOCK=infinity / --ulimit memlock=-1 for containers)"
        )
    if usable < 2 * GiB:
        warnings.append(f"only {usable / GiB:.1f} GiB of RAM usable: even the default model may not load")
    return {"decisions": decisions, "warnings": warnings}


def run_checks(disk_dir: Path | None = None, disk_mib: int = 64) -> dict:
    from tiermoe.default_model import cache_dir

    report = {"gpu": check_gpu(), "memory": check_memory(), "cpu": check_cpu()}
    if disk_mib > 0:
        report["disk"] = check_disk(disk_dir or cache_dir(), disk_mib)
    else:
        report["disk"] = {"ok": False, "reason": "skipped (--disk-mib 0)"}
    report["plan"] = plan(report)
    return report


# --------------------------------------------------------------------------- output
def _b(n: int | None) -> str:
    return "unlimited" if n is None else f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def render(report: dict) -> str:
    gpu, mem, cpu, disk, pl = (report[k] for k in ("gpu", "memory", "cpu", "disk", "plan"))
    lines = ["GPU"]
    if gpu.get("available"):
        for d in gpu["devices"]:
            link = d.get("link") or "unknown"
            lines.append(
                f"  cuda:{d['index']} {d['name']} (sm {d['capability']}): "
                f"{_b(d['vram_free_bytes'])} free of {_b(d['vram_total_bytes'])}; "
                f"PCIe link {link}{'' if d.get('link_max') in (None, link) else ' (max ' + d['link_max'] + ')'}, "
                f"NUMA node {'unknown' if d.get('numa_node') is None else d['numa_node']}"
            )
    else:
        lines.append(f"  none: {gpu.get('reason')}")
    lines += [
        "Memory",
        f"  RAM: {_b(mem['available_bytes'])} available of {_b(mem['total_bytes'])};"
        f" cgroup limit {_b(mem['cgroup_limit_bytes'])}; usable {_b(mem['usable_bytes'])}",
        f"  memlock limit: soft {_b(mem['memlock_soft_bytes'])}, hard {_b(mem['memlock_hard_bytes'])}",
        "CPU",
        f"  {cpu['model']}: {cpu['usable_cores']} usable core(s) of {cpu['cores']}",
        "  features: " + " ".join(f"{f}{'+' if on else '-'}" for f, on in cpu["flags"].items()),
        "Disk",
    ]
    if disk.get("ok"):
        lines.append(
            f"  {disk['path']} ({disk.get('fstype')}, {_b(disk['free_bytes'])} free):"
            f" O_DIRECT {disk['o_direct_reason']};"
            f" read {disk['read_mib_s']:.0f} MiB/s ({disk['read_mode']}), write {disk['write_mib_s']:.0f} MiB/s"
            f" over {disk['test_bytes'] // MiB} MiB"
        )
    else:
        lines.append(f"  {disk.get('path', '-')}: {disk.get('reason')}")
    lines.append("Plan")
    for d in pl["decisions"]:
        lines.append(f"  - {d['what']}: {d['why']}")
    for w in pl["warnings"]:
        lines.append(f"  ! {w}")
    return "\n".join(lines)


def _handle(args: argparse.Namespace) -> int:
    from tiermoe.errors import UserError

    if args.disk_mib < 0:
        raise UserError(f"--disk-mib must be >= 0 (got {args.disk_mib})")
    report = run_checks(Path(args.dir) if args.dir else None, args.disk_mib)
    if args.store:  # the tiers this store gets here: `tiermoe plan`'s table, its disk measured on the store
        from tiermoe.store.cli import plan_table

        report["store_plan"] = {"store": args.store, "table": plan_table(args.store)}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
        if args.store:
            print(f"Tiers for {args.store}\n" + report["store_plan"]["table"])
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("doctor", help="check this machine and print what tiermoe will do here",
                              description="Measure what decides where experts can live here (GPU and VRAM, "
                                          "available RAM under any cgroup limit, the memlock limit, CPU vector "
                                          "features, O_DIRECT support and read speed of the cache disk) and print "
                                          "the plan that follows. A check that cannot run says why; it never "
                                          "fails on a missing capability.")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--dir", default=None, help="directory for the disk test (default: tiermoe's cache dir)")
    p.add_argument("--disk-mib", type=int, default=64, help="size of the disk read test file in MiB (0: skip)")
    p.add_argument("--store", default=None, metavar="STORE",
                   help="a packed store (or checkpoint): also print its tier plan here, as `tiermoe plan STORE` "
                        "(experts per tier, hits per token, the decode bound, the store's disk rate measured)")
    p.set_defaults(handler=_handle)
