#!/usr/bin/env python3
"""Machine facts and the bandwidths the decode floor needs, measured on this machine.

python3 scripts/sbs/probe.py OUT.json [--threads N]

- hbm_gbs: device-to-device copy of 2 GiB (bytes read + written) / time, median of 10
- pcie_gbs: pinned host -> device copy of 1 GiB / time, median of 10
- host_read_gbs: one pass of N threads over 8 GiB (--host-gib) of ordinary host memory (torch sum) / time,
  median of 5: the most expert bytes per second a CPU can read, hence compute through
Also records GPU name, driver, CUDA, torch, CPU count, memory and disk figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import time


def _median_time(fn, reps: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _smi(query: str) -> str:
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def probe(threads: int, host_gib: float = 8.0) -> dict:
    import torch

    out: dict = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpus": os.cpu_count(),
        "threads": threads,
        "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "kernel": platform.release(),
    }
    for path in ("/", "/root", "/dev/shm", "/tmp"):
        if os.path.exists(path):
            du = shutil.disk_usage(path)
            out[f"free_gib:{path}"] = round(du.free / 2**30, 1)
    torch.set_num_threads(threads)
    host = torch.ones(int(host_gib * 2**30) // 8, dtype=torch.int64)
    t = _median_time(lambda: host.sum(), 5, lambda: None)
    out["host_read_gbs"] = round(host.numel() * 8 / t / 1e9, 1)
    del host
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        out["gpu"] = torch.cuda.get_device_name(dev)
        out["driver"] = _smi("driver_version")
        out["gpu_memory_total"] = _smi("memory.total")
        a = torch.empty(2 * 2**30, dtype=torch.uint8, device=dev)
        b = torch.empty_like(a)
        t = _median_time(lambda: b.copy_(a), 10, torch.cuda.synchronize)
        out["hbm_gbs"] = round(2 * a.numel() / t / 1e9, 1)
        del a, b
        h = torch.empty(2**30, dtype=torch.uint8).pin_memory()
        d = torch.empty(2**30, dtype=torch.uint8, device=dev)
        t = _median_time(lambda: d.copy_(h, non_blocking=True), 10, torch.cuda.synchronize)
        out["pcie_gbs"] = round(h.numel() / t / 1e9, 1)
        del h, d
        torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--host-gib", type=float, default=8.0, help="host buffer read for host_read_gbs")
    a = ap.parse_args()
    data = probe(a.threads, a.host_gib)
    with open(a.out, "w") as f:
        json.dump(data, f, indent=1)
    print(json.dumps(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
