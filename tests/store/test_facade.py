import random

import pytest
import torch

from store_fixtures import expert_weights, make_checkpoint
from tiermoe.store.facade import ExpertStore
from tiermoe.store.pack import pack

REC = 12288  # bytes of one bf16 record of the tiny checkpoint (H=64, I=32)
GIB = 2**30


def gb(n_experts: float) -> float:
    return n_experts * REC / GIB


def _trace(seed=0, steps=12):
    rnd = random.Random(seed)
    return [[(L, rnd.sample(range(8), rnd.randint(1, 5))) for L in (0, 1)] for _ in range(steps)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t


def _run(store_dir, trace, **kw):
    out = []
    with ExpertStore.open(store_dir, reader_threads=2, **kw) as st:
        for step in trace:
            for L, ids in step:
                got = st.fetch(L, ids)
                assert sorted(got) == sorted(ids)
                out.append({e: (_bits(gu).clone(), _bits(dn).clone()) for e, (gu, dn) in got.items()})
            _check_invariants(st)
        counters = st.counters()
    return out, counters


def _check_invariants(st):
    slots, host = st.residency.slots.keys(), st.residency.host.keys()
    assert not slots & host  # exclusive tiers
    assert set(st._slot_of) == slots and set(st._host_of) == host
    assert len(set(st._slot_of.values())) == len(slots) and len(set(st._host_of.values())) == len(host)
    assert len(slots) <= st.residency.slots.capacity and len(host) <= st.residency.host.capacity


TIER_CONFIGS = {
    "all in slots": dict(gpu_expert_gb=gb(16), host_expert_gb=0),
    "all in host": dict(gpu_expert_gb=0, host_expert_gb=gb(16)),
    "10% host": dict(gpu_expert_gb=0, host_expert_gb=gb(1.6)),
    "0 host": dict(gpu_expert_gb=0, host_expert_gb=0),
    "3 slots + 4 host lru": dict(gpu_expert_gb=gb(3), host_expert_gb=gb(4), policy="lru"),
    "3 slots + 4 host clock": dict(gpu_expert_gb=gb(3), host_expert_gb=gb(4), policy="clock"),
    "2 slots + 2 host lfu": dict(gpu_expert_gb=gb(2), host_expert_gb=gb(2), policy="lfu"),
    "5 slots static": dict(gpu_expert_gb=gb(5), host_expert_gb=gb(2), policy="static"),
}


def test_bf16_fetch_bit_identical_across_tiers(packed_bf16):
    store, tensors = packed_bf16
    trace = _trace()
    ref, _ = _run(store, trace, **TIER_CONFIGS["all in slots"])
    # the reference equals the checkpoint itself
    first = trace[0][0]
    for e in first[1]:
        gate, up, down = expert_weights(tensors, first[0], e)
        assert torch.equal(ref[0][e][0], _bits(torch.cat([gate, up]))) and torch.equal(ref[0][e][1], _bits(down))
    for name, cfg in TIER_CONFIGS.items():
        got, _ = _run(store, trace, **cfg)
        for a, b in zip(ref, got):
            assert a.keys() == b.keys()
            for e in a:
                assert torch.equal(a[e][0], b[e][0]) and torch.equal(a[e][1], b[e][1]), (name, e)


@pytest.mark.parametrize("quant", ["int4", "int3"])
def test_int_fetch_identical_across_tiers(tmp_path, quant):
    make_checkpoint(tmp_path / "src")
    pack(tmp_path / "src", tmp_path / "st", quant=quant, group_size=16, progress=False, log=lambda s: None)
    rec4 = 4096 / GIB  # one int4 or int3 record of the tiny checkpoint
    trace = _trace(seed=3, steps=6)
    ref, _ = _run(tmp_path / "st", trace, gpu_expert_gb=16 * rec4, host_expert_gb=0)
    for cfg in (dict(gpu_expert_gb=0, host_expert_gb=2 * rec4), dict(gpu_expert_gb=rec4 * 3, host_expert_gb=rec4 * 3)):
        got, _ = _run(tmp_path / "st", trace, **cfg)
        assert all(torch.equal(a[e][0], b[e][0]) and torch.equal(a[e][1], b[e][1]) for a, b in zip(ref, got) for e in a)


def test_counters(packed_bf16):
    store, _ = packed_bf16
    trace = [[(0, [0, 1]), (1, [2, 3])]] * 3
    _, c = _run(store, trace, **TIER_CONFIGS["all in slots"])
    assert c["slots"]["hits"] == 12 and c["slots"]["misses"] == 0 and c["decode_tokens"] == 3
    assert c["per_decode_token"]["slots_hits"] == 4 and c["slots"]["resident"] == 16
    _, c = _run(store, trace, **TIER_CONFIGS["0 host"])
    assert c["disk"]["reads"] == 12 and c["per_decode_token"]["disk_reads"] == 4
    assert c["slots"]["capacity"] == 0 and c["host"]["capacity"] == 0
    assert c["disk"]["bytes_read"] == 12 * REC and c["disk"]["reads_in_flight"] == 0
    _, c = _run(store, trace, gpu_expert_gb=0, host_expert_gb=gb(2), policy="lru", preload=False)
    # LRU with 2 host entries: step 1 reads all 4 from disk (keeping the last two), then the
    # access pattern cycles through 4 keys in 2 entries -> every use misses
    assert c["host"]["hits"] + c["disk"]["reads"] == 12 and c["host"]["resident"] == 2


def test_explicit_steps_and_prefetch(packed_bf16):
    store, tensors = packed_bf16
    with ExpertStore.open(store, gpu_expert_gb=0, host_expert_gb=0, reader_threads=2) as st:
        st.begin_step(tokens=4, decode=False)  # a prefill chunk: not in per-decode-token figures
        st.fetch(0, list(range(8)))
        st.begin_step(tokens=1, decode=True)
        st.prefetch(1, [5, 6])
        got = st.fetch(1, [6, 7])
        assert torch.equal(got[6][1], tensors["model.layers.1.mlp.experts.6.down_proj.weight"])
        c = st.counters()
        assert c["disk"]["prefetch_issued"] == 2 and c["disk"]["prefetch_used"] == 1
        assert c["decode_tokens"] == 1 and c["steps"] == 2 and c["per_decode_token"]["disk_reads"] == 2
        for _ in range(4):  # the unused prefetch of expert 5 is dropped after a few steps
            st.begin_step()
        assert st.counters()["disk"]["prefetch_dropped"] == 1 and not st._pending


def test_failed_prefetch_does_not_fail_a_later_fetch(packed_bf16, monkeypatch):
    """A prefetch that hit a transient read error is read again by the fetch that needs the
    record (the fetch itself still fails while the fault lasts)."""
    import errno
    import os

    store, tensors = packed_bf16
    real = os.preadv

    def failing(fd, buffers, offset):
        raise OSError(errno.EIO, "Input/output error")

    with ExpertStore.open(store, gpu_expert_gb=0, host_expert_gb=0, reader_threads=2, direct_io=False) as st:
        st.begin_step(tokens=1, decode=True)
        monkeypatch.setattr(os, "preadv", failing)
        st.prefetch(1, [3, 4])
        for _, fut, _ in list(st._pending.values()):
            fut.exception()  # both prefetches have failed
        with pytest.raises(Exception, match="I/O error"):
            st.fetch(1, [3])  # the fault still lasts: the fresh read fails too
        monkeypatch.setattr(os, "preadv", real)
        got = st.fetch(1, [4])  # its prefetch failed during the fault; the record is read again
        assert torch.equal(got[4][1], tensors["model.layers.1.mlp.experts.4.down_proj.weight"])
        assert st.counters()["disk"]["prefetch_used"] == 0


def test_store_metadata_and_bad_ids(packed_bf16):
    store, _ = packed_bf16
    with ExpertStore.open(store, gpu_expert_gb=0, host_expert_gb=gb(4), reader_threads=2) as st:
        assert st.moe_layers == [0, 1] and st.num_experts == 8
        assert st.config["model_type"] == "qwen3_moe" and st.dtype == torch.bfloat16
        assert sum(st.tier_of(L, e) == "host" for L in (0, 1) for e in range(8)) == 4
        with pytest.raises(ValueError, match="no routed expert 8 in layer 0"):
            st.fetch(0, [8])
        with pytest.raises(ValueError):
            st.fetch(5, [0])


def test_warm_start_from_stats_places_hot_experts(packed_bf16, tmp_path):
    store, _ = packed_bf16
    stats = tmp_path / "stats.json"
    counts = {"model.layers.0.mlp": [0, 0, 50, 0, 0, 0, 0, 9], "model.layers.1.mlp": [1, 0, 0, 0, 40, 0, 0, 0]}
    stats.write_text(__import__("json").dumps(counts))
    with ExpertStore.open(store, gpu_expert_gb=gb(2), host_expert_gb=gb(2), stats_file=stats, reader_threads=2) as st:
        assert {(L, e) for L in (0, 1) for e in range(8) if st.tier_of(L, e) == "slots"} == {(0, 2), (1, 4)}
        assert {(L, e) for L in (0, 1) for e in range(8) if st.tier_of(L, e) == "host"} == {(0, 7), (1, 0)}
        st.fetch(0, [2])
        assert st.counters()["slots"]["hits"] == 1
    with ExpertStore.open(store, gpu_expert_gb=gb(1), host_expert_gb=0, stats_file=stats, static_hot=1, policy="lru",
                          reader_threads=2) as st:
        for e in range(8):  # the static expert survives any churn
            st.fetch(1, [e])
        assert st.tier_of(1, 4) == "slots"  # the hottest (2 * 40/41 picks per token)
