"""The CPU lane's compiled kernel against its plain-torch twin (reference.lane_experts_ref), for
int4, int3, int8 and bf16 records, every instruction set this CPU runs, 1..8 tokens per expert, bf16
and fp32 numerics, the SwiGLU limit, and any thread count (rows split over threads: same bits).
Skipped, with the reason, where no C++ compiler can build it."""

from __future__ import annotations

import pytest
import torch

from tiermoe.kernels.cpu import native
from tiermoe.kernels.layout import ExpertLayout, expert_layout
from tiermoe.kernels.reference import lane_experts_ref, make_record

ISAS = ("scalar", "avx2", "avx512", "avx512bf16")


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    try:
        return native.load_library(native.build_library(tmp_path_factory.mktemp("lane-kernel")))
    except native.NativeUnavailable as exc:
        pytest.skip(f"no compiled lane kernel here: {exc}")


def _flip_signs(rec, layout, gen):
    """Negate a random half of a record's scales (uint8 [R], in place): the store's int3 scales are signed."""
    h, i, g = layout.hidden, layout.inter, layout.group_size
    for off, n in ((layout.gate_up_s, 2 * i * (h // g)), (layout.down_s, h * (i // g))):
        s = rec[off : off + 2 * n].view(torch.int16)  # bf16 bits [n]
        s ^= (torch.rand(n, generator=gen) < 0.5).to(torch.int16) << 15


def _case(kind, hidden, inter, group, n_exp, tokens, seed):
    layout = expert_layout(kind, hidden, inter, group)
    gen = torch.Generator().manual_seed(seed)
    records = [make_record(layout, gen) for _ in range(n_exp)]
    if kind == "int3":
        for rec in records:
            _flip_signs(rec, layout, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).float()  # [T, H] bf16 values
    # expert e serves a subset of the tokens (always at least one), each with its weight
    tok_idx = [torch.randperm(tokens, generator=gen)[: 1 + (e * 3) % tokens].sort().values for e in range(n_exp)]
    tok_w = [torch.rand(len(t), generator=gen) for t in tok_idx]
    return layout, records, x, tok_idx, tok_w


def _run(pool, layout, records, x, tok_idx, tok_w, round_bf16, limit):
    off = torch.tensor([0] + [len(t) for t in tok_idx]).cumsum(0).to(torch.int32)
    out = torch.zeros_like(x)
    pool.run(layout, [r.data_ptr() for r in records], off, torch.cat(tok_idx).to(torch.int32),
             torch.cat(tok_w).float(), x.contiguous(), out, round_bf16, limit)
    return out


# (kind, G, hidden, inter). G = 128 with inter 256: whole blocks of the int4 bf16 dot path. Rows whose steps
# do not fill the accumulators evenly (4 at one token on the bf16 dot paths): int4 G = 64 and int8 G = 32 with
# 192-column down rows (3 steps of 64 columns, 6 of 32); int8 G = 48 (the fp32 paths: 16-column steps
# alternating across groups of 3). int3: G = 32 and 128; 64 (pack's default for int3) with a 192-column
# row, whose 6 vectors of bf16 dot products do not fill the 4 accumulators evenly; 16 (GGUF Q3_K's
# sub-blocks: two groups a vector of bf16 dot products); G = 8 and rows of 72 and 40 columns (the scalar
# path). Three experts, then five for int3.
CASES = [("int4", 32, 256, 128), ("int4", 128, 256, 256), ("int4", 16, 256, 128), ("int4", 64, 256, 192),
         ("int8", 32, 256, 128), ("int8", 64, 256, 128), ("int8", 8, 256, 128), ("int8", 32, 256, 192),
         ("int8", 48, 192, 96), ("bf16", 0, 256, 128), ("int3", 32, 256, 128), ("int3", 128, 256, 256),
         ("int3", 64, 256, 192), ("int3", 16, 256, 128), ("int3", 8, 72, 40)]


@pytest.mark.parametrize("kind,group,hidden,inter", CASES)
@pytest.mark.parametrize("isa", ISAS)
def test_kernel_equals_twin(lib, kind, group, hidden, inter, isa):
    pool = native.LanePool(lib, threads=3, isa=isa)
    n_exp = 5 if kind == "int3" else 3
    try:
        for tokens, round_bf16, limit in ((1, True, None), (3, True, 0.5), (8, False, None), (5, False, 1.0)):
            layout, records, x, idx, w = _case(kind, hidden, inter, group, n_exp, tokens, seed=tokens)
            got = _run(pool, layout, records, x, idx, w, round_bf16, limit)
            want = lane_experts_ref(x, records, idx, w, layout, round_bf16, limit)
            err = float((got - want).abs().max() / want.abs().max())
            assert err < (2e-3 if round_bf16 else 1e-5), (pool.isa, tokens, round_bf16, err)
    finally:
        pool.close()


@pytest.mark.parametrize("kind", ["int4", "int3"])
def test_thread_count_does_not_change_the_bits(lib, kind):
    layout, records, x, idx, w = _case(kind, 512, 256, 64, 4, 6, seed=3)
    outs = []
    for threads in (1, 2, 5):
        pool = native.LanePool(lib, threads=threads)
        try:
            outs.append(_run(pool, layout, records, x, idx, w, True, None))
        finally:
            pool.close()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("kind", ["int4", "int3", "int8", "bf16"])
def test_work_items_and_prefetches_do_not_change_the_bits(lib, kind):
    """Item sizes (one row, odd counts, longer than a matrix) and prefetch distances and localities
    change only which thread computes a row and what it fetches early, never a row's sum."""
    layout, records, x, idx, w = _case(kind, 256, 128, 0 if kind == "bf16" else 64, 4, 5, seed=7)
    outs = []
    for tuning in (native.LaneTuning(), native.LaneTuning(1, 1, 0, 3), native.LaneTuning(7, 3, 5, 2),
                   native.LaneTuning(4096, 4096, 1, 1)):
        pool = native.LanePool(lib, threads=3)
        try:
            pool.tune(tuning)
            outs.append(_run(pool, layout, records, x, idx, w, True, None))
        finally:
            pool.close()
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    pool = native.LanePool(lib, threads=1)
    try:
        for bad in (native.LaneTuning(0, 16, 2, 3), native.LaneTuning(16, 16, -1, 3), native.LaneTuning(16, 16, 2, 4)):
            with pytest.raises(ValueError, match="out of range"):
                pool.tune(bad)
    finally:
        pool.close()


def test_output_is_added_to_and_bad_jobs_are_refused(lib):
    layout, records, x, idx, w = _case("int8", 128, 64, 32, 2, 2, seed=4)
    pool = native.LanePool(lib, threads=2)
    try:
        once = _run(pool, layout, records, x, idx, w, True, None)
        off = torch.tensor([0, len(idx[0]), len(idx[0]) + len(idx[1])], dtype=torch.int32)
        out = once.clone()
        pool.run(layout, [r.data_ptr() for r in records], off, torch.cat(idx).int(), torch.cat(w).float(), x, out,
                 True, None)
        assert torch.allclose(out, 2 * once)
        with pytest.raises(RuntimeError, match="lane kernel failed"):
            pool.run(layout, [0, records[1].data_ptr()], off, torch.cat(idx).int(), torch.cat(w).float(), x, out,
                     True, None)  # a record it cannot read
        with pytest.raises(ValueError):
            pool.run(layout, [r.data_ptr() for r in records], off, torch.cat(idx).long(), torch.cat(w).float(), x, out,
                     True, None)
    finally:
        pool.close()


def test_int3_rows_of_partial_bytes_are_refused(lib):
    """int3 planes hold whole bytes of 4 (8) columns: a row of 36 columns is no record the kernel reads."""
    layout = ExpertLayout("int3", 36, 20, 4, 0, 1024, 2048, 3072, 4096)  # offsets: never read
    rec = torch.zeros(layout.length, dtype=torch.uint8)
    pool = native.LanePool(lib, threads=1)
    try:
        with pytest.raises(RuntimeError, match="lane kernel failed"):
            pool.run(layout, [rec.data_ptr()], torch.tensor([0, 1], dtype=torch.int32),
                     torch.zeros(1, dtype=torch.int32), torch.ones(1), torch.ones(1, 36), torch.zeros(1, 36), True,
                     None)
    finally:
        pool.close()


def test_read_probe_and_missing_compiler(lib, tmp_path, monkeypatch):
    pool = native.LanePool(lib, threads=2)
    try:
        pool.read(torch.ones(1 << 20, dtype=torch.uint8))
    finally:
        pool.close()
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.raises(native.NativeUnavailable, match="no C\\+\\+ compiler"):
        native.build_library(tmp_path)
