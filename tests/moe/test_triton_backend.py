"""Triton expert backend over a packed store: close to its plain-torch twins, bit-identical
across tier sizes, lane-skipped experts add exactly zero, selection rules.

On CPU (CI) the kernels run through Triton's interpreter with CPU tensors standing in for device
memory, as in tests/kernels. TIERMOE_KERNEL_TESTS_ON_GPU=1 runs the same tests compiled on
CUDA (stores then hold slots on the GPU and host entries pinned, read in place).
"""

from __future__ import annotations

# kernel_stores first: on CPU it switches Triton to its interpreter before anything imports Triton
from kernel_stores import (
    DEVICE, LAYERS, ON_GPU, engine_logits_and_counters, kernel_bf16, moe_batch, open_store, rel_err, run_trace,
    tier_budgets, tiny_glm4_stores,
)

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tiermoe.errors import UserError  # noqa: E402
from tiermoe.kernels import reference as R  # noqa: E402
from tiermoe.moe.backends import choose_expert_kernel, triton_unsupported  # noqa: E402
from tiermoe.moe.experts import combine_experts  # noqa: E402
from tiermoe.moe.store_backends import StoreTorchExperts, StoreTritonExperts  # noqa: E402


@pytest.fixture(scope="module")
def stores(tiny_dir, tmp_path_factory):
    return tiny_glm4_stores(tiny_dir, tmp_path_factory, "triton")


@pytest.mark.parametrize("kind", ["int4", "bf16"])
def test_backend_matches_twins(stores, kind):
    """Against the kernel's plain-torch twin over the same record bytes (and the engine's torch
    path: dequantized tensors through combine_experts), for decode and prefill shapes."""
    path, rec = stores[kind]
    with open_store(path, **tier_budgets(rec)["10%"]) as st:
        be = StoreTritonExperts(st)
        for tokens in (1, 5, 20):
            x, ids, w = moe_batch(tokens, seed=tokens)
            out = be.forward(1, x, ids, w)  # [T, H]
            recs = st.fetch_records(1, list(range(8)))
            twin = R.fused_moe_ref(x, ids, w, torch.stack([recs[e].to(DEVICE) for e in range(8)]), be.layout)
            torch_path = combine_experts(x, ids, w, lambda e: st.fetch(1, e))
            assert out.shape == (tokens, 64) and out.dtype == torch.bfloat16
            # the interpreter rounds fp32 -> bf16 toward zero (GPUs round to nearest), hence 2e-2
            assert rel_err(out, twin) < 2e-2, tokens
            assert rel_err(out, torch_path) < 3e-2, tokens
        assert be.counters()["triton"]["calls"] == 3


@pytest.mark.parametrize("kind", ["int4", "bf16"])
def test_bit_identical_across_tiertier_budgets(stores, kind):
    """The same trace of MoE calls (decode and prefill shapes, both layers) gives the same
    bits whether experts sit in slots, host entries (read in place) or come from disk."""
    path, rec = stores[kind]
    rnd = random.Random(0)
    trace = [(layer, rnd.choice((1, 3, 17)), rnd.randrange(1000)) for _ in range(3) for layer in LAYERS]
    results, tiers = {}, {}
    for name, cfg in tier_budgets(rec).items():
        with open_store(path, **cfg) as st:
            be = StoreTritonExperts(st)
            outs, tiers[name] = run_trace(st, be, trace)
            if ON_GPU and name == "0% host":
                assert be.counters()["triton"]["host_in_place"] > 0  # zero-copy reads of pinned host entries
        results[name] = outs
    ref = results["100%"]
    for name, outs in results.items():
        assert all(torch.equal(a, b) for a, b in zip(ref, outs)), name
    # every tier actually served experts somewhere
    assert tiers["100%"][0] > 0 and tiers["0% host"][1] > 0 and tiers["0% disk"][2] > 0
    assert tiers["10%"][0] > 0 and tiers["10%"][2] > 0


@pytest.mark.parametrize("kind", ["int4", "bf16"])
def test_partial_is_the_sum_before_its_rounding(stores, kind):
    """forward(partial=True) (an expert-parallel rank's part): fp32, and rounded as the kernel rounds it, the
    partial=False result bit for bit. The Triton path's is the kernel's unrounded fp32 sum (most of its
    elements lie between two bf16 values); the torch path rounds every expert's add, so its partial is its
    result widened, exactly."""
    path, rec = stores[kind]
    with open_store(path, **tier_budgets(rec)["10%"]) as st:
        triton, torch_path = StoreTritonExperts(st), StoreTorchExperts(st)
        for tokens in (1, 5, 20):  # the decode (gemv) and the prefill shapes
            x, ids, w = moe_batch(tokens, seed=40 + tokens)
            st.begin_step(tokens=tokens, decode=tokens == 1)
            rounded, part = triton.forward(1, x, ids, w), triton.forward(1, x, ids, w, partial=True)  # [T, H]
            assert part.dtype == torch.float32 and rounded.dtype == torch.bfloat16
            assert torch.equal(kernel_bf16(part), rounded), tokens
            assert not torch.equal(part.to(torch.bfloat16).float(), part), tokens  # not rounded yet
            rounded, part = torch_path.forward(1, x, ids, w), torch_path.forward(1, x, ids, w, partial=True)
            assert part.dtype == torch.float32 and torch.equal(part.to(torch.bfloat16), rounded), tokens
            assert torch.equal(part, rounded.float()), tokens
        empty = triton.forward(1, x[:0], ids[:0], w[:0], partial=True)  # [0, H]
        assert empty.dtype == torch.float32 and empty.shape == (0, x.shape[1])


def test_skipped_experts_add_exact_zero(stores):
    """combine(skip=S) (the CPU lane computes S) equals the full call with S's routing weights
    zeroed, bit for bit, and the zero record is never confused with a real one."""
    path, rec = stores["int4"]
    with open_store(path, **tier_budgets(rec)["10%"]) as st:
        be = StoreTritonExperts(st)
        x, ids, w = moe_batch(6, seed=3)
        skip = {int(ids[0, 0]), int(ids[2, 1])}
        part = be.combine(1, x, ids, w, skip=skip)
        mask = torch.isin(ids, torch.tensor(sorted(skip), device=ids.device))
        zeroed = be.combine(1, x, ids, w.masked_fill(mask, 0))
        assert torch.equal(part, zeroed)
        full = be.combine(1, x, ids, w)
        assert not torch.equal(part, full)


def test_selection_rules(stores, monkeypatch):
    path, rec = stores["int4"]
    with open_store(path, gpu_expert_gb=0, host_expert_gb=0) as st:
        store_layout = st.layout
        assert triton_unsupported(st.layout, torch.bfloat16, DEVICE) is None
        assert "bfloat16" in triton_unsupported(st.layout, torch.float32, DEVICE)
        def choose(requested, device):
            return choose_expert_kernel(requested, st.layouts, st.dtype, device, st.path)

        assert choose("auto", "cpu") == "torch"  # auto never picks Triton on CPU
        assert choose("torch", DEVICE) == "torch"
        assert choose("triton", DEVICE) == "triton"
        monkeypatch.setenv("TIERMOE_EXPERT_KERNEL", "torch")
        assert choose(None, DEVICE) == "torch"
        with pytest.raises(UserError, match="expert-kernel"):
            choose("cuda", DEVICE)
        if not ON_GPU:
            monkeypatch.setenv("TRITON_INTERPRET", "0")
            with pytest.raises(UserError, match="need CUDA"):
                choose("triton", "cpu")

    # a tuned decode entry carrying the few-token gemv shape (configs.json) keeps the backend
    from tiermoe.kernels.layout import layout_from
    from tiermoe.kernels.triton import fused_moe as fm

    monkeypatch.undo()  # the environment set above
    lay = layout_from(store_layout)
    gemv = {"gate_up": {"BN": 16, "BK": 32, "num_warps": 4, "num_stages": 3, "acc": "row"}, "max_tokens": 2}
    gemv["down"] = dict(gemv["gate_up"])
    tuned = {**fm.default_config(lay, 1), "gemv": gemv}
    monkeypatch.setattr(fm, "get_config", lambda layout, tokens, dev=None: tuned)
    assert triton_unsupported(store_layout, torch.bfloat16, DEVICE) is None
    gemv["down"]["BN"] = 48  # divides neither projection's rows
    assert "gemv down" in triton_unsupported(store_layout, torch.bfloat16, DEVICE)
    del gemv["down"]  # a hand-edited entry without a stage: a reason, not a crash at start-up
    assert "malformed launch configuration" in triton_unsupported(store_layout, torch.bfloat16, DEVICE)
    monkeypatch.undo()

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

    x, ids, w = moe_batch(3, seed=1)
    outs = {}
    for name, kernel, limit in (("triton", "triton", 0.02), ("torch", "torch", 0.02), ("free", "triton", None)):
        with open_store(path, gpu_expert_gb=0, host_expert_gb=0) as st:
            backend = (StoreTritonExperts if kernel == "triton" else StoreTorchExperts)(st, prefetch=False)
            backend.attach([Layer(1, limit), Layer(2, limit)])
            if kernel == "triton":
                assert backend.fused.swiglu_limit == limit
            outs[name] = backend.forward(1, x, ids, w)
    assert rel_err(outs["triton"], outs["torch"]) < 3e-2
    assert rel_err(outs["free"], outs["torch"]) > 0.1


@pytest.mark.slow
def test_engine_logits_through_triton_backend(stores):
    """The real engine path (loader -> MoE layer -> StoreTritonExperts) on the
    int4 store: logits bit-identical for slot budgets 100 %, 10 %, 0 %; close to the torch
    backend; fast mode (CPU lane + kernel with the lane's experts skipped) stays close."""
    from tiermoe.eval.parity import compare

    path, rec = stores["int4"]
    prompt = [5, 17, 33, 64, 101, 250]

    def logits(options: dict) -> tuple[torch.Tensor, dict]:
        return engine_logits_and_counters(path, prompt, options)

    budgets = tier_budgets(rec)
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
    # a fixed share: the measured one rounds to no expert with these 4 KB records
    fast, c = logits({"expert_kernel": "triton", "mode": "fast", "cpu_lane_experts": 1, "cpu_lane_share": 1.0,
                      **budgets["0% host"]})
    assert c["cpu_lane"]["experts"] > 0 and c["expert_kernel"] == "triton"
    m = compare(ref, fast)
    assert m["kl_mean"] < 1e-2 and m["top1"] >= 0.9, m
