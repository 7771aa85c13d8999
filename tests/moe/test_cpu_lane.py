"""The CPU lane: its output against its plain-torch twin for int4, int3, int8 and bf16 records (and the
exact path's expert for the other kinds), no conversion per expert use on the compiled kernel,
the cost model's order, and what happens without a compiler."""

from __future__ import annotations

import pytest
import torch

from tiermoe.kernels.layout import expert_layout
from tiermoe.kernels.reference import lane_experts_ref, make_record
from tiermoe.moe import cpu_lane, lane_kernel
from tiermoe.moe.cpu_lane import CpuLane
from tiermoe.moe.experts import expert_mlp
from tiermoe.store.records import RecordLayout, decode_record, encode_expert

NATIVE = lane_kernel.native_library() is not None


def _w(n, k, seed):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _records(kind, g=None, hidden=64, inter=32, n=3):
    layout = RecordLayout.build(kind, hidden, inter, g)
    recs = {}
    for e in range(n):
        gate, up, down = _w(inter, hidden, 10 * e), _w(inter, hidden, 10 * e + 1), _w(hidden, inter, 10 * e + 2)
        recs[e] = encode_expert(layout, gate, up, down)
    return layout, recs


def _routing(tokens, n):
    """Token t picks experts t % n and (t + 1) % n, with weights 0.7 and 0.3."""
    ids = torch.tensor([[t % n, (t + 1) % n] for t in range(tokens)], dtype=torch.int32)  # [T, 2]
    return ids, torch.tensor([[0.7, 0.3]] * tokens)  # [T, 2]


# int3 records come from the store's quantizer (signed scales); G = 128 needs a larger expert
@pytest.mark.parametrize("kind,g", [("int4", 32), ("int4", 16), ("int8", 32), ("bf16", None), ("int3", 32),
                                    ("int3", 128), ("int3", 16)])
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("limit", [None, 0.5])
def test_lane_equals_its_plain_torch_twin(kind, g, act, limit):
    """compute() (the compiled kernel where it builds) against lane_experts_ref on the same records."""
    hidden, inter = (256, 128) if g == 128 else (64, 32)
    layout, recs = _records(kind, g, hidden, inter)
    klay = expert_layout(kind, hidden, inter, g or 0)
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(7)).to(act)  # [T, H]
    ids, w = _routing(5, 3)
    lane = CpuLane([layout], threads=2, act_dtype=act, swiglu_limit=limit)
    try:
        got = lane.compute(0, x, ids, w, recs)
        c = lane.counters(5)
    finally:
        lane.close()
    rows = [torch.where((ids == e).any(1))[0] for e in range(3)]
    weights = [w[r][ids[r] == e] for e, r in enumerate(rows)]
    want = lane_experts_ref(x.float(), list(recs.values()), rows, weights, klay, act == torch.bfloat16, limit)
    assert got.dtype == torch.float32 and got.shape == (5, hidden)
    assert _rel(got, want) < (2e-3 if act == torch.bfloat16 else 1e-5)
    assert c["kernel"] == ("native-" if NATIVE else "torch") + (lane.pool.isa if NATIVE else "")
    assert c["experts"] == 3 and c["repacks"] == (0 if NATIVE else 3) and c["weight_bytes"] == 3 * klay.weight_bytes


@pytest.mark.parametrize("kind", ["int4", "fp32"])
def test_lane_close_to_the_exact_path_expert(kind):
    """fp32 model: the lane (kernel or fp16/fp32 records' float path) equals the exact path's expert_mlp."""
    layout, recs = _records(kind, 32 if kind == "int4" else None, n=1)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))  # [T, H]
    ids, w = torch.zeros(3, 1, dtype=torch.int32), torch.ones(3, 1)
    lane = CpuLane([layout], threads=1, act_dtype=torch.float32, swiglu_limit=0.5)
    try:
        got = lane.compute(0, x, ids, w, recs)
        assert lane.kernel == ("torch" if kind == "fp32" or not NATIVE else lane.kernel)
    finally:
        lane.close()
    gate_up, down = decode_record(layout, recs[0], torch.float32)
    assert _rel(got, expert_mlp(x, gate_up, down, 0.5)) < 1e-5


@pytest.mark.skipif(not NATIVE, reason="no compiled lane kernel here")
@pytest.mark.parametrize("kind", ["int4", "int3"])
def test_thread_counts_and_instruction_sets_agree(kind):
    layout, recs = _records(kind, 32, hidden=128, inter=64, n=4)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    ids, w = _routing(3, 4)
    outs = {}
    for threads, isa in ((1, "avx512bf16"), (3, "avx512bf16"), (2, "avx512"), (2, "avx2"), (2, "scalar")):
        lane = CpuLane([layout], threads=threads, isa=isa)
        try:
            outs[(threads, lane.pool.isa)] = lane.compute(0, x, ids, w, recs)
        finally:
            lane.close()
    first = next(iter(outs.values()))
    for key, out in outs.items():
        assert _rel(out, first) < 1e-5, key
    same_isa = [o for (t, isa), o in outs.items() if isa == next(iter(outs))[1]]
    assert all(torch.equal(o, same_isa[0]) for o in same_isa)  # rows split over threads: the same bits


def test_a_record_the_lane_cannot_read_fails_with_its_name():
    layout, recs = _records("int8", 32)
    lane = CpuLane([layout], threads=1)
    try:
        with pytest.raises(RuntimeError, match="layer 4 expert 1: not a readable"):
            lane.compute(4, torch.randn(1, 64), torch.tensor([[1]]), torch.ones(1, 1), {1: recs[1][:100]})
    finally:
        lane.close()


def test_without_a_compiler_the_lane_uses_the_torch_path(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(lane_kernel, "_STATE", {})
    monkeypatch.setenv("TIERMOE_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    layout, recs = _records("int4", 32)
    with caplog.at_level("WARNING", logger="tiermoe.moe"):
        lane = CpuLane([layout], threads=1)
    try:
        assert lane.kernel == "torch" and lane.pool is None
        assert "no C++ compiler" in lane_kernel.native_error() and "plain-torch path" in caplog.text
        out = lane.compute(0, torch.randn(2, 64), *_routing(2, 3), recs)
        assert out.shape == (2, 64) and lane.counters(2)["repacks"] == 3
    finally:
        lane.close()


def test_physical_cores_one_per_core_interleaved_over_nodes(tmp_path, monkeypatch):
    """Two nodes, two cores each, two hyperthreads per core: one CPU per core, node by node in turn."""
    sysfs = tmp_path
    siblings = {0: 0, 1: 1, 2: 0, 3: 1, 4: 2, 5: 3, 6: 2, 7: 3}  # cpu -> core id (cpus 0-3 node 0)
    for cpu, core in siblings.items():
        topo = sysfs / "cpu" / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "core_id").write_text(f"{core}\n")
        (topo / "physical_package_id").write_text("0\n")
    for node, cpus in ((0, "0-3"), (1, "4-7")):
        (sysfs / "node" / f"node{node}").mkdir(parents=True)
        (sysfs / "node" / f"node{node}" / "cpulist").write_text(cpus + "\n")
    monkeypatch.setattr(lane_kernel.os, "sched_getaffinity", lambda pid: set(range(8)))
    assert lane_kernel.physical_cores(sysfs) == [0, 4, 1, 5]


def test_lane_beside_a_gpu_leaves_a_core_to_the_engine(monkeypatch):
    """Four physical cores: three lane threads (the engine's thread spins on the fourth), fewer when
    torch has fewer threads, never none; the pinned pool leaves its first core to its caller."""
    monkeypatch.setattr(lane_kernel, "physical_cores", lambda: [0, 2, 4, 6])
    assert [lane_kernel.lane_threads_beside_gpu(n) for n in (16, 4, 3, 1)] == [3, 3, 2, 1]
    lane = CpuLane([RecordLayout.build("int8", 64, 32, 32)], threads=3, pin=True)
    try:
        if lane.pool is not None:
            assert lane.caller_cpu == 0 and lane.pool.cpus == [0, 2, 4, 6]
    finally:
        lane.close()


def test_a_pinned_pool_beside_disk_reads_spins_briefly():
    """A pinned pool's workers spin 5 ms after a job (the next decode layer's comes sooner); beside a disk tier,
    whose decode layers come further apart and whose readers need the cores, they sleep after 0.5 ms as on shared
    cores."""
    if lane_kernel.native_library() is None:
        pytest.skip("no C++ compiler here: the lane has no compiled pool")
    layout = [RecordLayout.build("int8", 64, 32, 32)]
    for pin, disk, spin in ((True, False, lane_kernel.PINNED_SPIN_US), (True, True, lane_kernel.SHARED_SPIN_US),
                            (False, False, lane_kernel.SHARED_SPIN_US)):
        lane = CpuLane(layout, threads=1, pin=pin, beside_disk_reads=disk)
        try:
            assert lane.pool.spin_us == spin and lane.beside_disk_reads == disk
        finally:
            lane.close()


class _FakeStore:
    """tier_of / heat, the two things the cost model reads."""

    def __init__(self, tiers, heat):
        self.tiers, self.heats = tiers, heat

    def tier_of(self, layer, e):
        return self.tiers[e]

    def heat(self, layer, e):
        return self.heats[e]


def test_cost_model_order_and_limit():
    layout = RecordLayout.build("int4", 64, 32, 32)
    tiers = {0: "slots", 1: "host", 2: "host", 3: "disk", 4: "host", 5: "disk", 6: "host"}
    heat = {0: 0.0, 1: 5.0, 2: 1.0, 3: 0.0, 4: 3.0, 5: 9.0, 6: 8.0}
    lane = cpu_lane.CpuLane([layout], max_experts=3, threads=1, disk=True)
    try:
        store = _FakeStore(tiers, heat)
        assert lane.assign(store, 7, list(range(7))) == [1, 2, 4]  # host, coldest first; never slots (0)
        lane.max_experts = 6
        assert lane.assign(store, 7, list(range(7))) == [1, 2, 3, 4, 5, 6]  # disk ones last
        lane.max_experts = 0
        assert lane.assign(store, 7, list(range(7))) == []
    finally:
        lane.close()


def test_cost_model_share_of_the_misses():
    """With a measured share the lane takes round(misses * share) of a layer's misses (slots excluded,
    disk-only ones counted: the device side would read them too), at most max_experts."""
    from tiermoe.moe.lane_cost import LaneBandwidths, lane_count

    bw = LaneBandwidths(pcie_gbs=55.0, host_gbs=100.0, lane_gbs=80.0, pcie_shared_gbs=45.0, lane_shared_gbs=30.0)
    assert bw.share == pytest.approx(0.4) and bw.as_dict()["share"] == pytest.approx(0.4)
    assert [lane_count(m, 0.4, 8) for m in (0, 1, 2, 5, 30)] == [0, 0, 1, 2, 8]
    assert lane_count(5, None, 3) == 3  # no measurement: the fixed count
    layout = RecordLayout.build("int4", 64, 32, 32)
    tiers = {0: "slots", 1: "host", 2: "host", 3: "disk", 4: "host", 5: "disk", 6: "host"}
    heat = {0: 0.0, 1: 5.0, 2: 1.0, 3: 0.0, 4: 3.0, 5: 9.0, 6: 8.0}
    lane = cpu_lane.CpuLane([layout], max_experts=6, threads=1, disk=False)
    try:
        lane.share = 0.5
        assert lane.assign(_FakeStore(tiers, heat), 7, list(range(7))) == [1, 2, 4]  # 6 misses -> 3, coldest host
        lane.share = 0.0
        assert lane.assign(_FakeStore(tiers, heat), 7, list(range(7))) == []
    finally:
        lane.close()


def test_start_up_keeps_the_fastest_kernel_tuning():
    """choose_tuning times every candidate on the same records and leaves the lane on the fastest; the
    lane's counters stay as they were, and its results do not depend on the tuning."""
    from tiermoe.kernels.cpu.native import LaneTuning
    from tiermoe.moe.lane_cost import choose_tuning, tuning_label

    layout = RecordLayout.build("int4", 256, 128, 64)
    gen = torch.Generator().manual_seed(5)
    klay = expert_layout("int4", 256, 128, 64)
    recs = [make_record(klay, gen) for _ in range(6)]
    lane = CpuLane([layout], threads=2, max_experts=8)
    try:
        if lane.pool is None:
            pytest.skip("no compiled lane kernel here")
        x, ids, w = torch.randn(1, 256), torch.tensor([[0, 3]], dtype=torch.int32), torch.tensor([[0.6, 0.4]])
        out0 = lane.compute(0, x, ids, w, {0: recs[0], 3: recs[3]})
        before = lane.c.as_dict()
        cands = (LaneTuning(), LaneTuning(1, 1, 0, 3), LaneTuning(64, 32, 4, 1))
        best, rates = choose_tuning(lane, recs, seconds=0.01, rounds=1, candidates=cands)
        assert set(rates) == {tuning_label(t) for t in cands} and min(rates.values()) > 0
        assert rates[best] == max(rates.values())
        assert lane.c.as_dict() == before
        assert torch.equal(lane.compute(0, x, ids, w, {0: recs[0], 3: recs[3]}), out0)
    finally:
        lane.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cost model measures PCIe copies: needs CUDA")
def test_cost_model_measures_bandwidths_on_cuda():
    from tiermoe.moe.lane_cost import measure

    lane = CpuLane([RecordLayout.build("int4", 256, 128, 64)], threads=2, device="cuda", max_experts=8)
    try:
        before = lane.c.as_dict()
        bw = measure(lane, torch.device("cuda"), records=4, seconds=0.05)
        rates = {k: v for k, v in bw.as_dict().items() if isinstance(v, float)}
        assert len(rates) == 6 and min(rates.values()) > 0 and 0 < bw.share < 1
        assert lane.pool is None or (bw.tuning in bw.tuning_gbs and len(bw.tuning_gbs) == 4)
        assert lane.c.as_dict() == before  # the measurement leaves the lane's counters alone
    finally:
        lane.close()


def _posted_meta(lane_ids: list[int], lane_cap: int, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A layer as the device posts it (moe/device_lane.py): lane ids padded with -1 | topk ids | weights' bits."""
    lane = torch.tensor(lane_ids + [-1] * (lane_cap - len(lane_ids)), dtype=torch.int32)
    return torch.cat([lane, ids.to(torch.int32).flatten(), w.to(torch.float32).flatten().view(torch.int32)])


@pytest.mark.skipif(not NATIVE, reason="no compiled lane kernel here")
@pytest.mark.parametrize("kinds", [("int4",), ("int8",), ("bf16",), ("int4", "int8")])
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
def test_posted_layer_gives_the_bits_of_compute(kinds, act):
    """compute_posted (the routing set-up in C, from the device's words) against compute (set up in
    Python): the same bits, for tokens that share experts, unsorted lane ids with gaps, and a mixed
    store's two layouts; the counters move the same way."""
    n, t, k, hidden, inter = 6, 3, 3, 64, 32
    layouts = [RecordLayout.build(kind, hidden, inter, None if kind == "bf16" else 32) for kind in kinds]
    layout_ids = [e % len(layouts) for e in range(n)]  # a mixed store: even ids at the first layout
    recs = {}
    for e in range(n):
        gate, up, down = _w(inter, hidden, 10 * e), _w(inter, hidden, 10 * e + 1), _w(hidden, inter, 10 * e + 2)
        recs[e] = encode_expert(layouts[layout_ids[e]], gate, up, down)
    gen = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(t)]).to(torch.int32)  # [T, k]
    ids[1, 0], ids[2, 2] = ids[0, 1], ids[0, 1]  # one expert picked by every token, at different positions
    w = torch.rand(t, k, generator=gen)  # [T, k]
    x = torch.randn(t, hidden, generator=gen).to(torch.bfloat16)  # [T, H]: the mailbox's activations
    lane_ids = sorted({int(ids[0, 1]), int(ids[2, 0]), int(ids[1, 2])}, reverse=True)
    meta = _posted_meta(lane_ids, 8, ids, w)
    rec_of = torch.tensor([recs[e].data_ptr() for e in range(n)], dtype=torch.int64)
    mixed = {0: layout_ids} if len(layouts) > 1 else None
    lanes = [CpuLane(layouts, threads=2, act_dtype=act, layout_ids=mixed) for _ in range(3)]
    lanes[2].posted_native = False  # where the kernel cannot take it: the words decoded in Python
    try:
        assert lanes[0].posted_native
        want = lanes[0].compute(0, x, ids, w, {e: recs[e] for e in lane_ids})
        records = [recs[e] for e in range(n)]
        got = lanes[1].compute_posted(0, x, meta, 8, k, rec_of, records)
        decoded = lanes[2].compute_posted(0, x, meta, 8, k, rec_of, records)
        counts = [lane.counters(1) for lane in lanes]
        with pytest.raises(RuntimeError, match="expert id"):
            lanes[1].compute_posted(0, x, _posted_meta([n], 8, ids, w), 8, k, rec_of, records)
    finally:
        for lane in lanes:
            lane.close()
    assert torch.equal(got, want) and torch.equal(decoded, want) and got.abs().sum() > 0
    for key in ("experts", "decode_experts", "layers", "weight_bytes"):
        assert counts[0][key] == counts[1][key] == counts[2][key], key
    assert counts[1]["experts"] == len(lane_ids)
