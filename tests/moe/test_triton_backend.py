"""Triton expert backend over a packed store: close to its plain-torch twins, bit-identical
across tier sizes, lane-skipped experts add exactly zero, selection rules.

On CPU (CI) the kernels run through Triton's interpreter with CPU tensors standing in for device
memory, as in tests/kernels. TIERMOE_KERNEL_TESTS_ON_GPU=1 runs the same tests compiled on
CUDA (stores then hold slots on the GPU and host entries pinned, read in place).
"""

from __future__ import annotations

import os

ON_GPU = os.environ.get("TIERMOE_KERNEL_TESTS_ON_GPU") == "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import random  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tiermoe.errors import UserError  # noqa: E402
from tiermoe.kernels import reference as R  # noqa: E402
from tiermoe.moe.experts import combine_experts  # noqa: E402
from tiermoe.moe.tiered import TieredExperts  # noqa: E402
from tiermoe.moe.triton_backend import TritonExperts, choose_expert_kernel, triton_unsupported  # noqa: E402
from tiermoe.store.facade import ExpertStore  # noqa: E402
from tiermoe.store.pack import pack  # noqa: E402

GIB = 2**30
N_EXPERTS = 16  # tiny glm4_moe: 2 MoE layers (1, 2) x 8 experts, top-2, H 64, I 32
LAYERS = (1, 2)
DEVICE = "cuda" if ON_GPU else "cpu"


def _budgets(rec: int) -> dict[str, dict]:
    """Tier configurations as GiB flags: 100 %, ~10 % of the experts in slots, 0 %."""
    return {
        "100%": dict(gpu_expert_gb=N_EXPERTS * rec / GIB, host_expert_gb=0),
        "10%": dict(gpu_expert_gb=2 * rec / GIB, host_expert_gb=3 * rec / GIB),
        "0% host": dict(gpu_expert_gb=0, host_expert_gb=N_EXPERTS * rec / GIB),
        "0% disk": dict(gpu_expert_gb=0, host_expert_gb=0),
    }


@pytest.fixture(scope="module")
def stores(tiny_dir, tmp_path_factory):
    """{kind: (store dir, record bytes)} for int4 (G 32) and bf16 packs of tiny glm4_moe."""
    src = tiny_dir("glm4_moe", "bfloat16")
    out = {}
    for kind in ("int4", "bf16"):
        dst = tmp_path_factory.mktemp("triton") / f"glm4-{kind}"
        pack(str(src), str(dst), quant=kind, group_size=32, progress=False, log=lambda _: None)
        out[kind] = (dst, 4096 if kind == "int4" else 12288)
    return out


def _open(path, **kw) -> ExpertStore:
    st = ExpertStore.open(path, device=DEVICE, dtype=torch.bfloat16, reader_threads=2, **kw)
    if ON_GPU and st._host.n:  # zero-copy needs the host arena pinned (a background thread)
        deadline = time.time() + 10
        while st._host.pinned_chunks < len(st._host._chunks) and time.time() < deadline:
            time.sleep(0.02)
    return st


def _batch(tokens: int, seed: int, k: int = 2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 64, generator=g).to(torch.bfloat16)  # [T, H]
    ids = torch.stack([torch.randperm(8, generator=g)[:k] for _ in range(tokens)])  # [T, k]
    w = torch.rand(tokens, k, generator=g)  # [T, k] fp32, as the sigmoid router gives
    return x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE)


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("kind", ["int4", "bf16"])
def test_backend_matches_twins(stores, kind):
    """Against the kernel's plain-torch twin over the same record bytes (and the engine's torch
    path: dequantized tensors through combine_experts), for decode and prefill shapes."""
    path, rec = stores[kind]
    with _open(path, **_budgets(rec)["10%"]) as st:
        be = TritonExperts(st)
        for tokens in (1, 5, 20):
            x, ids, w = _batch(tokens, seed=tokens)
            out = be.forward(1, x, ids, w)  # [T, H]
            recs = st.fetch_records(1, list(range(8)))
            twin = R.fused_moe_ref(x, ids, w, torch.stack([recs[e].to(DEVICE) for e in range(8)]), be.layout)
            torch_path = combine_experts(x, ids, w, lambda e: st.fetch(1, e))
            assert out.shape == (tokens, 64) and out.dtype == torch.bfloat16
            # the interpreter rounds fp32 -> bf16 toward zero (GPUs round to nearest), hence 2e-2
            assert _rel(out, twin) < 2e-2, tokens
            assert _rel(out, torch_path) < 3e-2, tokens
        assert be.counters()["calls"] == 3


@pytest.mark.parametrize("kind", ["int4", "bf16"])
def test_bit_identical_across_tier_budgets(stores, kind):
    """The same trace of MoE calls (decode and prefill shapes, both layers) gives the same
    bits whether experts sit in slots, host entries (read in place) or come from disk."""
    path, rec = stores[kind]
    rnd = random.Random(0)
    trace = [(layer, rnd.choice((1, 3, 17)), rnd.randrange(1000)) for _ in range(3) for layer in LAYERS]
    results, tiers = {}, {}
    for name, cfg in _budgets(rec).items():
        with _open(path, **cfg) as st:
            be = TritonExperts(st)
            outs = []
            for layer, tokens, seed in trace:
                st.begin_step(tokens=tokens, decode=tokens == 1)
                outs.append(be.forward(layer, *_batch(tokens, seed)).cpu())
            c = st.counters()
            tiers[name] = (c["slots"]["hits"], c["host"]["hits"], c["disk"]["reads"])
            if ON_GPU and name == "0% host":
                assert be.counters()["host_in_place"] > 0  # zero-copy reads of pinned host entries
        results[name] = outs
    ref = results["100%"]
    for name, outs in results.items():
        assert all(torch.equal(a, b) for a, b in zip(ref, outs)), name
    # every tier actually served experts somewhere
    assert tiers["100%"][0] > 0 and tiers["0% host"][1] > 0 and tiers["0% disk"][2] > 0
    assert tiers["10%"][0] > 0 and tiers["10%"][2] > 0


def test_skipped_experts_add_exact_zero(stores):
    """combine(skip=S) (the CPU lane computes S) equals the full call with S's routing weights
    zeroed, bit for bit, and the zero record is never confused with a real one."""
    path, rec = stores["int4"]
    with _open(path, **_budgets(rec)["10%"]) as st:
        be = TritonExperts(st)
        x, ids, w = _batch(6, seed=3)
        skip = {int(ids[0, 0]), int(ids[2, 1])}
        part = be.combine(1, x, ids, w, skip=skip)
        mask = torch.isin(ids, torch.tensor(sorted(skip), device=ids.device))
        zeroed = be.combine(1, x, ids, w.masked_fill(mask, 0))
        assert torch.equal(part, zeroed)
        full = be.combine(1, x, ids, w)
        assert not torch.equal(part, full)


def test_selection_rules(stores, monkeypatch):
    path, rec = stores["int4"]
    with _open(path, gpu_expert_gb=0, host_expert_gb=0) as st:
        assert triton_unsupported(st.layout, torch.bfloat16, DEVICE) is None
        assert "bfloat16" in triton_unsupported(st.layout, torch.float32, DEVICE)
        assert choose_expert_kernel("auto", st, "cpu") == "torch"  # auto never picks Triton on CPU
        assert choose_expert_kernel("torch", st, DEVICE) == "torch"
        assert choose_expert_kernel("triton", st, DEVICE) == "triton"
        monkeypatch.setenv("TIERMOE_EXPERT_KERNEL", "torch")
        assert choose_expert_kernel(None, st, DEVICE) == "torch"
        with pytest.raises(UserError, match="expert-kernel"):
            choose_expert_kernel("cuda", st, DEVICE)
        if not ON_GPU:
            monkeypatch.setenv("TRITON_INTERPRET", "0")
            with pytest.raises(UserError, match="need CUDA"):
                choose_expert_kernel("triton", st, "cpu")

    class Layout:  # an fp16 store's layout: the kernel has no fp16 records
        kind, hidden, intermediate, group_size = "fp16", 64, 32, None

    assert "fp16 records" in triton_unsupported(Layout, torch.bfloat16, "cuda")


def test_swiglu_clamp_keeps_triton_and_matches_torch(stores):
    """A clamping model (GLM-5.3: swiglu_limit) keeps the Triton backend, which clamps in the
    kernel epilogue: close to the torch path with the same clamp, and the clamp changes the
    result at a limit that bites."""
    path, _ = stores["bf16"]

    class Layer:
        def __init__(self, layer, limit):
            self.layer, self.gate = layer, None
            self.moe = type("M", (), {"swiglu_limit": limit})()

    x, ids, w = _batch(3, seed=1)
    outs = {}
    for name, kernel, limit in (("triton", "triton", 0.02), ("torch", "torch", 0.02), ("free", "triton", None)):
        with _open(path, gpu_expert_gb=0, host_expert_gb=0) as st:
            backend = TieredExperts(st, kernel=kernel, kernel_requested=True, prefetch=False)
            backend.attach([Layer(1, limit), Layer(2, limit)])
            if kernel == "triton":
                assert backend.kernel is not None and backend.kernel.swiglu_limit == limit
            outs[name] = backend.forward(1, x, ids, w)
    assert _rel(outs["triton"], outs["torch"]) < 3e-2
    assert _rel(outs["free"], outs["torch"]) > 0.1


@pytest.mark.slow
def test_engine_logits_through_triton_backend(stores):
    """The real engine path (loader -> MoE layer -> TieredExperts -> TritonExperts) on the
    int4 store: logits bit-identical for slot budgets 100 %, 10 %, 0 %; close to the torch
    backend; fast mode (CPU lane + kernel with the lane's experts skipped) stays close."""
    from tiermoe.engine.build import build_engine_core
    from tiermoe.eval.parity import compare, engine_logits

    path, rec = stores["int4"]
    prompt = [5, 17, 33, 64, 101, 250]

    def logits(options: dict) -> tuple[torch.Tensor, dict]:
        eng = build_engine_core(str(path), device=DEVICE, dtype="bfloat16", max_num_seqs=1, options=options)
        be = eng.model.expert_backend
        try:
            out = torch.cat([engine_logits(eng, prompt, chunk=len(prompt)), engine_logits(eng, prompt, chunk=1)])
            return out, be.counters()
        finally:
            be.close()

    budgets = _budgets(rec)
    ref, c = logits({"expert_kernel": "triton", **budgets["100%"]})
    assert c["expert_kernel"] == "triton" and c["triton"]["calls"] == 2 * (1 + len(prompt))
    for name in ("10%", "0% disk"):
        got, c = logits({"expert_kernel": "triton", **budgets[name]})
        assert torch.equal(got, ref), name
    assert c["disk"]["reads"] > 0
    torch_path, c = logits({"expert_kernel": "torch", **budgets["10%"]})
    assert c["expert_kernel"] == "torch"
    m = compare(torch_path, ref)
    assert m["kl_mean"] < 1e-2 and m["top1"] >= 0.9, m
    fast, c = logits({"expert_kernel": "triton", "mode": "fast", "cpu_lane_experts": 1, **budgets["0% host"]})
    assert c["cpu_lane"]["experts"] > 0 and c["expert_kernel"] == "triton"
    m = compare(ref, fast)
    assert m["kl_mean"] < 1e-2 and m["top1"] >= 0.9, m
