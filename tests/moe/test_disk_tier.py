"""The device cache over a host tier that holds only some experts (moe/disk_tier.py): the rest are read
from disk when a step picks them, decode steps asking through the residency mailbox (no host sync),
other steps loading synchronously. Outputs stay bit-identical to the store-managed Triton path for
any split of slots, RAM and disk; a corrupt record fails its step once with the store's error and the
cache goes on serving.

On CPU (CI) the kernels run through Triton's interpreter; TIERMOE_KERNEL_TESTS_ON_GPU=1 runs them on CUDA.
"""

from __future__ import annotations

# kernel_stores first: on CPU it switches Triton to its interpreter before anything imports Triton
from kernel_stores import DEVICE, GIB, LAYERS, N_EXPERTS, ON_GPU, moe_batch, tiny_glm4_stores  # noqa: I001

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tiermoe.errors import StoreIntegrityError  # noqa: E402
from tiermoe.moe.device_cache import DeviceCacheExperts  # noqa: E402
from tiermoe.moe.store_backends import StoreTritonExperts  # noqa: E402
from tiermoe.store.facade import ExpertStore  # noqa: E402
from tiermoe.store.records import load_manifest  # noqa: E402

PER_LAYER = N_EXPERTS // len(LAYERS)


@pytest.fixture(scope="module")
def stores(tiny_dir, tmp_path_factory):
    return tiny_glm4_stores(tiny_dir, tmp_path_factory, "disktier")


def _store(path, rec: int, host_records: int) -> ExpertStore:
    st = ExpertStore.open(path, device=DEVICE, dtype=torch.bfloat16, reader_threads=2, gpu_expert_gb=0,
                          host_expert_gb=host_records * rec / GIB)
    if ON_GPU:
        assert st.wait_pinned()
    return st


def _trace(n: int = 5) -> list[tuple[int, int, int]]:
    """(layer, tokens, seed) calls: decode steps of 1-3 tokens and a 17-token prefill."""
    rnd = random.Random(3)
    return [(layer, rnd.choice((1, 1, 3, 17)), rnd.randrange(1000)) for _ in range(n) for layer in LAYERS]


def _run(dc, trace) -> list[torch.Tensor]:
    out = []
    for layer, t, seed in trace:
        dc.begin_step(t, decode=t < 17)
        out.append(dc.forward(layer, *moe_batch(t, seed), decode=t < 17).cpu())
        dc.end_step()
    return out


# (RAM records, GPU records) splits: one layer's worth of RAM (the least allowed) with and without slots,
# and RAM for all but one expert
@pytest.mark.parametrize("kind,splits", [("int4", ((PER_LAYER, 0), (PER_LAYER, 6), (N_EXPERTS - 1, 2))),
                                         ("bf16", ((12, 4),))])
def test_bit_identical_across_slot_ram_and_disk_splits(stores, kind, splits):
    path, rec = stores[kind]
    trace = _trace()
    with _store(path, rec, N_EXPERTS) as st:  # every expert in RAM: the store-managed path, the reference
        be = StoreTritonExperts(st)
        ref = [be.forward(layer, *moe_batch(t, seed)).cpu() for layer, t, seed in trace]
        assert not be.reads_disk()
    for host, slots in splits:
        with _store(path, rec, host) as st:
            dc = DeviceCacheExperts(st, slots, rates={}, top_k=2, max_tokens=3, disk=True)
            assert dc.reads_disk() and (st.disk_only_experts > 0) == (host < N_EXPERTS)
            try:
                got = _run(dc, trace)
                c = dc.cache_counters()["disk_tier"]
            finally:
                dc.disk.close()
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), (host, slots)
        assert c["ram_entries"] == host + 1 and c["failed_reads"] == 0  # (+1: the store's spare entry)
        assert c["decode_reads"] > 0 and c["requests"] > 0, c  # decode steps asked the host through the mailbox
        if host == PER_LAYER:
            assert c["evictions"] > 0, c


def _corrupt_copy(path, tmp_path, layer: int, expert: int):
    """A copy of the store at `path` with one byte of (layer, expert)'s record flipped on disk."""
    import shutil

    dst = tmp_path / "corrupt"
    shutil.copytree(path, dst, ignore=shutil.ignore_patterns("store.lock"))
    rec = next(r for r in load_manifest(dst).records if (r.layer, r.expert) == (layer, expert))
    with open(dst / "experts.bin", "r+b") as f:
        f.seek(rec.offset + 100)
        byte = f.read(1)
        f.seek(rec.offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    return dst


def test_a_corrupt_record_fails_its_step_once_and_the_cache_goes_on(stores, tmp_path):
    """Layer 2 is on disk only (8 RAM entries hold layer 1); its expert 3 is corrupt on disk. A decode
    step that picks it fails with the store's checksum error, after the cache is repaired; a step that
    does not pick it gives the reference's bits, and picking it again fails again (read anew)."""
    path, rec = stores["int4"]
    bad = _corrupt_copy(path, tmp_path, 2, 3)
    x, _, w = moe_batch(1, seed=9)
    good_ids = torch.tensor([[1, 6]], device=DEVICE)
    bad_ids = torch.tensor([[3, 6]], device=DEVICE)
    with _store(path, rec, N_EXPERTS) as st:
        ref = StoreTritonExperts(st).forward(2, x, good_ids, w).cpu()
    with _store(bad, rec, PER_LAYER) as st:
        dc = DeviceCacheExperts(st, 2 + 2, rates={}, top_k=2, max_tokens=1, disk=True)
        try:
            for ids, fails in ((bad_ids, True), (good_ids, False), (bad_ids, True), (good_ids, False)):
                dc.begin_step(1, decode=True)
                out = dc.forward(2, x, ids, w)
                if fails:
                    with pytest.raises(StoreIntegrityError, match="layer 2 expert 3"):
                        dc.end_step()
                else:
                    dc.end_step()
                    assert torch.equal(out.cpu(), ref)
                dc.end_step()  # reported once: the next check is clean
            c = dc.cache_counters()["disk_tier"]
            assert int(dc.disk.addr[1, 3]) == 0 and int(dc.caches[2].host_addr[3]) == 0  # still on disk only
            assert int(dc.caches[2].expert_slot[3]) == -1
        finally:
            dc.disk.close()
    assert c["failed_reads"] == 2 and c["requests"] >= 2  # (start-up placement may have read 1 or 6 already)


def _engine_logits(path, prompt: list[int], options: dict, warm_up: bool = False) -> tuple[torch.Tensor, dict]:
    """engine_logits_and_counters, after the engine's start-up warm-up when asked (it saves and restores
    the cache's decisions, which a disk tier must bring back from RAM or disk)."""
    from tiermoe.engine.build import build_engine_core
    from tiermoe.eval.parity import engine_logits

    eng = build_engine_core(str(path), device=DEVICE, dtype="bfloat16", max_num_seqs=2, options=options)
    be = eng.model.expert_backend
    try:
        if warm_up:
            assert eng.warm_up() > 0
        out = torch.cat([engine_logits(eng, prompt, chunk=len(prompt)), engine_logits(eng, prompt, chunk=1)])
        return out, be.counters()
    finally:
        be.close()


@pytest.mark.slow
def test_engine_logits_bit_identical_with_a_disk_tier(stores):
    """The real engine with --device-cache on over RAM for half the experts: logits bit-identical to the
    store-managed Triton path with everything in RAM, after the start-up warm-up; /stats counts the disk
    reads per decode token and the layer-ahead reads; fast mode's lane reads the records RAM holds now."""
    from tiermoe.eval.parity import compare

    path, rec = stores["int4"]
    prompt = [5, 17, 33, 64, 101, 250, 7, 300]
    base = {"expert_kernel": "triton"}
    ref, _ = _engine_logits(path, prompt, {**base, "device_cache": "off", "gpu_expert_gb": 0,
                                           "host_expert_gb": N_EXPERTS * rec / GIB})
    opts = {**base, "device_cache": "on", "gpu_expert_gb": 4 * rec / GIB, "host_expert_gb": PER_LAYER * rec / GIB}
    got, c = _engine_logits(path, prompt, opts, warm_up=True)
    assert torch.equal(got, ref)
    tier = c["device_cache"]["disk_tier"]
    assert tier["ram_entries"] == PER_LAYER + 1 and tier["decode_reads"] > 0 and tier["failed_reads"] == 0, tier
    assert c["per_decode_token"]["disk_reads"] == pytest.approx(tier["decode_reads"] / c["decode_tokens"])
    assert tier["prefetch_issued"] > 0 and tier["prefetch_used"] > 0, tier  # layer 1 hints layer 2's picks
    fast, c = _engine_logits(path, prompt, {**base, "device_cache": "on", "gpu_expert_gb": 4 * rec / GIB,
                                            "host_expert_gb": PER_LAYER * rec / GIB, "mode": "fast",
                                            "cpu_lane_experts": 1, "cpu_lane_share": 1.0})
    assert c["cpu_lane"]["experts"] > 0 and c["device_cache"]["disk_tier"]["decode_reads"] > 0
    m = compare(ref, fast)
    assert m["kl_mean"] < 1e-2 and m["top1"] >= 0.9, m


def test_saved_decisions_come_back_with_their_records_from_ram_or_disk(stores):
    """restore_decisions with a disk tier: the saved slots get their experts' records again, read from
    RAM or from disk (the RAM the saved tables pointed at may hold other experts by then), and ptr_table
    points every expert at its slot or at where RAM holds it now."""
    path, rec = stores["int4"]
    with _store(path, rec, PER_LAYER) as st:
        dc = DeviceCacheExperts(st, 10, rates={}, top_k=2, max_tokens=3, disk=True)
        try:
            def steps(experts: list[int], n: int, seed: int) -> None:
                for i in range(n):
                    x, _, w = moe_batch(1, seed=seed + i)
                    ids = torch.tensor([experts[i % len(experts)], experts[(i + 1) % len(experts)]], device=DEVICE)
                    for layer in LAYERS:
                        dc.begin_step(1, decode=True)
                        dc.forward(layer, x, ids[None], w)
                        dc.end_step()

            steps([0, 1, 2], 6, seed=0)
            saved = dc.save_decisions()
            want = {layer: state["slot_expert"].clone() for layer, state in saved.items()}
            steps([5, 6, 7], 12, seed=100)
            dc.restore_decisions(saved)
            for row, (layer, cache) in enumerate(dc.caches.items()):
                assert torch.equal(cache.slot_expert, want[layer])
                rows = ((cache.slot_addr - dc.arena.data_ptr()) // st.record_bytes).tolist()
                for slot, e in enumerate(cache.slot_expert.tolist()):
                    if e >= 0:
                        assert torch.equal(dc.arena[rows[slot]].cpu(), dc.disk.record(row, e).cpu()), (layer, e)
                        assert int(cache.ptr_table[e]) == int(cache.slot_addr[slot])
                for e in range(PER_LAYER):
                    if int(cache.expert_slot[e]) < 0:
                        assert int(cache.ptr_table[e]) == int(dc.disk.addr[row, e]), (layer, e)
        finally:
            dc.disk.close()


def test_layer_ahead_reads_are_used_and_a_failed_one_fails_no_request(stores, monkeypatch):
    """Hinted reads (DiskTier.prefetch, what the device's layer-ahead hint starts) take free entries only;
    the request that then asks for them is answered from them (used); one that failed (an injected EIO)
    is read anew by the request, which succeeds. Outputs keep the reference's bits."""
    from concurrent.futures import Future

    from tiermoe.store.disk import StoreIOError

    path, rec = stores["int4"]
    x, _, w = moe_batch(1, seed=4)
    picks = [[5, 6], [7, 0]]
    with _store(path, rec, N_EXPERTS) as st:
        be = StoreTritonExperts(st)
        ref = [be.forward(2, x, torch.tensor([p], device=DEVICE), w).cpu() for p in picks]
    with _store(path, rec, PER_LAYER) as st:  # RAM: layer 1's 8 experts and one free entry
        dc = DeviceCacheExperts(st, 0, rates={}, top_k=2, max_tokens=1, disk=True)
        tier, row = dc.disk, dc.disk.row_of[2]
        submit, failing = tier.reader.submit, {st.key(2, 5)}

        def flaky(record, dest, **kw):  # the first read of layer 2's expert 5 fails
            if record.index in failing:
                failing.discard(record.index)
                fut = Future()
                fut.set_exception(StoreIOError("injected: EIO"))
                return fut
            return submit(record, dest, **kw)

        monkeypatch.setattr(tier.reader, "submit", flaky)
        try:
            outs = []
            for p in picks:
                tier.prefetch(row, p)
                dc.begin_step(1, decode=True)
                outs.append(dc.forward(2, x, torch.tensor([p], device=DEVICE), w).cpu())
                dc.end_step()
            c = tier.counters()
        finally:
            tier.close()
    assert all(torch.equal(a, b) for a, b in zip(outs, ref))
    # 9 entries keep one free for hints (an eighth): 5 (failed, read anew by the request), then 7 (used)
    assert c["prefetch_issued"] == 2 and c["prefetch_failed"] == 1 and c["prefetch_used"] == 1, c
    assert c["failed_reads"] == 0 and c["requests"] == 2, c


def test_start_up_placement_is_static_over_slots_ram_and_disk(stores):
    """With popularity rates, the slots take each layer's most popular experts (warm start) and RAM the
    next most popular of all layers, not copies of the slots' (make_exclusive): the static placement
    that bounds any online policy under independent picks. The device's tables agree."""
    path, rec = stores["int4"]
    gen = torch.Generator().manual_seed(5)
    with _store(path, rec, PER_LAYER) as st:  # RAM: 8 + 1 entries, one kept free for read-ahead
        rate = {st.key(layer, e): float(r) for layer in LAYERS for e, r in enumerate(torch.rand(PER_LAYER, generator=gen))}
        dc = DeviceCacheExperts(st, 2 + 4, rates=rate, top_k=2, max_tokens=1, disk=True)  # 2 staging rows, 4 slots
        try:
            tier = dc.disk
            in_slots = {(layer, e) for layer, c in dc.caches.items() for e in c.slot_expert.tolist() if e >= 0}
            in_ram = {(layer, e) for layer in LAYERS for e in range(PER_LAYER) if int(tier.addr[tier.row_of[layer], e])}
            for layer, c in dc.caches.items():
                n = dc.slots_per_layer[layer]
                by_rate = sorted(range(PER_LAYER), key=lambda e: -rate[st.key(layer, e)])
                assert sorted(e for e in c.slot_expert.tolist() if e >= 0) == sorted(by_rate[:n])
                assert torch.equal(c.host_addr.cpu(), tier.addr[tier.row_of[layer], :PER_LAYER])
            assert not in_slots & in_ram and len(in_ram) == tier.capacity - tier.reserve == 8
            rest = sorted((k for k in rate if (st.manifest.records[k].layer, st.manifest.records[k].expert)
                           not in in_slots), key=lambda k: -rate[k])
            want = {(st.manifest.records[k].layer, st.manifest.records[k].expert) for k in rest[: len(in_ram)]}
            assert in_ram == want
        finally:
            dc.disk.close()


def test_ram_evicts_by_the_devices_pick_counts_once_read(stores):
    """After refresh_heat (every HEAT_STEPS decode steps) RAM's eviction order is the device cache's own
    decayed pick counts, not the start-up statistics: the coldest by those goes first."""
    path, rec = stores["int4"]
    with _store(path, rec, PER_LAYER) as st:  # RAM: 9 entries, 8 held after start-up placement, 1 free
        dc = DeviceCacheExperts(st, 0, rates={}, top_k=2, max_tokens=1, disk=True)
        try:
            tier, row1, row2 = dc.disk, dc.disk.row_of[1], dc.disk.row_of[2]
            tier.ensure(row2, [0], decode=False)  # takes the free entry: the next load must evict
            held = [e for e in range(PER_LAYER) if int(tier.addr[row1, e])]
            cold = held[len(held) // 2]
            freq = torch.full((PER_LAYER,), 1 << 20, dtype=torch.int32, device=DEVICE)
            freq[cold] = 1  # the device has seen layer 1's `cold` picked least of what RAM holds
            dc.caches[1].freq.copy_(freq)
            tier.refresh_heat()
            updates, _, _ = tier.ensure(row2, [5], decode=False)
            assert (row1, cold, 0) in updates and int(tier.addr[row1, cold]) == 0, updates
        finally:
            tier.close()


def test_an_evicted_expert_is_taken_back_from_its_parked_entry_without_a_read(stores, monkeypatch):
    """Each answer keeps `reserve` entries free for reads ahead by evicting the coldest; the freed entry keeps its
    record (parked) until a read takes it, so a request for that expert takes the entry back without reading
    the disk, with the record's bytes intact, and a read takes a parked entry only when no empty one is left."""
    from tiermoe.store.disk import aligned_buffer

    path, rec = stores["int4"]
    with _store(path, rec, PER_LAYER) as st:  # RAM: 9 entries, one kept free for hints (an eighth)
        dc = DeviceCacheExperts(st, 0, rates={}, top_k=2, max_tokens=1, disk=True)
        tier, row1, row2 = dc.disk, dc.disk.row_of[1], dc.disk.row_of[2]
        reads = []
        submit = tier.reader.submit

        def counted(record, dest, **kw):
            reads.append((st.manifest.records[record.index].layer, st.manifest.records[record.index].expert))
            return submit(record, dest, **kw)

        monkeypatch.setattr(tier.reader, "submit", counted)
        try:
            assert tier.reserve == 1 and tier.counters()["ram_free"] == 1
            on_disk = [e for e in range(PER_LAYER) if not int(tier.addr[row2, e])]
            updates, failed, _ = tier.ensure(row2, [on_disk[0]], decode=True)  # one read, then one eviction
            evicted = [(r, e) for r, e, a in updates if a == 0]
            assert not failed and reads == [(2, on_disk[0])] and len(evicted) == 1, updates
            (vr, ve), = evicted
            assert vr != row2 and int(tier.addr[vr, ve]) == 0 and tier.counters()["ram_free"] == 1
            updates, failed, _ = tier.ensure(vr, [ve], decode=True)  # taken back: no read
            assert not failed and len(reads) == 1 and tier.counters()["reclaimed"] == 1, (updates, reads)
            addr = int(tier.addr[vr, ve])
            assert (vr, ve, addr) in updates and addr
            entry = tier.record(vr, ve).cpu()
            fresh = aligned_buffer(entry.numel())
            tier.reader.read(st.manifest.records[st.key(tier.layers[vr], ve)], fresh)
            assert torch.equal(entry, fresh)
            # the refill parked another; a prefetch reads into it (the only free entry), so a request for the
            # expert it held must read the disk again
            (pr, pe), = [(r, e) for r, e, a in updates if a == 0]
            tier.prefetch(row2, [on_disk[1]])
            assert reads[-1] == (2, on_disk[1]) and tier.counters()["ram_free"] == 0
            tier.ensure(pr, [pe], decode=True)
            assert reads[-1] == (tier.layers[pr], pe) and tier.counters()["reclaimed"] == 1
        finally:
            tier.close()
