"""ExpertStore's CPU-lane accessors: records read in place, held against eviction, no moves; and
an int3 store's records computed by the lane where they sit."""

from __future__ import annotations

import pytest
import torch

from tiermoe.kernels.layout import expert_layout
from tiermoe.kernels.reference import lane_experts_ref
from tiermoe.moe.cpu_lane import CpuLane
from tiermoe.store.facade import ExpertStore
from tiermoe.store.pack import pack
from tiermoe.store.records import decode_record

GIB = 2**30


@pytest.fixture(scope="module")
def store_dir(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lane-store") / "glm4-int4"
    pack(str(tiny_dir("glm4_moe")), str(out), quant="int4", group_size=32, progress=False, log=lambda _: None)
    return out


def _open(store_dir, host_experts):
    # LRU, no slots, room for `host_experts` in RAM (the tiny int4 record is 4096 bytes)
    return ExpertStore.open(store_dir, policy="lru", gpu_expert_gb=0, host_expert_gb=host_experts * 4096 / GIB,
                            reader_threads=2)


def test_lane_records_in_place_held_and_released(store_dir):
    with _open(store_dir, 2) as st:
        layer = st.moe_layers[0]
        host = sorted(e for e in range(8) if st.tier_of(layer, e) == "host")
        disk = [e for e in range(8) if st.tier_of(layer, e) == "disk"]
        assert len(host) == 2 and disk
        h, d = host[0], disk[0]
        got = st.lane_records(layer, [h, d])
        buf_h, fut_h = got[h]
        buf_d, fut_d = got[d]
        assert fut_h is None and fut_d is not None
        assert buf_h.data_ptr() == st._host.entry(st._host_of[st.key(layer, h)]).data_ptr()  # in place
        fut_d.result()
        ref = st.fetch(layer, [d])[d]  # the normal path: same bytes, now admitted to host
        assert all(torch.equal(a, b) for a, b in zip(decode_record(st.layout, buf_d, torch.float32), ref))
        assert st.tier_of(layer, h) == "host"  # the lane moved nothing
        # Fetching every other expert would evict h under LRU; held, it stays put.
        for e in range(8):
            if e not in (h, d):
                st.fetch(layer, [e])
                assert st.tier_of(layer, h) == "host"
        st.lane_release(layer, [h, d])
        for e in range(8):
            if e != h:
                st.fetch(layer, [e])
        assert st.tier_of(layer, h) == "disk"  # released: an ordinary LRU victim again
        c = st.counters()
        assert c["host"]["hits"] >= 1 and c["disk"]["reads"] >= 1


def test_lane_records_skips_slots_and_disk_when_asked(store_dir):
    with ExpertStore.open(store_dir, policy="lru", gpu_expert_gb=2 * 4096 / GIB, host_expert_gb=0,
                          reader_threads=2) as st:
        layer = st.moe_layers[1]
        in_slots = [e for e in range(8) if st.tier_of(layer, e) == "slots"]
        others = [e for e in range(8) if e not in in_slots]
        got = st.lane_records(layer, in_slots + others[:1], disk=False)
        assert got == {}
        got = st.lane_records(layer, others[:1])
        assert list(got) == others[:1]
        with pytest.raises(RuntimeError, match="already held"):
            st.lane_records(layer, others[:1])
        st.lane_release(layer, others[:1])
        st.lane_records(layer, others[1:3])  # still held at close(): close settles the reads


@pytest.fixture(scope="module")
def int3_store_dir(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lane-store") / "glm4-int3"
    pack(str(tiny_dir("glm4_moe")), str(out), quant="int3", group_size=16, progress=False, log=lambda _: None)
    return out


def test_lane_computes_int3_records_where_they_sit(int3_store_dir):
    """Packed int3 records (bit planes, signed scales from the store's scale search), host-resident and
    staged from disk, through CpuLane.compute: the plain-torch twin on the same bytes."""
    with ExpertStore.open(int3_store_dir, policy="lru", gpu_expert_gb=0, host_expert_gb=3 * 4096 / GIB,
                          reader_threads=2) as st:
        layout, layer = st.layout, st.moe_layers[0]
        assert layout.kind == "int3" and layout.length == 4096
        ids = torch.tensor([[0, 3], [1, 3], [4, 6], [6, 0]], dtype=torch.int32)  # [T, 2]: five experts
        w = torch.tensor([[0.6, 0.4], [0.5, 0.5], [0.9, 0.1], [0.3, 0.7]])  # [T, 2]
        experts = sorted(set(ids.flatten().tolist()))
        got = st.lane_records(layer, experts)
        assert any(f is None for _, f in got.values()) and any(f is not None for _, f in got.values())
        for _, fut in got.values():
            if fut is not None:
                fut.result()
        bufs = {e: buf for e, (buf, _) in got.items()}
        klay = expert_layout("int3", layout.hidden, layout.intermediate, 16)
        scales = torch.cat([bufs[e][klay.gate_up_s : klay.down_q].view(torch.bfloat16) for e in experts])
        assert (scales < 0).any() and (scales > 0).any()
        x = torch.randn(4, layout.hidden, generator=torch.Generator().manual_seed(5)).bfloat16()  # [T, H]
        lane = CpuLane([layout], threads=2)
        try:
            out = lane.compute(layer, x, ids, w, bufs)
        finally:
            lane.close()
            st.lane_release(layer, experts)
        rows = [torch.where((ids == e).any(1))[0] for e in experts]
        weights = [w[r][ids[r] == e] for e, r in zip(experts, rows)]
        want = lane_experts_ref(x.float(), [bufs[e] for e in experts], rows, weights, klay)
        assert float((out - want).abs().max() / want.abs().max()) < 2e-3
