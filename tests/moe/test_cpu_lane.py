"""CPU lane kernels: every lane kernel equals dequantize + fp32 matmul within its precision."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tiermoe.moe import cpu_lane
from tiermoe.moe.cpu_lane import (PackCache, PackedExpert, expert_forward, int4_scales_and_zeros, lane_kernel,
                                  linear, pack_expert, repack_int4)
from tiermoe.moe.experts import expert_mlp
from tiermoe.store.quant import dequantize_groupwise, quantize_groupwise
from tiermoe.store.records import RecordLayout, decode_record, encode_expert


def _w(n, k, seed):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("n,k,g", [(64, 64, 32), (128, 256, 64), (96, 128, 128), (48, 512, 256)])
def test_int4_kernel_equals_dequant_matmul(n, k, g):
    q, s = quantize_groupwise(_w(n, k, n + k), 4, g)
    ref_w = dequantize_groupwise(q, s, 4, g, torch.float32)  # [N, K]
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    layout = SimpleNamespace(group_size=g, bits=4)  # what linear reads of a RecordLayout
    ref = F.linear(x, ref_w)
    w = repack_int4(q)
    fp32 = linear(x, (w, int4_scales_and_zeros(s, torch.float32)), "int4pack", layout, torch.float32)
    assert _rel(fp32, ref) < 1e-5  # same math, fp32 throughout
    bf16 = linear(x, (w, int4_scales_and_zeros(s, torch.bfloat16)), "int4pack", layout, torch.bfloat16)
    assert _rel(bf16, F.linear(x.bfloat16().float(), ref_w)) < 1e-2  # bf16 in/out, fp32 sums


@pytest.mark.parametrize("n", [128, 192, 48, 16])
def test_int4_repack_matches_torch_converter(n):
    q = torch.randint(0, 256, (n, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    assert torch.equal(repack_int4(q), cpu_lane._int4pack_torch(q))


def test_int8_kernel_equals_dequant_matmul():
    n, k, g = 96, 256, 64
    q, s = quantize_groupwise(_w(n, k, 3), 8, g)
    ref_w = dequantize_groupwise(q, s, 8, g, torch.float32)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(2))
    layout = SimpleNamespace(group_size=g, bits=8)
    op = (q.view(n, k // g, g).transpose(0, 1).contiguous(), s.t().to(torch.bfloat16).contiguous())
    got = linear(x, op, "int8pack", layout, torch.bfloat16)
    assert _rel(got, F.linear(x.bfloat16().float(), ref_w)) < 1e-2


def _record(kind, g=None, hidden=64, inter=32, seed=0):
    layout = RecordLayout.build(kind, hidden, inter, g)
    gate, up, down = _w(inter, hidden, seed), _w(inter, hidden, seed + 1), _w(hidden, inter, seed + 2)
    return layout, encode_expert(layout, gate, up, down)


@pytest.mark.parametrize("kind,g,act,kernel,tol", [
    ("int4", 32, torch.float32, "int4pack", 1e-5),
    ("int4", 32, torch.bfloat16, "int4pack", 2e-2),
    ("int4", 16, torch.float32, "dequant", 1e-5),  # group size torch's int4 kernel refuses
    ("int8", 32, torch.bfloat16, "int8pack", 2e-2),
    ("int8", 32, torch.float32, "dequant", 1e-5),
    ("bf16", None, torch.float32, "float", 1e-5),
    ("bf16", None, torch.bfloat16, "float", 2e-2),
    ("fp32", None, torch.float32, "float", 1e-5),
])
def test_expert_forward_equals_reference_expert(kind, g, act, kernel, tol):
    layout, rec = _record(kind, g)
    assert lane_kernel(layout, act) == kernel
    p = pack_expert(layout, rec, kernel, act)
    assert (p.nbytes > 0) == (kernel in ("int4pack", "int8pack"))
    gate_up, down = decode_record(layout, rec, torch.float32)  # the exact path's weights
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(7))
    for limit in (None, 0.5):
        ref = expert_mlp(x, gate_up, down, limit)
        got = expert_forward(p, x, layout, limit)
        assert got.dtype == torch.float32 and got.shape == (5, 64)
        assert _rel(got, ref) < tol, (kind, act, limit)


def test_pack_cache_budget_lru_and_prune():
    def item(nbytes):
        return PackedExpert("int4pack", (), (), nbytes)

    c = PackCache(100)
    c.put((0, 1), item(40))
    c.put((0, 2), item(40))
    assert c.get((0, 1)) is not None  # (0, 1) now most recent
    c.put((0, 3), item(40))  # evicts the least recent, (0, 2)
    assert c.get((0, 2)) is None and c.bytes == 80 and len(c) == 2
    c.put((0, 4), item(500))  # larger than the whole budget: not cached
    c.put((0, 5), item(0))  # views of a record: never cached
    assert len(c) == 2
    assert c.prune(lambda key: key != (0, 1)) == 1
    assert c.get((0, 1)) is None and c.bytes == 40


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
    lane = cpu_lane.CpuLane(layout, max_experts=3, threads=1, disk=True)
    try:
        lane.cache.put((7, 6), PackedExpert("int4pack", (), (), 10))  # expert 6's repack is cached
        store = _FakeStore(tiers, heat)
        # cached host first (6), then host coldest first (2, then 4); never slots (0)
        assert lane.assign(store, 7, list(range(7))) == [2, 4, 6]
        lane.max_experts = 6
        assert lane.assign(store, 7, list(range(7))) == [1, 2, 3, 4, 5, 6]  # disk ones last
        lane.max_experts = 0
        assert lane.assign(store, 7, list(range(7))) == []
    finally:
        lane.close()


def test_disk_only_experts_auto():
    int4 = RecordLayout.build("int4", 64, 32, 32)
    bf16 = RecordLayout.build("bf16", 64, 32)
    for layout, device, expect in ((int4, "cuda", False), (int4, "cpu", True), (bf16, "cuda", True)):
        lane = cpu_lane.CpuLane(layout, threads=1, device=device)
        assert lane.disk is expect, (layout.kind, device)
        lane.close()
