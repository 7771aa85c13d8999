import pytest
import torch

from tiermoe.kernels import reference as R
from tiermoe.kernels.layout import expert_layout, layout_from


def test_glm_int4_layout_numbers():
    lay = expert_layout("int4", 4096, 2048, 128)
    assert (lay.gate_up_q, lay.gate_up_s) == (0, 4096 * 2048)
    assert lay.down_q == 4096 * 2048 + 4096 * 32 * 2
    assert lay.down_s == lay.down_q + 4096 * 1024
    assert lay.length % 4096 == 0 and lay.length >= lay.down_s + 4096 * 16 * 2
    assert lay.weight_bytes == 3 * 4096 * 2048 // 2 + (4096 * 32 + 4096 * 16) * 2


def test_glm_int3_layout_numbers():
    """GLM-5.3-Flash expert at int3 G 128: 3/8 byte a weight plus the same scales as int4."""
    lay = expert_layout("int3", 4096, 2048, 128)
    assert (lay.gate_up_q, lay.gate_up_s) == (0, 4096 * 4096 * 3 // 8)
    assert lay.down_q == 4096 * 4096 * 3 // 8 + 4096 * 32 * 2
    assert lay.down_s == lay.down_q + 4096 * 2048 * 3 // 8
    assert lay.weight_bytes == 3 * 4096 * 2048 * 3 // 8 + (4096 * 32 + 4096 * 16) * 2
    assert lay.length == 9_830_400 and lay.bits == 3  # 24 % fewer bytes than int4 (12,976,128)


@pytest.mark.parametrize("kind", ["int4", "int8", "int3", "bf16"])
def test_layout_matches_store(kind):
    records = pytest.importorskip("tiermoe.store.records")
    store_lay = records.RecordLayout.build(kind, 256, 128, 64 if kind != "bf16" else None)
    lay = layout_from(store_lay)
    assert lay == expert_layout(kind, 256, 128, 64)


@pytest.mark.parametrize("kind", ["int4", "int8", "int3"])
def test_twin_dequant_matches_store_quant(kind):
    records = pytest.importorskip("tiermoe.store.records")
    h, i, g = 64, 32, 16
    store_lay = records.RecordLayout.build(kind, h, i, g)
    gate, up, down = torch.randn(i, h), torch.randn(i, h), torch.randn(h, i)
    rec = records.encode_expert(store_lay, gate, up, down)
    gu_store, dn_store = records.decode_record(store_lay, rec, torch.bfloat16)
    lay = layout_from(store_lay)
    assert torch.equal(R.dequant_matrix(rec, lay, "gate_up"), gu_store)
    assert torch.equal(R.dequant_matrix(rec, lay, "down"), dn_store)


def test_bad_group_size():
    with pytest.raises(ValueError):
        expert_layout("int4", 64, 48, 32)
