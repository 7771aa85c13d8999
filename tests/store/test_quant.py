import pytest
import torch

from tiermoe.store.quant import dequantize_groupwise, quantize_groupwise, unpack_int4


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [16, 32])
def test_round_trip_error_bound(bits, group):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(48, 64, generator=g) * 0.1).to(torch.bfloat16)
    q, s = quantize_groupwise(w, bits, group)
    assert s.dtype == torch.bfloat16 and s.shape == (48, 64 // group)
    assert q.shape == ((48, 64) if bits == 8 else (48, 32))
    assert q.dtype == (torch.int8 if bits == 8 else torch.uint8)
    back = dequantize_groupwise(q, s, bits, group, torch.float32)
    # error <= half a step (plus bf16 rounding of the scale, which can push a value to the clamp)
    step = s.to(torch.float32).repeat_interleave(group, dim=1)
    err = (back - w.float()).abs()
    assert torch.all(err <= 0.5 * step * 1.02 + 1e-7)
    qmax = 127 if bits == 8 else 7
    amax = w.float().abs().reshape(48, -1, group).amax(-1)
    assert torch.allclose(s.float(), (amax / qmax).to(torch.bfloat16).float())


def test_int4_nibble_order_matches_spec():
    # one row, one group of 4: W = [-7, 7, 0, 1] * scale 1 -> q = W, stored q + 8
    w = torch.tensor([[-7.0, 7.0, 0.0, 1.0]])
    q, s = quantize_groupwise(w, 4, 4)
    assert s.float().item() == 1.0
    assert q.tolist() == [[(-7 + 8) | ((7 + 8) << 4), (0 + 8) | ((1 + 8) << 4)]]
    assert unpack_int4(q).tolist() == [[-7, 7, 0, 1]]
    assert dequantize_groupwise(q, s, 4, 4, torch.float32).tolist() == [[-7.0, 7.0, 0.0, 1.0]]


def test_zero_group_scale_is_one_and_round_half_even():
    w = torch.zeros(2, 8)
    w[1, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # scale 1 -> round half to even: 0, 2, -2
    q, s = quantize_groupwise(w, 8, 4)
    assert s.float().tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert q[0].tolist() == [0] * 8
    assert q[1, :4].tolist() == [127, 0, 2, -2]


def test_rejects_bad_shapes():
    with pytest.raises(ValueError):
        quantize_groupwise(torch.zeros(4, 10), 4, 4)
    with pytest.raises(ValueError):
        quantize_groupwise(torch.zeros(4, 8), 3, 4)
    with pytest.raises(ValueError):
        quantize_groupwise(torch.zeros(4, 9), 8, 3)


def test_quantize_leaves_input_alone():
    w = torch.randn(4, 16)
    before = w.clone()
    quantize_groupwise(w, 4, 8)
    assert torch.equal(w, before)
