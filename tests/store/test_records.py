import pytest
import torch

from tiermoe.errors import UserError
from tiermoe.store.records import RECORD_ALIGN, SECTION_ALIGN, RecordLayout, decode_record, encode_expert


def _expert(i=32, h=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(*s, generator=g) * 0.1).to(dtype) for s in ((i, h), (i, h), (h, i)))


@pytest.mark.parametrize("kind", ["bf16", "fp16", "fp32", "int8", "int4", "int3"])
def test_layout_alignment(kind):
    lay = RecordLayout.build(kind, 64, 96, 32)
    assert lay.length % RECORD_ALIGN == 0
    offs = [s.offset for s in lay.sections]
    assert all(o % SECTION_ALIGN == 0 for o in offs) and offs == sorted(offs)
    for a, b in zip(lay.sections, lay.sections[1:]):
        assert a.offset + a.nbytes <= b.offset
    assert lay.sections[-1].offset + lay.sections[-1].nbytes <= lay.length
    assert RecordLayout.from_json(lay.to_json()) == lay


def test_bf16_record_decodes_as_views():
    lay = RecordLayout.build("bf16", 64, 32)
    gate, up, down = _expert()
    rec = encode_expert(lay, gate, up, down)
    gu, dn = decode_record(lay, rec)
    assert gu.shape == (64, 64) and dn.shape == (64, 32)
    assert torch.equal(gu[:32], gate) and torch.equal(gu[32:], up) and torch.equal(dn, down)
    assert gu.data_ptr() == rec.data_ptr()  # a view, no copy
    assert dn.data_ptr() == rec.data_ptr() + lay.section("down").offset
    assert torch.count_nonzero(rec[lay.section("down").offset + dn.numel() * 2 :]) == 0  # zero padding
    gu32, _ = decode_record(lay, rec, torch.float32)
    assert gu32.dtype == torch.float32 and torch.equal(gu32, gu.float())


@pytest.mark.parametrize("kind, tol", [("int4", 0.1), ("int3", 0.2)])
def test_int_record_dequantizes(kind, tol):
    lay = RecordLayout.build(kind, 64, 32, 16)
    gate, up, down = _expert()
    gu, dn = decode_record(lay, encode_expert(lay, gate, up, down), torch.float32)
    ref = torch.cat([gate, up]).float()
    assert (gu - ref).abs().max() < tol * ref.abs().max()
    assert (dn - down.float()).abs().max() < tol * down.float().abs().max()


def test_layout_rejects_bad_group():
    with pytest.raises(UserError, match="group-size"):
        RecordLayout.build("int4", 64, 32, 48)
    with pytest.raises(UserError, match="unknown quantization"):
        RecordLayout.build("int2", 64, 32, 16)
    with pytest.raises(UserError, match="multiple of 8"):
        RecordLayout.build("int3", 64, 36, 4)
    with pytest.raises(UserError, match="shape"):
        encode_expert(RecordLayout.build("bf16", 64, 32), *_expert(i=16))
