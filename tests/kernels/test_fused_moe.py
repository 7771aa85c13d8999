"""Triton fused MoE vs its plain-torch twin (interpreter on CPU; tiny shapes)."""

import pytest
import torch

from tiermoe.kernels import reference as R
from tiermoe.kernels.layout import expert_layout
from tiermoe.kernels.triton import common as C
from tiermoe.kernels.triton import fused_moe as F

H, I, G, E, K = 64, 32, 32, 6, 3


def _setup(kind, device, seed=0, group=G):
    gen = torch.Generator().manual_seed(seed)
    lay = expert_layout(kind, H, I, group)
    recs = torch.stack([R.make_record(lay, gen) for _ in range(E)]).to(device)  # [E, R]
    table = torch.tensor([recs[e].data_ptr() for e in range(E)], dtype=torch.int64, device=device)
    return lay, recs, table


def _picks(t, gen, e=E, k=K):
    return torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])


def _batch(tokens, seed, device):
    """x bf16 [T, H], distinct picks [T, K], routing weights [T, K] on `device`."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen).to(torch.bfloat16).to(device)
    return x, _picks(tokens, gen).to(device), torch.rand(tokens, K, generator=gen).to(device)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("kind", ["int4", "bf16", "int8"])
@pytest.mark.parametrize("tokens", [1, 4, 20])
def test_fused_moe_matches_twin(kind, tokens, device):
    lay, recs, table = _setup(kind, device)
    x, ids, w = _batch(tokens, tokens, device)
    out = F.fused_moe(x, ids, w, table, lay)
    ref = R.fused_moe_ref(x, ids, w, recs, lay)
    assert out.shape == (tokens, H) and out.dtype == torch.bfloat16
    assert torch.isfinite(out.float()).all()
    assert _rel(out, ref) < 2e-2
    assert (out.float() - ref.float()).abs().max().item() < 0.05 * ref.float().abs().max().item()


def test_pointer_table_only_addresses_matter(device):
    """Same records in two buffers ('slots' and 'host'): any mix of addresses, same bits."""
    lay, recs, table = _setup("int4", device, seed=1)
    copy = recs.clone()
    x, ids, w = _batch(3, 5, device)
    base = F.fused_moe(x, ids, w, table, lay)
    mixed = table.clone()
    mixed[::2] = torch.tensor([copy[e].data_ptr() for e in range(0, E, 2)], dtype=torch.int64, device=device)
    assert torch.equal(F.fused_moe(x, ids, w, mixed, lay), base)


def test_shared_expert_as_extra_row(device):
    lay, recs, table = _setup("int4", device, seed=2)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, H, generator=gen).to(torch.bfloat16).to(device)
    ids = _picks(2, gen, e=E - 1).to(device)  # routed experts 0..E-2, shared = row E-1
    ids = torch.cat([ids, torch.full((2, 1), E - 1, device=device)], 1)
    w = torch.cat([torch.rand(2, K, generator=gen).to(device), torch.ones(2, 1, device=device)], 1)
    out = F.fused_moe(x, ids, w, table, lay)
    assert _rel(out, R.fused_moe_ref(x, ids, w, recs, lay)) < 2e-2


@pytest.mark.parametrize("tokens,block_m", [(1, 16), (5, 16), (16, 16), (40, 16), (9, 4)])
def test_align_matches_twin(tokens, block_m, device):
    gen = torch.Generator().manual_seed(tokens)
    e = 10
    ids = _picks(tokens, gen, e=e, k=4).to(device)
    sp, be = F.moe_align(ids, e, block_m)
    nb = F.nb_max(ids.numel(), e, block_m, tokens)
    sp_ref, be_ref = R.moe_align_ref(ids.cpu(), block_m, nb)
    assert torch.equal(sp.cpu(), sp_ref) and torch.equal(be.cpu(), be_ref)


def test_align_torch_path_matches_twin(device):
    gen = torch.Generator().manual_seed(3)
    ids = _picks(6, gen, e=7, k=3).to(device)
    nb = F.nb_max(ids.numel(), 7, 16, 6) + 3  # any nb >= the bound
    sp, be = C._align_torch(ids, 7, 16, nb)
    sp_ref, be_ref = R.moe_align_ref(ids.cpu(), 16, nb)
    assert torch.equal(sp.cpu(), sp_ref) and torch.equal(be.cpu(), be_ref)


def test_config_validation():
    lay = expert_layout("int4", H, I, G)
    bad = {"gate_up": {"BM": 16, "BN": 32, "BK": 64, "num_warps": 4, "num_stages": 1}}
    bad["down"] = dict(bad["gate_up"])  # BK 64 > the down matrix's K (I = 32)
    with pytest.raises(ValueError, match="must divide N"):
        F._check_config(lay, bad, 1)
    ok = {"gate_up": dict(bad["gate_up"]), "down": {**bad["down"], "BK": 32}}  # a K tile of two groups of 32
    F._check_config(lay, ok, 1)
    with pytest.raises(ValueError, match="divide one another"):
        F._check_config(expert_layout("int8", 96, 48, 24), {"gate_up": {**ok["gate_up"], "BN": 16, "BK": 16},
                                                            "down": {**ok["down"], "BK": 16}}, 1)
    assert F.token_bucket(1) == "decode" and F.token_bucket(8192) == "prefill"


@pytest.mark.parametrize("kind", ["int4", "bf16"])
def test_swiglu_limit_matches_twin_and_bites(kind, device):
    """GLM-5.3's clamp (gate <= L, |up| <= L) in the kernel epilogue, at a limit that clips
    about half of the projections of these random records."""
    lay, recs, table = _setup(kind, device, seed=5)
    x, ids, w = _batch(4, 9, device)
    gu = R.dequant_matrix(recs[0].cpu(), lay, "gate_up").float()  # [2I, H]
    limit = float((x.cpu().float() @ gu.t()).abs().median())
    out = F.fused_moe(x, ids, w, table, lay, swiglu_limit=limit)
    ref = R.fused_moe_ref(x, ids, w, recs, lay, swiglu_limit=limit)
    unclamped = R.fused_moe_ref(x, ids, w, recs, lay)
    assert _rel(out, ref) < 2e-2
    assert _rel(unclamped, ref) > 0.05  # the clamp changed the result
    # the twin's clamp is the model's: moe.experts.expert_mlp on the dequantized weights
    from tiermoe.moe.experts import expert_mlp

    e = int(ids[0, 0])
    dn = R.dequant_matrix(recs[e].cpu(), lay, "down").float()
    gu_e = R.dequant_matrix(recs[e].cpu(), lay, "gate_up").float()
    want = expert_mlp(x[:1].cpu().float(), gu_e, dn, limit)
    got = R.expert_ref(x[:1].cpu(), recs[e].cpu(), lay, limit)
    assert _rel(got, want) < 1e-2


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("tokens", [1, 20])
def test_k_tiles_spanning_several_groups_match_twin(kind, tokens, device):
    """Groups of 16 with K tiles of 64 (gate_up) and 32 (down): each tile gathers a scale per
    row instead of one per output row; same function as the twin and as narrower tiles."""
    lay, recs, table = _setup(kind, device, seed=5, group=16)
    x, ids, w = _batch(tokens, tokens, device)
    wide = {"gate_up": {"BM": 16, "BN": 32, "BK": 64, "num_warps": 4, "num_stages": 1},
            "down": {"BM": 16, "BN": 32, "BK": 32, "num_warps": 4, "num_stages": 1}}
    # int8: one-group tiles; int4 tiles stay >= 32 (a dot of K >= 16 per nibble half on the GPU)
    narrow = {st: {**c, "BK": 16 if kind == "int8" else 32} for st, c in wide.items()}
    out = F.fused_moe(x, ids, w, table, lay, config=wide)
    ref = R.fused_moe_ref(x, ids, w, recs, lay)
    assert _rel(out, ref) < 2e-2
    assert _rel(out, F.fused_moe(x, ids, w, table, lay, config=narrow)) < 1e-2


def _gemv_config(lay, bn, bk, max_tokens=4, acc=("tile", "row")):
    """gate_up and down with the two accumulator forms (a tile reduced at the end, a row per tile)."""
    base = F.default_config(lay, 1)
    stages = zip(("gate_up", "down"), acc)
    gemv = {st: {"BN": bn, "BK": bk, "num_warps": 4, "num_stages": 2, "acc": a} for st, a in stages}
    return {**base, "gemv": {**gemv, "max_tokens": max_tokens}}


@pytest.mark.parametrize(
    "kind,group,bk", [("int4", 32, 16), ("int4", 16, 32), ("int8", 16, 16), ("int8", 16, 32), ("bf16", 32, 32)]
)
@pytest.mark.parametrize("tokens", [1, 3])
def test_gemv_decode_path_matches_twin(kind, group, bk, tokens, device):
    """Few-token steps through the per-pick matrix-vector kernel (moe_gemv.py), K tiles within
    one scale group and across several: the twin's function, and the block kernel's to rounding;
    a SwiGLU limit clamps as there. More tokens than the config's max_tokens take the block kernel."""
    lay, recs, table = _setup(kind, device, seed=7, group=group)
    x, ids, w = _batch(tokens, tokens + 10, device)
    cfg, swapped = _gemv_config(lay, 16, bk), _gemv_config(lay, 16, bk, acc=("row", "tile"))
    for limit in (None, 0.5):
        out = F.fused_moe(x, ids, w, table, lay, config=cfg, swiglu_limit=limit)
        assert _rel(out, F.fused_moe(x, ids, w, table, lay, config=swapped, swiglu_limit=limit)) < 1e-2
        ref = R.fused_moe_ref(x, ids, w, recs, lay, swiglu_limit=limit)
        assert out.shape == (tokens, H) and torch.isfinite(out.float()).all()
        assert _rel(out, ref) < 2e-2
        assert _rel(out, F.fused_moe(x, ids, w, table, lay, swiglu_limit=limit)) < 2e-2
    above = _gemv_config(lay, 16, bk, max_tokens=tokens - 1)
    assert torch.equal(F.fused_moe(x, ids, w, table, lay, config=above), F.fused_moe(x, ids, w, table, lay))


def test_gemv_is_exact_across_tiers_and_rejects_bad_tiles(device):
    """Like the block kernel: only the addresses change between tiers, so the bits do not."""
    lay, recs, table = _setup("int4", device, seed=3)
    copy = recs.clone()
    x, ids, w = _batch(2, 9, device)
    cfg = _gemv_config(lay, 32, 32)
    mixed = table.clone()
    mixed[1::2] = torch.tensor([copy[e].data_ptr() for e in range(1, E, 2)], dtype=torch.int64, device=device)
    assert torch.equal(F.fused_moe(x, ids, w, mixed, lay, config=cfg), F.fused_moe(x, ids, w, table, lay, config=cfg))
    bad = _gemv_config(lay, 48, 32)  # 48 does not divide I = 32
    with pytest.raises(ValueError, match="gemv gate_up"):
        F.fused_moe(x, ids, w, table, lay, config=bad)


def test_block_tiles_keep_the_dot_at_16(device):
    """tl.dot needs K >= 16 on the GPU (the interpreter does not check): int4 tiles split BK
    into two nibble halves, so BK >= 32 there; a small group size must not pull the default below."""
    lay, _, _ = _setup("int4", device, seed=1, group=16)
    assert all(F.default_config(lay, t)[s]["BK"] >= 32 for t in (1, 64) for s in ("gate_up", "down"))
    cfg = F.default_config(lay, 1)
    cfg["down"] = {**cfg["down"], "BK": 16}
    with pytest.raises(ValueError, match="down: BK=16 is below 32"):
        F._check_config(lay, cfg, 1)


def test_int4_values_without_int_to_float_conversion(device):
    """The kernels turn nibbles into float32 (n - 8) with float bit tricks (no int -> float
    conversion instruction): the same 16 values as the plain conversion, exactly."""
    import triton
    import triton.language as tl

    @triton.jit
    def values(q_ptr, s_ptr, lo_ptr, hi_ptr, i8_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        q = tl.load(q_ptr + offs)
        tl.store(lo_ptr + offs, C.int4_value(q & 15))
        tl.store(hi_ptr + offs, C.int4_value(q >> 4))
        tl.store(i8_ptr + offs, C.int8_value(tl.load(s_ptr + offs)))

    q = torch.arange(256, dtype=torch.uint8, device=device)  # every byte: both nibbles 0..15
    s = torch.arange(-128, 128, dtype=torch.int8, device=device)  # every int8 weight
    lo, hi, i8 = (torch.empty(256, dtype=torch.float32, device=device) for _ in range(3))
    values[(1,)](q, s, lo, hi, i8, BLOCK=256)
    want = torch.arange(256, dtype=torch.int32, device=device)
    assert torch.equal(lo, ((want & 15) - 8).float()) and torch.equal(hi, ((want >> 4) - 8).float())
    assert torch.equal(i8, s.float())


# ----------------------------------------------------------------------------- int3

H3, I3 = 128, 64  # int3 block tiles take K >= 64 (four phase dots of K >= 16): I = 32 is too narrow


def _setup_int3(device, group, seed=0):
    """int3 records of H3 x I3 with signed scales (the quantizer's scale may be negative): every
    other scale of make_record's positive ones negated."""
    gen = torch.Generator().manual_seed(seed)
    lay = expert_layout("int3", H3, I3, group)
    recs = []
    for _ in range(E):
        rec = R.make_record(lay, gen)
        for off, n in ((lay.gate_up_s, 2 * I3 * H3 // group), (lay.down_s, H3 * I3 // group)):
            s = rec[off : off + 2 * n].view(torch.bfloat16)
            s[::2] = -s[::2]
        recs.append(rec)
    recs = torch.stack(recs).to(device)  # [E, R]
    table = torch.tensor([recs[e].data_ptr() for e in range(E)], dtype=torch.int64, device=device)
    x_gen = torch.Generator().manual_seed(seed + 100)
    return lay, recs, table, x_gen


def _batch_int3(tokens, gen, device):
    x = torch.randn(tokens, H3, generator=gen).to(torch.bfloat16).to(device)  # [T, H]
    return x, _picks(tokens, gen).to(device), torch.rand(tokens, K, generator=gen).to(device)


@pytest.mark.parametrize("group,tokens", [(32, 1), (32, 20), (64, 4)])
def test_int3_block_kernel_matches_twin(group, tokens, device):
    """The block kernel on int3 records: default tiles of K 64, i.e. two scale groups of 32 (Q4_0's
    block) per tile, each phase row taking its group's scale, or one group of 64; decode (one
    block per expert) and prefill (the torch block plan) sizes; a SwiGLU limit clamps as in the twin."""
    lay, recs, table, gen = _setup_int3(device, group)
    assert all(F.default_config(lay, tokens)[s]["BK"] == 64 for s in ("gate_up", "down"))
    x, ids, w = _batch_int3(tokens, gen, device)
    for limit in (None, 0.5) if tokens == 4 else (None,):
        out = F.fused_moe(x, ids, w, table, lay, swiglu_limit=limit)
        ref = R.fused_moe_ref(x, ids, w, recs, lay, swiglu_limit=limit)
        assert out.shape == (tokens, H3) and torch.isfinite(out.float()).all()
        assert _rel(out, ref) < 2e-2
        assert (out.float() - ref.float()).abs().max().item() < 0.05 * ref.float().abs().max().item()


@pytest.mark.parametrize("group,bk,tokens", [(32, 64, 2), (64, 32, 1)])
def test_int3_gemv_decode_path_matches_twin(group, bk, tokens, device):
    """The matrix-vector path on int3 records (eight phases of 16-bit low-plane words and
    high-plane bytes), K tiles spanning two scale groups and within one: the twin's function and
    the block kernel's to rounding, both accumulator forms, with and without a SwiGLU limit."""
    lay, recs, table, gen = _setup_int3(device, group, seed=1)
    x, ids, w = _batch_int3(tokens, gen, device)
    cfg = _gemv_config(lay, 32, bk)
    for limit in (None, 0.5):
        out = F.fused_moe(x, ids, w, table, lay, config=cfg, swiglu_limit=limit)
        ref = R.fused_moe_ref(x, ids, w, recs, lay, swiglu_limit=limit)
        assert torch.isfinite(out.float()).all() and _rel(out, ref) < 2e-2
        assert _rel(out, F.fused_moe(x, ids, w, table, lay, swiglu_limit=limit)) < 1e-2


def test_int3_configs_rejected_where_the_kernels_cannot_run():
    """Block tiles of K below 64 (a phase dot below 16), tiles spanning groups whose size is not a
    multiple of 4 (one scale per low-plane byte); matrix-vector words of 8 columns whose 16-bit
    loads would be misaligned (K not a multiple of 16) or would straddle a group."""
    lay = expert_layout("int3", H3, I3, 32)
    cfg = F.default_config(lay, 1)
    with pytest.raises(ValueError, match="BK=32 is below 64"):
        F._check_config(lay, {**cfg, "down": {**cfg["down"], "BK": 32}}, 1)
    tiny_groups = expert_layout("int3", H3, I3, 2)
    with pytest.raises(ValueError, match="multiple of 4"):
        F._check_config(tiny_groups, F.default_config(tiny_groups, 1), 1)
    from tiermoe.kernels.triton.moe_gemv import check_gemv_config

    gemv = {"BN": 8, "BK": 8, "num_warps": 4, "num_stages": 2}
    check_gemv_config(expert_layout("int3", H3, I3, 8), {"gate_up": gemv, "down": gemv})
    with pytest.raises(ValueError, match="int3 needs"):  # K = 72: rows of 27 bytes
        check_gemv_config(expert_layout("int3", H3, 72, 8), {"gate_up": gemv, "down": gemv})
    with pytest.raises(ValueError, match="int3 needs"):  # a 16-column tile over groups of 4
        check_gemv_config(expert_layout("int3", H3, I3, 4), {"gate_up": {**gemv, "BK": 16}, "down": gemv})


def test_int3_values_without_int_to_float_conversion(device):
    """int3_value in both tile forms the kernels use: a low-plane byte with its high nibble
    (positions 0..3, block kernel) and a 16-bit low-plane word with a high-plane byte (positions
    0..7, matrix-vector kernel): exactly the stored code minus 4, for every bit pattern."""
    import triton
    import triton.language as tl

    @triton.jit
    def values(lo_ptr, hi_ptr, out_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        lo = tl.load(lo_ptr + offs)
        hi = tl.load(hi_ptr + offs)
        for c in tl.static_range(8):
            tl.store(out_ptr + c * BLOCK + offs, C.int3_value(lo, hi, c))

    n = 1 << 16
    lo = torch.arange(n, dtype=torch.int32)  # every 16-bit low-plane word
    hi = (lo * 40503 >> 5) & 255  # high-plane bytes varying independently of lo
    out = torch.empty(8, n, dtype=torch.float32, device=device)
    values[(1,)](lo.to(device), hi.to(device), out, BLOCK=n)
    want = torch.stack([((lo >> (2 * c)) & 3) + 4 * ((hi >> c) & 1) - 4 for c in range(8)]).float()
    assert torch.equal(out.cpu(), want)


# ----------------------------------------------------------------------------- mixed stores


def _setup_mixed(kinds, h, i, seed=0):
    """A mixed store's layer: E tier entries of the longest layout's length, expert e's record of
    layout kind_table[e] at the start of its entry and random bytes after it (junk the kernel must
    never read). kinds: ((kind, group), ...) in layout order; experts alternate 0, 1, 0, 1, ...
    except that the last two are of layout 0 (so a block's neighbours are of either kind)."""
    gen = torch.Generator().manual_seed(seed)
    lays = [expert_layout(kind, h, i, group or 128) for kind, group in kinds]
    table_kinds = torch.tensor([e % len(lays) if e < E - 2 else 0 for e in range(E)], dtype=torch.int8)
    length = max(lay.length for lay in lays)
    entries = torch.randint(0, 256, (E, length), dtype=torch.uint8, generator=gen)  # [E, R]
    for e in range(E):
        lay = lays[int(table_kinds[e])]
        entries[e, : lay.length] = R.make_record(lay, gen)
    return lays, entries, table_kinds, gen


def _addresses(entries, device):
    return torch.tensor([entries[e].data_ptr() for e in range(E)], dtype=torch.int64, device=device)


MIXED = {"int4+int3": ((("int4", 32), ("int3", 32)), 128, 64), "bf16+int4": ((("bf16", 0), ("int4", 32)), H, I)}


@pytest.mark.parametrize("mix", list(MIXED))
@pytest.mark.parametrize("tokens", [1, 20])
def test_mixed_kinds_match_twin_and_are_exact_across_tiers(mix, tokens, device):
    """A kind table over records of two layouts: one launch per layout over one block plan (decode:
    the one-program plan; 20 tokens: the torch plan), each skipping the other's blocks, then one
    pick-order sum: the twin's function with each record read at its own layout. The same records
    in a second buffer ('host' beside 'slots'), any mix of addresses: the same bits."""
    kinds, h, i = MIXED[mix]
    lays, entries, table_kinds, gen = _setup_mixed(kinds, h, i, seed=tokens)
    entries, kt = entries.to(device), table_kinds.to(device)
    x = torch.randn(tokens, h, generator=gen).to(torch.bfloat16).to(device)  # [T, H]
    ids, w = _picks(tokens, gen).to(device), torch.rand(tokens, K, generator=gen).to(device)
    slots = _addresses(entries, device)
    out = F.fused_moe(x, ids, w, slots, lays, kind_table=kt)
    ref = R.fused_moe_ref(x, ids, w, entries, lays, kinds=table_kinds)
    assert torch.equal(R.fused_moe_ref(x, ids, w, entries, [lays[k] for k in table_kinds.tolist()]), ref)
    assert out.shape == (tokens, h) and torch.isfinite(out.float()).all()
    assert _rel(out, ref) < 2e-2
    assert (out.float() - ref.float()).abs().max().item() < 0.05 * ref.float().abs().max().item()
    host = entries.clone()
    mixed = slots.clone()
    mixed[1::3] = _addresses(host, device)[1::3]
    assert torch.equal(F.fused_moe(x, ids, w, mixed, lays, kind_table=kt.to(torch.int32)), out)
    assert torch.equal(F.fused_moe(x, ids, w, _addresses(host, device), lays, kind_table=kt), out)


def test_mixed_matrix_vector_and_block_kernels_share_a_step(device):
    """Each layout takes the kernel its own configuration says: the hot int4 experts the
    matrix-vector kernel (a decode entry with "gemv"), the bf16 ones the block kernel, in one
    step; the twin's function, with a SwiGLU limit too, and bit-identical across tiers. Both
    layouts on the matrix-vector kernel as well."""
    lays, entries, table_kinds, gen = _setup_mixed((("int4", 32), ("bf16", 0)), H, I, seed=3)
    entries, kt = entries.to(device), table_kinds.to(device)
    x = torch.randn(3, H, generator=gen).to(torch.bfloat16).to(device)
    ids, w = _picks(3, gen).to(device), torch.rand(3, K, generator=gen).to(device)
    both = [_gemv_config(lay, 16, 32) for lay in lays]
    for cfg in ([both[0], F.default_config(lays[1], 3)], both):
        for limit in (None, 0.5):
            out = F.fused_moe(x, ids, w, _addresses(entries, device), lays, config=cfg, kind_table=kt,
                              swiglu_limit=limit)
            ref = R.fused_moe_ref(x, ids, w, entries, lays, swiglu_limit=limit, kinds=table_kinds)
            assert _rel(out, ref) < 2e-2
        host = entries.clone()  # kept alive: the table holds its addresses
        moved = F.fused_moe(x, ids, w, _addresses(host, device), lays, config=cfg, kind_table=kt, swiglu_limit=limit)
        assert torch.equal(moved, out)


def test_one_kind_table_is_the_uniform_path(device):
    """A kind table naming one layout for every expert runs the same kernels as no table (the
    uniform path): the same bits, block and matrix-vector kernels; a mixed call checks its inputs."""
    lay, recs, table = _setup("int4", device, seed=4)
    x, ids, w = _batch(3, 4, device)
    kt = torch.zeros(E, dtype=torch.int32, device=device)
    assert torch.equal(F.fused_moe(x, ids, w, table, [lay], kind_table=kt), F.fused_moe(x, ids, w, table, lay))
    cfg = _gemv_config(lay, 16, 32)
    assert torch.equal(F.fused_moe(x, ids, w, table, [lay], config=[cfg], kind_table=kt),
                       F.fused_moe(x, ids, w, table, lay, config=cfg))
    with pytest.raises(ValueError, match="kind_table"):
        F.fused_moe(x, ids, w, table, [lay], kind_table=kt.to(torch.int64))
    with pytest.raises(ValueError, match="different shapes"):
        F.fused_moe(x, ids, w, table, [lay, expert_layout("int4", H, 2 * I, G)], kind_table=kt)


def test_mixed_configs_share_one_block_plan():
    """Layouts whose own configurations differ in BM run their block launches at the first block
    layout's BM (one plan); a layout on the matrix-vector kernel does not set it."""
    lays = [expert_layout("int4", H, I, G), expert_layout("int8", H, I, G)]
    own = [F.default_config(lay, 20) for lay in lays]
    own[1] = {st: {**c, "BM": 32} for st, c in own[1].items()}
    cfgs = F.mixed_configs(lays, 20, None, own)
    assert [c[st]["BM"] for c in cfgs for st in ("gate_up", "down")] == [own[0]["gate_up"]["BM"]] * 4
    gemv_first = [_gemv_config(lays[0], 16, 32, max_tokens=32), own[1]]
    assert all(c["down"]["BM"] == 32 for c in F.mixed_configs(lays, 20, None, gemv_first))
