"""Mixed-precision stores (`pack --cold-quant`) through the Triton expert paths: each expert read at
its own record layout (kind tables per layer), bit-identical across tier budgets in the
store-managed path and the device cache, lane-skipped experts adding exact zeros, selection rules.

The tiny glm4_moe (H 64, I 32) packed bf16 hot (experts 0 and 1 of each layer: 12,288-byte
records) and int4 G32 cold (4,096 bytes): records of different lengths, so a cold record sits at
the start of a longer tier entry. (int3 block tiles need K >= 64: the tiny model's I = 32 is too
narrow for an int3 cold kind here; tests/kernels/test_fused_moe.py runs int4 + int3.)
On CPU (CI) the kernels run through Triton's interpreter, as in test_triton_backend.py.
"""

from __future__ import annotations

# kernel_stores first: on CPU it switches Triton to its interpreter before anything imports Triton
from kernel_stores import (DEVICE, GIB, LAYERS, N_EXPERTS, engine_logits_and_counters, moe_batch, open_store,
                           rel_err, run_trace, tier_budgets)

import json  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tiermoe.errors import UserError  # noqa: E402
from tiermoe.kernels import reference as R  # noqa: E402
from tiermoe.moe.backends import choose_expert_kernel, triton_unsupported  # noqa: E402
from tiermoe.moe.device_cache import DeviceCacheExperts  # noqa: E402
from tiermoe.moe.experts import combine_experts  # noqa: E402
from tiermoe.moe.store_backends import StoreTritonExperts  # noqa: E402
from tiermoe.store.records import RecordLayout  # noqa: E402

HOT = [0, 0, 1, 1, 1, 1, 1, 1]  # layout index of experts 0..7 in every MoE layer (40 + 20 of 100 picks: 0.6)


@pytest.fixture(scope="module")
def mixed(tiny_dir, tmp_path_factory):
    """(store dir, tier entry bytes) of the tiny glm4_moe packed bf16 hot / int4 G32 cold."""
    from tiermoe.store.pack import pack

    src = tiny_dir("glm4_moe", "bfloat16")
    cfg = json.loads((src / "config.json").read_text())
    first = int(cfg.get("first_k_dense_replace", 0))
    stats = tmp_path_factory.mktemp("mixed-stats") / "stats.json"
    stats.write_text(json.dumps({f"model.layers.{layer}.mlp": [40, 20, 10, 8, 8, 6, 5, 3]
                                 for layer in range(first, int(cfg["num_hidden_layers"]))}))
    dst = tmp_path_factory.mktemp("mixed") / "glm4-bf16-int4"
    pack(str(src), str(dst), quant="bf16", cold_quant="int4", cold_group_size=32, expert_stats=str(stats),
         hot_share=0.6, progress=False, log=lambda _: None)
    return dst, 12288


def _trace(n: int = 3) -> list[tuple[int, int, int]]:
    """(layer, tokens, seed) calls: decode steps of 1-3 tokens and a 17-token prefill."""
    rnd = random.Random(1)
    return [(layer, rnd.choice((1, 3, 17)), rnd.randrange(1000)) for _ in range(n) for layer in LAYERS]


def test_store_path_reads_each_record_at_its_own_layout(mixed):
    """The Triton store path on the mixed store: its kind tables name each expert's layout, and it
    matches the twin over the same tier entries (each read at its own layout) and the torch path
    (records decoded at their own layouts), at decode and prefill shapes."""
    path, rec = mixed
    with open_store(path, **tier_budgets(rec)["10%"]) as st:
        assert st.record_bytes == rec and [lay.kind for lay in st.layouts] == ["bf16", "int4"]
        be = StoreTritonExperts(st)
        assert {layer: be.fused.kinds[layer].tolist() for layer in LAYERS} == {layer: HOT for layer in LAYERS}
        assert be.counters()["triton"]["kind"] == "bf16+int4"
        for tokens in (1, 5, 20):
            x, ids, w = moe_batch(tokens, seed=tokens)
            out = be.forward(1, x, ids, w)  # [T, H]
            recs = st.fetch_records(1, list(range(8)))  # [record_bytes] entries
            entries = torch.stack([recs[e].to(DEVICE) for e in range(8)])
            twin = R.fused_moe_ref(x, ids, w, entries, be.layouts, kinds=st.layout_ids(1))
            torch_path = combine_experts(x, ids, w, lambda e: st.fetch(1, e))
            assert rel_err(out, twin) < 2e-2, tokens
            assert rel_err(out, torch_path) < 3e-2, tokens
        # reading every record at the hot layout is another function: the kind tables matter
        x, ids, w = moe_batch(4, seed=9)
        entries = torch.stack([st.fetch_records(1, list(range(8)))[e].to(DEVICE) for e in range(8)])
        wrong = R.fused_moe_ref(x, ids, w, entries, be.layout)
        assert not rel_err(be.forward(1, x, ids, w), wrong) < 0.1  # int4 bytes read as bf16: far off, or NaN


def test_store_path_bit_identical_across_tiertier_budgets(mixed):
    """The same trace gives the same bits with experts in slots, host entries read in place or
    disk reads; skipped (lane) experts point at an all-zero tier entry and add exact zeros."""
    path, rec = mixed
    trace = _trace()
    results, tiers = {}, {}
    for name, cfg in tier_budgets(rec).items():
        with open_store(path, **cfg) as st:
            be = StoreTritonExperts(st)
            outs, tiers[name] = run_trace(st, be, trace)
            if name == "10%":
                x, ids, w = moe_batch(6, seed=3)
                picked = ids.flatten().tolist()
                skip = {next(e for e in picked if HOT[e] == kind) for kind in (0, 1)}  # a hot and a cold one
                mask = torch.isin(ids, torch.tensor(sorted(skip), device=ids.device))
                assert be.fused.zero_record(x.device).numel() == rec
                assert torch.equal(be.combine(1, x, ids, w, skip=skip), be.combine(1, x, ids, w.masked_fill(mask, 0)))
        results[name] = outs
    for name, outs in results.items():
        assert all(torch.equal(a, b) for a, b in zip(results["100%"], outs)), name
    assert tiers["100%"][0] > 0 and tiers["0% host"][1] > 0 and tiers["0% disk"][2] > 0


def test_device_cache_bit_identical_to_store_path_and_acrosstier_budgets(mixed):
    """The device cache over the mixed store (host entries of the longest record, slots and
    staging rows too) with 8, 2 and 0 slots per layer, decode steps, a short prefill and a
    70-token prefill chunk staged into HBM rows: the store-managed path's bits."""
    path, rec = mixed
    trace = _trace(2) + [(layer, 70, 5) for layer in LAYERS]
    all_host = dict(gpu_expert_gb=0, host_expert_gb=N_EXPERTS * rec / GIB)
    with open_store(path, **all_host) as st:
        be = StoreTritonExperts(st)
        ref = [be.forward(layer, *moe_batch(t, seed)).cpu() for layer, t, seed in trace]
    for slots in (2 * 8, 2 * 2 + 2, 0):
        with open_store(path, **all_host) as st:
            dc = DeviceCacheExperts(st, slots, rates={}, top_k=2, max_tokens=1)
            assert dc.scratch.shape[1] == dc.arena.shape[1] == rec
            got = [dc.forward(layer, *moe_batch(t, seed), decode=t < 17).cpu() for layer, t, seed in trace]
            c = dc.cache_counters()
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), slots
        assert c["kind"] == "bf16+int4" and c["lookups"] > 0
        if slots:
            assert c["hits"] > 0 and c["prefill_staged"] > 0


def test_mixed_stores_are_served_when_every_layout_is(mixed):
    """triton_unsupported / choose_expert_kernel take a mixed store's layouts: served when the
    kernel serves each of them (bf16 + int4 here), refused with the layout that is not (int3
    cold records at I = 32: a block tile of K 64 does not divide it)."""
    path, rec = mixed
    with open_store(path, gpu_expert_gb=0, host_expert_gb=0) as st:
        assert triton_unsupported(st.layouts, torch.bfloat16, DEVICE) is None
        assert choose_expert_kernel("triton", st.layouts, st.dtype, DEVICE, st.path) == "triton"
        int3 = RecordLayout.build("int3", st.layout.hidden, st.layout.intermediate, 32)
        reason = triton_unsupported([st.layout, int3], torch.bfloat16, DEVICE)
        assert reason.startswith("int3 record shape H=64 I=32: down: BN=32/BK=64 must divide"), reason
        with pytest.raises(UserError, match="cannot serve .*: int3 record shape"):
            choose_expert_kernel("triton", [st.layout, int3], st.dtype, DEVICE, st.path)
        assert choose_expert_kernel("triton", st.layout, st.dtype, DEVICE, st.path) == "triton"  # one layout


@pytest.mark.slow
def test_engine_logits_of_a_mixed_store_acrosstier_budgets(mixed):
    """The real engine on the mixed store: logits bit-identical through the store-managed Triton
    path (every expert in slots, or read from disk) and the device cache (4 slots); close to
    the torch path, which decodes each record at its own layout."""
    from tiermoe.eval.parity import compare

    path, rec = mixed
    prompt = [5, 17, 33, 64, 101, 250]
    all_host = N_EXPERTS * rec / GIB

    def logits(options: dict) -> tuple[torch.Tensor, dict]:
        return engine_logits_and_counters(path, prompt, options)

    ref, c = logits({"expert_kernel": "triton", "device_cache": "off", "gpu_expert_gb": all_host,
                     "host_expert_gb": 0})
    assert c["expert_kernel"] == "triton" and c["triton"]["kind"] == "bf16+int4"
    got, c = logits({"expert_kernel": "triton", "device_cache": "off", "gpu_expert_gb": 0, "host_expert_gb": 0})
    assert torch.equal(got, ref) and c["disk"]["reads"] > 0
    got, c = logits({"expert_kernel": "triton", "gpu_expert_gb": 4 * rec / GIB, "host_expert_gb": all_host})
    assert c["device_cache"]["kind"] == "bf16+int4" and c["device_cache"]["hits"] > 0 and torch.equal(got, ref)
    torch_path, c = logits({"expert_kernel": "torch", "gpu_expert_gb": 0, "host_expert_gb": all_host})
    assert c["expert_kernel"] == "torch"
    m = compare(torch_path, ref)
    assert m["kl_mean"] < 1e-2 and m["top1"] >= 0.9, m
