"""Shared by the Triton-backed MoE tests (test_triton_backend.py, test_mixed_triton.py, test_device_cache.py).

Import it before anything that imports Triton: on CPU (CI) it switches Triton to its
interpreter, with CPU tensors standing in for device memory; TIERMOE_KERNEL_TESTS_ON_GPU=1 runs
the same tests compiled on CUDA instead.
"""

from __future__ import annotations

import os

ON_GPU = os.environ.get("TIERMOE_KERNEL_TESTS_ON_GPU") == "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
GIB = 2**30
N_EXPERTS = 16  # tiny glm4_moe: 2 MoE layers (1, 2) x 8 experts, top-2, H 64, I 32
LAYERS = (1, 2)


def tiny_glm4_stores(tiny_dir, tmp_path_factory, tag: str) -> dict:
    """{kind: (store dir, record bytes)} for int4 (G 32) and bf16 packs of tiny glm4_moe."""
    from tiermoe.store.pack import pack

    src = tiny_dir("glm4_moe", "bfloat16")
    out = {}
    for kind in ("int4", "bf16"):
        dst = tmp_path_factory.mktemp(tag) / f"glm4-{kind}"
        pack(str(src), str(dst), quant=kind, group_size=32, progress=False, log=lambda _: None)
        out[kind] = (dst, 4096 if kind == "int4" else 12288)
    return out


def moe_batch(tokens: int, seed: int, k: int = 2):
    """x [T, 64] bf16, distinct picks [T, k] among 8 experts, fp32 weights [T, k] on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 64, generator=g).to(torch.bfloat16)  # [T, H]
    ids = torch.stack([torch.randperm(8, generator=g)[:k] for _ in range(tokens)])  # [T, k]
    w = torch.rand(tokens, k, generator=g)  # [T, k] fp32, as the sigmoid router gives
    return x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE)


def engine_logits_and_counters(path, prompt: list[int], options: dict) -> tuple[torch.Tensor, dict]:
    """The real engine on a store: logits [2P, V] of `prompt` prefilled in one chunk, then one
    token at a time (decode-shaped steps), and the expert backend's counters afterwards."""
    from tiermoe.engine.build import build_engine_core
    from tiermoe.eval.parity import engine_logits

    eng = build_engine_core(str(path), device=DEVICE, dtype="bfloat16", max_num_seqs=1, options=options)
    be = eng.model.expert_backend
    try:
        out = torch.cat([engine_logits(eng, prompt, chunk=len(prompt)), engine_logits(eng, prompt, chunk=1)])
        return out, be.counters()
    finally:
        be.close()


def run_trace(store, backend, trace) -> tuple[list[torch.Tensor], tuple[int, int, int]]:
    """Each (layer, tokens, seed) of `trace` through `backend` on `store` as one step: the outputs (on
    the CPU) and the store's (slot hits, host hits, disk reads) after them."""
    outs = []
    for layer, tokens, seed in trace:
        store.begin_step(tokens=tokens, decode=tokens == 1)
        outs.append(backend.forward(layer, *moe_batch(tokens, seed)).cpu())
    c = store.counters()
    return outs, (c["slots"]["hits"], c["host"]["hits"], c["disk"]["reads"])


def open_store(path, **kw):
    """An ExpertStore on the tests' device; on a GPU, once its host arena is pinned (zero-copy reads
    need that, and a background thread pins it)."""
    from tiermoe.store.facade import ExpertStore

    st = ExpertStore.open(path, device=DEVICE, dtype=torch.bfloat16, reader_threads=2, **kw)
    if ON_GPU and st._host.n:
        assert st.wait_pinned()
    return st


def tier_budgets(rec: int) -> dict[str, dict]:
    """Tier configurations as GiB flags (rec: a tier entry's bytes): every expert in slots, ~10 % in
    slots, host only, disk only."""
    return {
        "100%": dict(gpu_expert_gb=N_EXPERTS * rec / GIB, host_expert_gb=0),
        "10%": dict(gpu_expert_gb=2 * rec / GIB, host_expert_gb=3 * rec / GIB),
        "0% host": dict(gpu_expert_gb=0, host_expert_gb=N_EXPERTS * rec / GIB),
        "0% disk": dict(gpu_expert_gb=0, host_expert_gb=0),
    }


def kernel_bf16(t: torch.Tensor) -> torch.Tensor:
    """fp32 t -> the bf16 the fused kernel stores for it: rounded to nearest even when compiled (torch's cast),
    truncated in Triton's interpreter (its float cast drops the low bits). A backend's partial=True result
    rounded so equals its partial=False result on either."""
    if ON_GPU:
        return t.to(torch.bfloat16)
    return (t.view(torch.int32) & -(1 << 16)).view(torch.float32).to(torch.bfloat16)  # exact: low bits zero


def rel_err(a, b) -> float:
    """Relative Frobenius error of a against b."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
