"""One rank of an expert-parallel group on the CPU (gloo), run as its own process by test_expert_parallel.py:

    python _rank.py RANK WORLD INIT_METHOD STORE DTYPE OUT [KIND]

It joins the group, builds the real engine on STORE with `tensor_parallel_size` WORLD under each tier budget of
BUDGETS[KIND], and saves {budget: (logits [2P, V], counters)} to OUT (torch.save). KIND "store" (the default,
the torch path) adds the one-line errors settling gives for what a rank does not serve and a failure agreed
by the ranks; "triton" runs the Triton kernels (under TRITON_INTERPRET=1 on the CPU): the store path and the
device cache over its disk tier, which holds the rank's share. KIND "partial" calls one MoE layer of each
backend of PARTS directly and saves {backend: `layer_parts`}: what the ranks' parts are and what the group
makes of them."""

from __future__ import annotations

import sys

import torch

PROMPT = [5, 17, 33, 64, 101, 250, 7, 300]
RECORD = 12288  # a bf16 record of the tiny glm4_moe (H 64, I 32)
GB = RECORD / 2**30
TRITON = {"expert_kernel": "triton"}
BUDGETS = {
    # as GiB flags: every expert in RAM; 2 slots and RAM for 3 (the rest read from disk)
    "store": {"ram": {"gpu_expert_gb": 0, "host_expert_gb": 16 * GB},
              "small": {"gpu_expert_gb": 2 * GB, "host_expert_gb": 3 * GB}},
    # the Triton store path; the device cache with 4 and 10 GPU records (staging rows included) over RAM
    "triton": {"store-triton": {**TRITON, "device_cache": "off", "gpu_expert_gb": 0, "host_expert_gb": 16 * GB},
               "cache-4": {**TRITON, "device_cache": "on", "gpu_expert_gb": 4 * GB, "host_expert_gb": 16 * GB},
               "cache-10": {**TRITON, "device_cache": "on", "gpu_expert_gb": 10 * GB, "host_expert_gb": 8 * GB}},
}

# the backends whose parts the "partial" run takes: the torch path, the Triton store path, the device cache
PARTS = {"store-torch": {"expert_kernel": "torch", **BUDGETS["store"]["ram"]},
         "store-triton": BUDGETS["triton"]["store-triton"], "device-cache": BUDGETS["triton"]["cache-4"]}


def logits_and_counters(store: str, dtype: str, options: dict) -> tuple[torch.Tensor, dict]:
    """Logits [2P, V] of PROMPT prefilled in one chunk, then a token a step, and the expert counters."""
    from tiermoe.engine.build import build_engine_core
    from tiermoe.eval.parity import engine_logits

    eng = build_engine_core(store, device="cpu", dtype=dtype, max_num_seqs=1, options=options)
    backend = eng.model.expert_backend
    try:
        logits = torch.cat([engine_logits(eng, PROMPT, chunk=len(PROMPT)), engine_logits(eng, PROMPT, chunk=1)])
        return logits, backend.counters()
    finally:
        backend.close()


def failure_is_agreed(store: str, dtype: str, world: int, rank: int) -> tuple[tuple[str, str] | None, torch.Tensor]:
    """Rank 1's part of a forward fails once (a checksum, injected): every rank raises at the step's end, rank
    0 naming rank 1; the next forward is served. Returns ((error type, message) or None, the next logits)."""
    from tiermoe.engine.build import build_engine_core
    from tiermoe.errors import StoreIntegrityError
    from tiermoe.eval.parity import engine_logits

    eng = build_engine_core(store, device="cpu", dtype=dtype, max_num_seqs=1,
                            options={"tensor_parallel_size": world, **BUDGETS["store"]["ram"]})
    backend = eng.model.expert_backend
    combine, failed = backend.inner.combine, []

    def flaky(layer, *args, **kw):
        if rank == 1 and layer == 1 and not failed:
            failed.append(layer)
            raise StoreIntegrityError("injected: layer 1 expert record failed its sha256 check")
        return combine(layer, *args, **kw)

    backend.inner.combine = flaky
    error = None
    try:
        engine_logits(eng, PROMPT, chunk=len(PROMPT))
        eng.runner.check_step()
    except Exception as exc:
        error = (type(exc).__name__, str(exc))
    try:
        logits = engine_logits(eng, PROMPT, chunk=len(PROMPT))
        eng.runner.check_step()
        return error, logits
    finally:
        backend.close()


def layer_parts(store: str, world: int, options: dict) -> dict[str, list[torch.Tensor]]:
    """MoE layer 1 of a 4-token decode step and a 20-token prefill chunk (staged by the device cache) through
    this rank's expert-parallel backend, called directly on the same inputs on every rank: {"out": the layer's
    bf16 output [T, H], "total": its partial=True output (fp32, the ranks' parts summed), "part": this rank's
    own part, its backend's partial=True output [T, H] over the rank's picks (others' at weight 0)}."""
    from tiermoe.engine.build import engine_config
    from tiermoe.moe.backends import open_expert_backend

    cfg = engine_config(store, device="cpu", dtype="bfloat16", max_num_seqs=8,
                        options={"tensor_parallel_size": world, **options})
    backend = open_expert_backend(cfg.experts)  # ExpertParallelExperts around the rank's backend
    g = torch.Generator().manual_seed(7)
    res: dict[str, list[torch.Tensor]] = {"out": [], "total": [], "part": []}
    try:
        for tokens in (4, 20):
            x = torch.randn(tokens, 64, generator=g).to(torch.bfloat16)  # [T, H]
            ids = torch.stack([torch.randperm(8, generator=g)[:4] for _ in range(tokens)])  # [T, 4] distinct
            w = torch.rand(tokens, 4, generator=g)  # [T, 4]
            backend.begin_step(tokens, decode=tokens == 4)
            res["out"].append(backend.forward(1, x, ids, w))
            res["total"].append(backend.forward(1, x, ids, w, partial=True))
            local, foreign = backend.localize(1, ids)  # [T, 4]
            res["part"].append(backend.inner.forward(1, x, local, w.masked_fill(foreign, 0), partial=True))
            backend.end_step()
        return res
    finally:
        backend.close()


def main(rank: int, world: int, init: str, store: str, dtype: str, out: str, kind: str = "store") -> None:
    from tiermoe.errors import UserError
    from tiermoe.parallel import join, leave

    join(rank, world, init, "cpu")
    try:
        results: dict = {}
        if kind == "partial":
            torch.save({name: layer_parts(store, world, options) for name, options in PARTS.items()}, out)
            return
        for name, budget in BUDGETS[kind].items():
            results[name] = logits_and_counters(store, dtype, {"tensor_parallel_size": world, **budget})
        if kind != "store":
            torch.save(results, out)
            return
        refused = []
        for options in ({"num_speculative_tokens": 1}, {"expert_kernel": "nope"}, {"tensor_parallel_size": world + 1}):
            try:
                logits_and_counters(store, dtype, {"tensor_parallel_size": world, **options})
                refused.append(None)
            except UserError as exc:
                refused.append(str(exc))
        results["refused"] = refused
        results["failure"] = failure_is_agreed(store, dtype, world, rank)
        results["fast"] = logits_and_counters(store, dtype, {"tensor_parallel_size": world, "mode": "fast",
                                                             "cpu_lane_experts": 2, **BUDGETS["store"]["ram"]})
        torch.save(results, out)
    finally:
        leave()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6], *sys.argv[7:])
