"""Q3_K experts into int3 records.

A GGUF whose routed experts are Q3_K is imported like any other (the gguf package dequantizes
it) and packed; `--quant int3 --group-size 16` gives every 16-weight Q3_K sub-block its own
scale. A sub-block holds codes in -4..3 times one scale d * (sc - 32), and llama.cpp's quantizer
aims its largest-magnitude weight at -4; our int3 scale search starts at peak / -4, so such a
sub-block comes back with the same codes and its scale rounded to bf16, the only loss. A
sub-block whose largest code ended on -3 or +3 is kept by the search's candidate with the peak
on -3 (its codes negated with its scale). The synthetic generator's Q3_K writer (bench/synthetic_gguf.to_q3_k) must decode,
through gguf's own dequantizer, to exactly our int3 records' weights.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from gguf_fixtures import write_gguf

from tiermoe.bench.synthetic_gguf import q3_k_blocks, to_q3_k
from tiermoe.cli import main
from tiermoe.store.quant import dequantize_groupwise, quantize_groupwise, unpack_int3
from tiermoe.store.records import decode_record, load_manifest, section_view

Q3_K = gguf.GGMLQuantizationType.Q3_K


def _codes(g: torch.Generator, rows: int, k: int, peak_at_minus_four: bool = True) -> torch.Tensor:
    """int64 [rows, k] codes in -4..3; with peak_at_minus_four every 16-weight sub-block holds a -4
    (where Q3_K's quantizer puts the largest-magnitude weight), else they are uniform."""
    q = torch.randint(-4, 4, (rows, k // 16, 16), generator=g)  # [rows, K/16, 16]
    if peak_at_minus_four:
        q.scatter_(-1, torch.randint(0, 16, (rows, k // 16, 1), generator=g), -4)
    return q.view(rows, k)


def _scales(g: torch.Generator, rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d fp16 [rows, K/256], sc - 32 int64 [rows, K/16] nonzero in -31..31): Q3_K's two scale levels."""
    d = (torch.rand(rows, k // 256, generator=g) * 2e-3 + 1e-4).half()
    sign = torch.randint(0, 2, (rows, k // 16), generator=g) * 2 - 1
    return d, torch.randint(1, 32, (rows, k // 16), generator=g) * sign


def _weights(q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """float32 [rows, K] as Q3_K decodes: (fp32 d * (sc - 32)) * q, per 16-weight sub-block."""
    dl = d.float().repeat_interleave(16, dim=1) * sc.float()  # [rows, K/16]
    return dl.repeat_interleave(16, dim=1) * q.float()


def _blocks(q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor) -> np.ndarray:
    """uint8 [rows, K/256 * 110] Q3_K bytes of codes q [rows, K] and scales (d, sc)."""
    rows, k = q.shape
    u = (q + 4).view(rows, k // 256, 256)  # [rows, B, 256] stored 0..7
    return q3_k_blocks(u, d, sc.view(rows, k // 256, 16)).reshape(rows, -1).numpy()


@pytest.mark.parametrize("group", [16, 64])
def test_q3_k_blocks_decode_like_our_int3(group):
    """to_q3_k (the synthetic model's GGUF side) against gguf's own Q3_K dequantizer, signed scales."""
    g = torch.Generator().manual_seed(group)
    n, k = 6, 512
    packed = torch.randint(0, 256, (2, n, 3 * k // 8), dtype=torch.uint8, generator=g)  # [2, N, 3K/8] bit planes
    sign = torch.randint(0, 2, (2, n, k // group), generator=g) * 2 - 1
    m = torch.randint(8, 16, (2, n, k // group), generator=g) * sign
    s = (m.float() * 2.0**-12).to(torch.bfloat16)  # [2, N, K/G]
    blocks = to_q3_k(packed, s)  # [2, N, K/256 * 110]
    assert blocks.shape == (2, n, k // 256 * 110)
    theirs = torch.from_numpy(np.array(dequantize(blocks.numpy(), Q3_K)))
    ours = torch.stack([dequantize_groupwise(packed[i], s[i], 3, group, torch.float32) for i in range(2)])
    assert torch.equal(theirs, ours)
    with pytest.raises(ValueError, match="not Q3_K-exact"):
        to_q3_k(packed, (s.float() * 1.01).to(torch.bfloat16))


def test_q3_k_sub_blocks_requantize_within_bf16_rounding():
    """Q3_K-shaped codes times per-16 scales -> int3 G16: the same codes, each scale rounded to bf16."""
    g = torch.Generator().manual_seed(0)
    q = _codes(g, 256, 1024)
    d, sc = _scales(g, 256, 1024)
    w = _weights(q, d, sc)  # [256, 1024]
    assert torch.equal(w, torch.from_numpy(np.array(dequantize(_blocks(q, d, sc), Q3_K))))  # gguf reads the same
    packed, s = quantize_groupwise(w, 3, 16)
    assert torch.equal(unpack_int3(packed).long(), q)
    dl = d.float().repeat_interleave(16, dim=1) * sc.float()  # [256, 64] Q3_K's sub-block scales
    assert torch.equal(s, dl.to(torch.bfloat16))
    back = dequantize_groupwise(packed, s, 3, 16, torch.float32)
    rel = ((back - w).norm() / w.norm()).item()
    print(f"Q3_K-shaped codes -> int3 G16: relative error {rel:.5f}")
    assert rel < 0.01


def test_q3_k_sub_blocks_without_minus_four_requantize_within_one_percent():
    g = torch.Generator().manual_seed(1)
    q = _codes(g, 256, 1024, peak_at_minus_four=False)  # about 12 % of sub-blocks hold no -4
    d, sc = _scales(g, 256, 1024)
    w = _weights(q, d, sc)
    packed, s = quantize_groupwise(w, 3, 16)
    rel = ((dequantize_groupwise(packed, s, 3, 16, torch.float32) - w).norm() / w.norm()).item()
    print(f"uniform codes -> int3 G16: relative error {rel:.5f}")
    assert rel < 0.01


def test_q3_k_gguf_imports_and_packs_to_int3(tmp_path, capsys):
    """A qwen3moe GGUF with Q3_K experts -> `tiermoe pack --quant int3 --group-size 16`: every record
    holds Q3_K's codes, and its weights are the GGUF's within bf16 rounding of the scales."""
    shape = {"hidden": 256, "expert_ffn": 256}
    e, f, h = 4, 256, 256
    g = torch.Generator().manual_seed(2)
    raw, codes = {}, {}
    for layer in range(2):
        for proj, (n, k) in (("gate", (f, h)), ("up", (f, h)), ("down", (h, f))):
            q = _codes(g, e * n, k)  # [E N, K]
            d, sc = _scales(g, e * n, k)
            name = f"blk.{layer}.ffn_{proj}_exps.weight"
            raw[name] = (_blocks(q, d, sc).reshape(e, n, -1), Q3_K)
            codes[name] = q.view(e, n, k)
    src = tmp_path / "q3k.gguf"
    weights = write_gguf(src, "qwen3moe", config=shape, raw_tensors=raw)
    assert main(["pack", str(src), str(tmp_path / "st"), "--quant", "int3", "--group-size", "16", "--quiet"]) == 0
    out = capsys.readouterr()
    assert "(int3, group size 16)" in out.out and "Q3_K" not in out.err
    assert main(["pack", str(src), str(tmp_path / "st4"), "--quant", "int4", "--quiet"]) == 0
    assert "note: 6 of the GGUF's 6 expert tensors are Q3_K; --quant int3 --group-size 16" in capsys.readouterr().err
    m = load_manifest(tmp_path / "st")
    worst = 0.0
    with open(m.experts_path, "rb") as fh:
        for r in m.records:
            fh.seek(r.offset)
            buf = np.frombuffer(bytearray(fh.read(r.length)), dtype=np.uint8)
            gu, dn = (unpack_int3(section_view(m.layout, buf, s)).long() for s in ("gate_up_q", "down_q"))
            b = f"blk.{r.layer}"
            assert torch.equal(gu, torch.cat([codes[f"{b}.ffn_gate_exps.weight"][r.expert],
                                              codes[f"{b}.ffn_up_exps.weight"][r.expert]]))
            assert torch.equal(dn, codes[f"{b}.ffn_down_exps.weight"][r.expert])
            got_gu, got_dn = decode_record(m.layout, buf, torch.float32)  # [2I, H], [H, I]
            ref_gu = torch.from_numpy(np.concatenate([weights[f"{b}.ffn_gate_exps.weight"][r.expert],
                                                      weights[f"{b}.ffn_up_exps.weight"][r.expert]]))
            ref_dn = torch.from_numpy(weights[f"{b}.ffn_down_exps.weight"][r.expert])
            for got, ref in ((got_gu, ref_gu), (got_dn, ref_dn)):
                worst = max(worst, ((got - ref).norm() / ref.norm()).item())
    assert len(m.records) == 2 * e and worst < 0.01, worst
