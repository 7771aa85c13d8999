"""Device-side expert cache (Triton) vs its plain-torch twin, step by step."""

import pytest
import torch

from tiermoe.kernels import reference as R
from tiermoe.kernels.layout import expert_layout
from tiermoe.kernels.triton import cache_manager as C
from tiermoe.kernels.triton import fused_moe as F

REC = 8192  # bytes per fake record in the pure-cache tests


SCRATCH_BASE = 1 << 30


def _fake_cache(e, s, device, admit_max=None, admission_filter=True, scratch=0, record_words=None):
    host = torch.arange(e, dtype=torch.int64, device=device) * REC + (1 << 40)  # addresses only
    return C.ExpertCache(
        host,
        1 << 20,
        s,
        REC,
        extra_ptrs=torch.tensor([7], device=device),
        admit_max=admit_max,
        admission_filter=admission_filter,
        decay_shift=3,
        scratch_base=SCRATCH_BASE,
        scratch_slots=scratch,
        record_words=record_words,
    )


def _twin_state(cache):
    return {k: v.clone().cpu() for k, v in cache.state().items()}


def _check_equal(cache, st):
    got = cache.state()
    n = int(st["n_copy"][0])
    for key, want in st.items():
        g = got[key].cpu()
        if key in ("copy_src", "copy_dst", "copy_len"):
            g, want = g[:n], want[:n]
        assert torch.equal(g, want), (key, g, want)


@pytest.mark.parametrize(
    "e,s,tokens,k,admit_max,filt,scratch",
    [
        (12, 4, 1, 3, None, True, 3),
        (12, 4, 2, 3, None, False, 0),
        (10, 3, 3, 2, 2, True, 2),
        (9, 9, 2, 2, None, True, 0),
        (8, 0, 1, 3, None, True, 3),
        (16, 6, 1, 4, 1, False, 4),
    ],
)
def test_cache_step_matches_twin(e, s, tokens, k, admit_max, filt, scratch, device):
    cache = _fake_cache(e, s, device, admit_max, filt, scratch)
    st = _twin_state(cache)
    gen = torch.Generator().manual_seed(e * 100 + s)
    popular = torch.linspace(3.0, 0.2, e)  # skewed picks, so hits and evictions both happen
    for step in range(25):
        ids = torch.stack([torch.multinomial(popular, k, generator=gen) for _ in range(tokens)])
        C.cache_step(cache, ids.to(device))
        R.cache_step_ref(st, ids, cache.admit_max, filt, 3, (SCRATCH_BASE, scratch, REC))
        _check_equal(cache, st)
    lookups, hits, misses, admitted, words = st["stats"].tolist()
    assert words == misses * (REC // 4)  # every miss moves a whole record here
    assert lookups == hits + misses and admitted <= misses
    if s:
        assert hits > 0 and admitted > 0
    # invariants: tables agree with each other
    se, es, table = cache.slot_expert.cpu(), cache.expert_slot.cpu(), cache.ptr_table.cpu()
    for slot, ex in enumerate(se.tolist()):
        if ex >= 0:
            assert es[ex] == slot and table[ex] == cache.slot_addr[slot].item()
    assert int(table[-1]) == 7  # extra rows untouched


ZERO_ADDR = 1 << 36  # the all-zero record's address (fake)


@pytest.mark.parametrize(
    "e,s,tokens,k,lane_max,scratch,share",
    [(12, 4, 1, 4, 2, 3, 1024), (16, 3, 3, 3, 4, 2, 1024), (8, 0, 2, 3, 3, 0, 1024), (16, 3, 3, 3, 6, 2, 400)],
)
def test_lane_choice_matches_twin(e, s, tokens, k, lane_max, scratch, share, device):
    """Fast mode: of the misses not admitted, the coldest go to the CPU lane (listed, not staged,
    their step-table rows at the zero record), as many as the cost model's share of the step's
    misses (lane_share / 1024, at most lane_max); admissions and residency stay those of exact
    mode (a cache without the lane, stepped alongside). Step by step against the twin, with
    steps without the lane and a smaller lane_max in between, as a mode switch would give."""
    host = torch.arange(e, dtype=torch.int64, device=device) * REC + (1 << 40)
    make = lambda cap: C.ExpertCache(
        host,
        1 << 20,
        s,
        REC,
        extra_ptrs=torch.tensor([7], device=device),  # noqa: E731
        decay_shift=3,
        scratch_base=SCRATCH_BASE,
        scratch_slots=scratch,
        lane_max=cap,
    )
    cache, exact = make(lane_max), make(0)
    assert cache.lane_max == 0 and int(cache.lane_share) == 1024  # off until its owner sets it (with a zero record)
    cache.zero_addr = ZERO_ADDR
    cache.lane_share.fill_(share)
    st = _twin_state(cache)
    gen = torch.Generator().manual_seed(e + 7 * s)
    popular = torch.linspace(3.0, 0.2, e)
    sent = 0
    for step in range(24):
        on = step not in (5, 6)  # steps without the lane in between
        cache.lane_max = lane_max if step < 12 else max(1, lane_max // 2)
        ids = torch.stack([torch.multinomial(popular, k, generator=gen) for _ in range(tokens)])
        misses_before = int(cache.stats[2])
        C.cache_step(cache, ids.to(device), lane=on)
        C.cache_step(exact, ids.to(device))
        R.cache_step_ref(
            st, ids, cache.admit_max, True, 3, (SCRATCH_BASE, scratch, REC), (cache.lane_max if on else 0, ZERO_ADDR)
        )
        _check_equal(cache, st)
        for key in ("slot_expert", "expert_slot", "ptr_table", "freq", "stats"):
            assert torch.equal(getattr(cache, key), getattr(exact, key)), key
        lane = [x for x in cache.lane_ids.tolist() if x >= 0] if on else []
        sent += len(lane)
        misses = int(cache.stats[2] - misses_before) if on else 0
        assert len(lane) <= min(cache.lane_max, (misses * share + 512) >> 10)
        assert not any(int(cache.expert_slot[x]) >= 0 for x in lane)
        assert all(int(cache.step_table[x]) == ZERO_ADDR for x in lane)
        copied = set(cache.copy_src[: int(cache.n_copy)].tolist())
        assert not copied & {int(cache.host_addr[x]) for x in lane}  # no PCIe bytes for lane experts
    assert sent > 0
    cache.lane_max = lane_max + 1
    with pytest.raises(ValueError, match="lane_cap"):
        C.cache_step(cache, ids.to(device), lane=True)


def test_warm_start_then_hits(device):
    cache = _fake_cache(12, 4, device)
    cache.warm_start([5, 6, 7, 8])
    st = _twin_state(cache)
    ids = torch.tensor([[5, 6, 0]])
    C.cache_step(cache, ids.to(device))
    R.cache_step_ref(st, ids, cache.admit_max, True, 3, (0, 0, REC))
    _check_equal(cache, st)
    assert cache.stats.tolist() == [3, 2, 1, 1, REC // 4]  # one miss: one record's words
    # the admitted expert 0 replaced one of the unused warm experts (7 or 8), not 5 or 6
    assert set(cache.slot_expert.tolist()) in ({5, 6, 0, 8}, {5, 6, 7, 0})


def test_admission_filter_protects_popular_experts(device):
    cache = _fake_cache(10, 2, device)
    cache.warm_start([0, 1])
    rate = torch.zeros(10)
    rate[0], rate[1] = 0.9, 0.8
    cache.warm_frequencies(rate.to(device))
    for e in (5, 6, 7):  # one-off picks of rare experts: read in place, never admitted
        C.cache_step(cache, torch.tensor([[e]], device=device))
    assert sorted(cache.slot_expert.tolist()) == [0, 1] and cache.stats.tolist()[3] == 0
    plain = _fake_cache(10, 2, device, admission_filter=False)
    plain.warm_start([0, 1])
    for e in (5, 6, 7):
        C.cache_step(plain, torch.tensor([[e]], device=device))
    assert 0 not in plain.slot_expert.tolist() and plain.stats.tolist()[3] == 3  # plain CLOCK churns


def test_gather_records_copies_bytes(device):
    src = torch.randint(0, 256, (5, REC), dtype=torch.uint8, device=device)
    dst = torch.zeros(3, REC, dtype=torch.uint8, device=device)
    pairs = [(4, 0), (1, 2)]
    cs = torch.tensor([src[a].data_ptr() for a, _ in pairs] + [0], dtype=torch.int64, device=device)
    cd = torch.tensor([dst[b].data_ptr() for _, b in pairs] + [0], dtype=torch.int64, device=device)
    C.gather_records(cs, cd, torch.tensor([2], dtype=torch.int32, device=device), REC, programs=4)
    want = R.gather_records_ref(src.cpu(), torch.zeros(3, REC, dtype=torch.uint8), pairs)
    assert torch.equal(dst.cpu(), want)


def test_mixed_store_copies_move_each_records_own_words(device):
    """A mixed store's shorter records: every admitted or staged copy carries its expert's own length
    (the twin agrees step by step), and the gather moves only those words, the rest of the row as it
    was."""
    e = 12
    words = torch.tensor([REC // 4 if x % 3 else REC // 8 for x in range(e)], dtype=torch.int32)  # [E]
    cache = _fake_cache(e, 4, device, scratch=3, record_words=words.to(device))
    st = _twin_state(cache)
    gen = torch.Generator().manual_seed(5)
    for _ in range(20):
        ids = torch.stack([torch.multinomial(torch.linspace(3.0, 0.2, e), 3, generator=gen) for _ in range(2)])
        C.cache_step(cache, ids.to(device))
        R.cache_step_ref(st, ids, cache.admit_max, True, 3, (SCRATCH_BASE, 3, REC))
        _check_equal(cache, st)
        n = int(cache.n_copy)
        assert n and cache.copy_len[:n].tolist() == [int(words[(int(a) - (1 << 40)) // REC])
                                                      for a in cache.copy_src[:n].tolist()]
    src = torch.randint(0, 256, (3, REC), dtype=torch.uint8, device=device)
    dst = torch.full((2, REC), 7, dtype=torch.uint8, device=device)
    cs = torch.tensor([src[2].data_ptr(), src[0].data_ptr()], dtype=torch.int64, device=device)
    cd = torch.tensor([dst[0].data_ptr(), dst[1].data_ptr()], dtype=torch.int64, device=device)
    lens = torch.tensor([REC // 4, 1000], dtype=torch.int32, device=device)  # whole, then 4000 bytes
    C.gather_records(cs, cd, torch.tensor([2], dtype=torch.int32, device=device), REC, copy_len=lens, programs=3)
    assert torch.equal(dst[0], src[2]) and torch.equal(dst[1, :4000], src[0, :4000])
    assert bool((dst[1, 4000:] == 7).all())


def test_cached_moe_is_bit_exact_for_any_budget(device):
    """Decode steps through the cache + gather + fused MoE equal the all-host result bitwise."""
    lay = expert_layout("int4", 64, 32, 32)
    e, k = 8, 2
    gen = torch.Generator().manual_seed(11)
    host = torch.stack([R.make_record(lay, gen) for _ in range(e + 1)]).to(device)  # +1 shared
    host_ptrs = torch.tensor([host[j].data_ptr() for j in range(e + 1)], dtype=torch.int64, device=device)
    steps = [torch.multinomial(torch.linspace(2, 0.5, e), k, generator=gen).view(1, k) for _ in range(6)]
    xs = [torch.randn(1, 64, generator=gen).to(torch.bfloat16) for _ in steps]
    outs = {}
    for s in (0, 3, e):
        slots = torch.zeros(max(s, 1), lay.length, dtype=torch.uint8, device=device)
        scratch = torch.zeros(2, lay.length, dtype=torch.uint8, device=device)
        cache = C.ExpertCache(
            host_ptrs[:e],
            slots.data_ptr(),
            s,
            lay.length,
            extra_ptrs=host_ptrs[e:],
            max_picks=8,
            scratch_base=scratch.data_ptr(),
            scratch_slots=1 if s == 3 else 2,
        )
        cache.gather_programs = 4
        res = []
        for ids, x in zip(steps, xs):
            ids = ids.to(device)
            cache.step(ids)
            full = torch.cat([ids, torch.full((1, 1), e, device=device)], 1)
            w = torch.tensor([[0.7, 0.3, 1.0]], device=device)
            res.append(F.fused_moe(x.to(device), full, w, cache.step_table, lay))
        outs[s] = torch.cat(res)
        for slot, ex in enumerate(cache.slot_expert.tolist()[:s]):
            if ex >= 0:
                assert torch.equal(slots[slot], host[ex])  # admitted records really copied
        if s:
            assert cache.stats[1] > 0  # some hits
    assert torch.equal(outs[0], outs[3]) and torch.equal(outs[0], outs[e])
