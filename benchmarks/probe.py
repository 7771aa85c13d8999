"""Device probes: the bandwidths a hardware floor is computed from, and per-kernel GPU time.

Measured on the GPU at hand, in the same process as the work they judge:
  - HBM: a 1 GiB device-to-device copy (bytes read + written over time);
  - pinned host -> GPU through the copy engine (a whole layer pool, and record by record);
  - zero-copy read: the gather kernel streaming records from pinned host memory into HBM,
    over a small sweep of its launch parameters (the best one is returned for reuse);
  - bf16 matmul rate (8192^3), for compute floors.
"""

from __future__ import annotations

import torch

from tiermoe.kernels.triton.cache_manager import gather_records


def timed(fn) -> float:
    """Seconds of GPU time for fn() (CUDA events around it)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3


def _gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


def measure_bandwidth(pool: torch.Tensor, r: int) -> dict:
    """Probe this GPU with pool = uint8 [E, r] pinned host records. GB/s and TFLOP/s."""
    dev = torch.device("cuda")
    n = 2**30
    a = torch.empty(n, dtype=torch.uint8, device=dev).random_()
    b = torch.empty_like(a)
    b.copy_(a)
    hbm = _gbps(2 * n * 10, timed(lambda: [b.copy_(a) for _ in range(10)]))
    del a, b
    e_n = pool.shape[0]
    dst = torch.empty(e_n, r, dtype=torch.uint8, device=dev)
    dst.copy_(pool, non_blocking=True)
    whole = _gbps(e_n * r, timed(lambda: dst.copy_(pool, non_blocking=True)))
    m = min(64, e_n)
    per_rec = _gbps(m * r, timed(lambda: [dst[i].copy_(pool[i], non_blocking=True) for i in range(m)]))
    src = torch.tensor([pool.data_ptr() + i * r for i in range(m)], dtype=torch.int64, device=dev)
    dsts = torch.tensor([dst.data_ptr() + i * r for i in range(m)], dtype=torch.int64, device=dev)
    cnt = torch.tensor([m], dtype=torch.int32, device=dev)
    dst[:m].zero_()
    gather_records(src, dsts, cnt, r)
    ok = bool(torch.equal(dst[:m], pool[:m].to(dev)))
    sweep = {}  # gather kernel launch: the zero-copy read rate it reaches decides decode speed
    for chunk in (4096, 16384, 32768):
        for progs in (132, 264, 528):
            if r % chunk:
                continue
            g = dict(chunk_bytes=chunk, programs=progs, num_warps=8)
            gather_records(src, dsts, cnt, r, **g)
            sec = timed(lambda: [gather_records(src, dsts, cnt, r, **g) for _ in range(3)]) / 3
            sweep[f"{chunk}/{progs}"] = _gbps(m * r, sec)
    best = max(sweep, key=sweep.get)
    chunk, progs = (int(x) for x in best.split("/"))
    del dst
    x = torch.randn(8192, 8192, device=dev).to(torch.bfloat16)
    x @ x
    tf = 2 * 8192**3 * 5 / timed(lambda: [x @ x for _ in range(5)]) / 1e12
    del x
    torch.cuda.empty_cache()
    return {"hbm_copy_GBps": hbm, "h2d_pinned_GBps": whole, "h2d_pinned_per_record_GBps": per_rec,
            "zero_copy_read_GBps": sweep[best], "zero_copy_verified": ok, "bf16_matmul_TFLOPs": tf,
            "gather_sweep_GBps": sweep, "gather": {"chunk": chunk, "programs": progs, "warps": 8}}


def kernel_times(fn, reps: int = 3) -> dict:
    """GPU microseconds per call of fn(), by kernel name (torch profiler); a diagnostic."""
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        out = {}
        for evt in prof.key_averages():
            us = evt.device_time_total  # microseconds on the GPU (torch >= 2.4)
            if us:
                out[evt.key[:60]] = round(us / reps, 1)
        return dict(sorted(out.items(), key=lambda kv: -kv[1])[:12])
    except Exception as exc:  # never fatal
        return {"error": str(exc).splitlines()[0][:200]}
