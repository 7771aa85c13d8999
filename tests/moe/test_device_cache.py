"""Device-side slot cache behind the engine (moe/device_cache.py): bit-identical to the
store-managed Triton path and across GPU budgets, slots really used, counters folded into the
store's, eligibility rules (fast mode's CPU lane through the mailbox: test_device_lane.py).

On CPU (CI) the kernels run through Triton's interpreter with CPU tensors standing in for device
memory; TIERMOE_KERNEL_TESTS_ON_GPU=1 runs the same tests compiled on CUDA (host entries then
pinned and read in place).
"""

from __future__ import annotations

# kernel_stores first: on CPU it switches Triton to its interpreter before anything imports Triton
from kernel_stores import (
    DEVICE, GIB, LAYERS, N_EXPERTS,
    ON_GPU, engine_logits_and_counters, kernel_bf16, moe_batch, tiny_glm4_stores,
)

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tiermoe.errors import UserError  # noqa: E402
from tiermoe.moe.device_cache import DeviceCacheExperts  # noqa: E402
from tiermoe.moe.prefill_staging import STAGE_TOKENS  # noqa: E402
from tiermoe.moe.store_backends import StoreTritonExperts  # noqa: E402
from tiermoe.store.facade import ExpertStore  # noqa: E402
from tiermoe.store.planner import device_cache_plan  # noqa: E402
from tiermoe.store.records import load_manifest  # noqa: E402


@pytest.fixture(scope="module")
def stores(tiny_dir, tmp_path_factory):
    return tiny_glm4_stores(tiny_dir, tmp_path_factory, "devcache")


def _host_store(path, rec: int) -> ExpertStore:
    """Every expert in the host tier, no slots: what the device cache runs over."""
    st = ExpertStore.open(path, device=DEVICE, dtype=torch.bfloat16, reader_threads=2, gpu_expert_gb=0,
                          host_expert_gb=N_EXPERTS * rec / GIB)
    if ON_GPU:
        assert st.wait_pinned()
    return st


def _open_backend(path, **flags):
    """The expert backend the engine would open for these flags (settled once, opened by name)."""
    from tiermoe.engine.build import engine_config
    from tiermoe.moe.backends import open_expert_backend

    cfg = engine_config(str(path), device=DEVICE, dtype="bfloat16", max_num_seqs=8, options=flags)
    return open_expert_backend(cfg.experts)


def _store_path_outputs(path, rec: int, calls) -> list[torch.Tensor]:
    """The store-managed Triton path's output for each (layer, tokens, seed) call: the reference."""
    with _host_store(path, rec) as st:
        be = StoreTritonExperts(st)
        return [be.forward(layer, *moe_batch(t, seed)).cpu() for layer, t, seed in calls]


def _trace(n: int = 4) -> list[tuple[int, int, int]]:
    """(layer, tokens, seed) calls: decode steps of 1 and 3 tokens, prefill chunks of 2 tokens (read in place,
    under STAGE_TOKENS) and of 17 (staged)."""
    rnd = random.Random(0)
    return [(layer, rnd.choice((1, 1, 3, 17, 2)), rnd.randrange(1000)) for _ in range(n) for layer in LAYERS]


def _decode(tokens: int) -> bool:
    """Is a trace call of this many tokens a decode step (else a prefill chunk)?"""
    return tokens in (1, 3)


@pytest.mark.parametrize("kind", ["int4", "bf16"])
def test_bit_identical_to_store_path_and_across_budgets(stores, kind):
    """The same trace gives the same bits through the store-managed Triton path and through the
    device cache with 8, 2 and 0 slots per layer (everything, ~10 %, nothing on the GPU)."""
    path, rec = stores[kind]
    trace = _trace()
    ref = _store_path_outputs(path, rec, trace)
    for slots in (2 * 8, 2 * 2 + 2, 0):  # (+2: staging rows come out of the budget first)
        with _host_store(path, rec) as st:
            dc = DeviceCacheExperts(st, slots, rates={}, top_k=2, max_tokens=1)
            got = [dc.forward(layer, *moe_batch(t, seed), decode=_decode(t)).cpu() for layer, t, seed in trace]
            c = dc.cache_counters()
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), slots
        assert c["cache_steps"] == sum(_decode(t) for _, t, _ in trace)
        assert c["table_calls"] == sum(not _decode(t) and t < STAGE_TOKENS for _, t, _ in trace) > 0
        if slots == 0:  # every pick of a 17-token chunk is a miss, copied to staging rows
            assert c["prefill_staged"] > 0
        assert c["lookups"] == c["hits"] + c["misses"] > 0
        if slots == 16:
            assert c["stage_rows"] == 2 and c["slots"] == 14 and c["hits"] > 0
        if slots == 0:
            assert c["slots"] == 0 and c["hits"] == 0 and c["admitted"] == 0


def test_mixed_store_copies_short_records_and_stays_bit_identical(tiny_dir, tmp_path_factory):
    """A mixed store (bf16 hot records of 12,288 bytes, int8 cold ones of 8,192; the tiny model's
    32-column down rows are too short for the int3 kernels' tiles): misses move each record's own
    bytes into longer slot and staging rows, and the outputs stay bit-identical to the
    store-managed path at every budget."""
    import json

    from testkit.stores import pack_tiny

    cfg = json.loads((tiny_dir("glm4_moe", "bfloat16") / "config.json").read_text())
    first = int(cfg.get("first_k_dense_replace", 0))
    stats = tmp_path_factory.mktemp("mixed-stats") / "stats.json"
    stats.write_text(json.dumps({f"model.layers.{layer}.mlp": [40, 20, 10, 8, 8, 6, 5, 3]
                                 for layer in range(first, int(cfg["num_hidden_layers"]))}))
    _, path = pack_tiny(tiny_dir, tmp_path_factory, "glm4_moe", dtype="bfloat16", quant="bf16", cold_quant="int8",
                        cold_group_size=32, expert_stats=str(stats), hot_share=0.6)
    rec = load_manifest(path).record_bytes
    trace = _trace(3)
    ref = _store_path_outputs(path, rec, trace)
    for slots in (2 * 8, 2 * 2 + 2, 0):
        with _host_store(path, rec) as st:
            dc = DeviceCacheExperts(st, slots, rates={}, top_k=2, max_tokens=1)
            words = {layer: c.record_words.tolist() for layer, c in dc.caches.items()}
            got = [dc.forward(layer, *moe_batch(t, seed), decode=_decode(t)).cpu() for layer, t, seed in trace]
            c = dc.stats()
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), slots
        assert all(sorted(set(w)) == [2048, 3072] for w in words.values())  # int8 and bf16 records, in words
        # the bytes the misses move are their own records' (/stats bytes_moved), not whole tier entries
        assert 8192 * c["misses"] <= c["miss_bytes"] <= rec * c["misses"]
        if slots == 0:  # every pick a miss, cold ones among them
            assert c["miss_bytes"] < rec * c["misses"]


def test_matrix_vector_decode_path_is_bit_identical_across_budgets(stores, monkeypatch):
    """With a decode config that sends steps of up to 4 tokens to the matrix-vector kernel (as a
    tuned configs.json entry does), the device cache with 8, 2 and 0 slots per layer still gives
    the store-managed path's bits: every tier runs that kernel on the same bytes."""
    from tiermoe.kernels.triton import fused_moe as fm

    plain = fm.default_config

    def with_gemv(layout, tokens):
        cfg = plain(layout, tokens)
        gemv = {"BN": 16, "BK": 32, "num_warps": 4, "num_stages": 2}
        return {**cfg, "gemv": {"gate_up": gemv, "down": {**gemv, "acc": "row"}, "max_tokens": 4}}

    from tiermoe.kernels.triton import moe_gemv

    calls = []
    real = moe_gemv.moe_projections_gemv
    monkeypatch.setattr(moe_gemv, "moe_projections_gemv", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(fm, "default_config", with_gemv)
    path, rec = stores["int4"]
    trace = _trace(2)
    ref = _store_path_outputs(path, rec, trace)
    for slots in (2 * 8, 2 * 2 + 2, 0):
        with _host_store(path, rec) as st:
            dc = DeviceCacheExperts(st, slots, rates={}, top_k=2, max_tokens=1)
            got = [dc.forward(layer, *moe_batch(t, seed), decode=_decode(t)).cpu() for layer, t, seed in trace]
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), slots
    assert len(calls) == 4 * sum(t <= 4 for _, t, _ in trace)  # the kernel ran: both paths, 1 + 3 budgets


def test_misses_read_in_place_without_staging_rows(stores):
    """stage_misses=False (EngineArgs.stage_misses): no staging rows, the whole budget in
    slots, misses read in place by the kernel: the same bits as with staging."""
    path, rec = stores["int4"]
    trace = _trace()
    outs, counters = [], []
    for stage in (True, False):
        with _host_store(path, rec) as st:
            dc = DeviceCacheExperts(st, 2 * 2 + 2, rates={}, top_k=2, max_tokens=1, stage_misses=stage)
            outs.append([dc.forward(layer, *moe_batch(t, seed), decode=_decode(t)).cpu() for layer, t, seed in trace])
            counters.append(dc.cache_counters())
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert (counters[0]["stage_rows"], counters[0]["slots"]) == (2, 4)
    assert (counters[1]["stage_rows"], counters[1]["slots"]) == (0, 6)
    be = _open_backend(path, expert_kernel="triton", gpu_expert_gb=6 * rec / GIB,
                       host_expert_gb=N_EXPERTS * rec / GIB, stage_misses=False)
    try:
        assert isinstance(be, DeviceCacheExperts) and be.stage_rows == 0
    finally:
        be.close()


def test_partial_is_the_sum_before_its_rounding(stores):
    """forward(partial=True) (an expert-parallel rank's part) in decode steps, prefill chunks read in place and
    staged ones: the kernel's fp32 sum, which rounded as the kernel rounds it is the partial=False result bit for
    bit (the cache's decisions between the two calls change no bits)."""
    path, rec = stores["int4"]
    with _host_store(path, rec) as st:
        dc = DeviceCacheExperts(st, 2 * 2 + 2, rates={}, top_k=2, max_tokens=3)
        for layer, t, seed in _trace():
            x, ids, w = moe_batch(t, seed)
            rounded = dc.forward(layer, x, ids, w, decode=_decode(t))  # [T, H]
            part = dc.forward(layer, x, ids, w, decode=_decode(t), partial=True)  # [T, H]
            assert part.dtype == torch.float32 and torch.equal(kernel_bf16(part), rounded), (layer, t, seed)
        c = dc.cache_counters()
    assert c["cache_steps"] > 0 and c["table_calls"] > 0 and c["prefill_staged"] > 0  # every kind of call


@pytest.mark.parametrize("rows", [None, 3, 0])
def test_prefill_staging_is_bit_identical(stores, rows):
    """A 70-token prefill chunk copies its non-resident experts into staging rows (all of them,
    only 3 with the rest read in place, or none): the same bits as the store-managed path."""
    path, rec = stores["int4"]
    calls = [(layer, 70, seed) for seed in (1, 2) for layer in LAYERS]
    ref = _store_path_outputs(path, rec, calls)
    with _host_store(path, rec) as st:
        dc = DeviceCacheExperts(st, 2 * 2 + 2, rates={}, top_k=2, max_tokens=1, prefill_rows=rows)
        got = [dc.forward(layer, *moe_batch(t, seed), decode=False).cpu() for layer, t, seed in calls]
        c = dc.cache_counters()
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert c["prefill_rows"] == (6 if rows is None else rows)  # 8 experts - 2 slots per layer
    assert c["prefill_staged"] == {None: 6, 3: 3, 0: 0}[rows] * len(calls)  # 70 tokens pick every expert
    assert c["cache_steps"] == 0 and c["lookups"] == 0  # prefill leaves the cache alone


@pytest.mark.parametrize("rows,buffers", [(None, 1), (None, 2), (3, 2)])
def test_planned_prefill_staging_is_bit_identical(stores, monkeypatch, rows, buffers):
    """Chunks of STAGE_ALL_TOKENS or more plan every layer's staging once per step (no host read
    per layer; with two buffers one layer ahead on a side stream): the same bits as the
    store-managed path, every non-resident expert staged (up to the rows of a buffer)."""
    import tiermoe.moe.prefill_staging as staging

    monkeypatch.setattr(staging, "STAGE_ALL_TOKENS", 70)
    path, rec = stores["int4"]
    # (tokens, seed, begin_step called): the third chunk is below the threshold (per-layer
    # staging); the last runs its layers twice with no begin_step (a spent plan is never reused)
    steps = [(70, 1, True), (70, 2, True), (69, 3, True), (70, 4, True), (70, 5, False)]
    ref = _store_path_outputs(path, rec, [(layer, t, seed) for t, seed, _ in steps for layer in LAYERS])
    with _host_store(path, rec) as st:
        dc = DeviceCacheExperts(st, 2 * 2 + 2, rates={}, top_k=2, max_tokens=1, prefill_rows=rows,
                                prefill_buffers=buffers)
        got = []
        for i, (t, seed, begin) in enumerate(steps):
            # the first chunk in inference mode, as the server's start-up warm-up runs it: buffers
            # it allocates must stay writable by the chunks that follow outside that mode
            with torch.inference_mode(i == 0):
                if begin:
                    dc.begin_step(t, decode=False)
                got += [dc.forward(layer, *moe_batch(t, seed), decode=False).cpu() for layer in LAYERS]
        c = dc.cache_counters()
        dc.begin_step(1, decode=True)
        assert dc.prefill._plan is None  # a decode step drops the chunk's plan
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    per_layer = 6 if rows is None else 3  # 8 experts - 2 slots, or the rows of a buffer
    assert c["prefill_planned_chunks"] == 3 and c["prefill_buffers"] == buffers
    assert c["prefill_staged"] == per_layer * len(LAYERS) * len(steps)  # 69-70 tokens pick every expert
    assert c["cache_steps"] == 0 and c["lookups"] == 0


@pytest.mark.parametrize("rows", [None, 3])
def test_slots_lent_to_prefill_staging_come_back(stores, monkeypatch, rows):
    """--prefill-borrow-slots: planned chunks stage one layer ahead in a second buffer made of
    the last slots of every layer (all four, or three each with rows=3: a share that leaves
    room for the experts the loan makes non-resident); the same bits as the store-managed path,
    every non-resident expert staged, and the first decode step finds every slot, table entry
    and record as before."""
    import tiermoe.moe.prefill_staging as staging

    monkeypatch.setattr(staging, "STAGE_ALL_TOKENS", 70)
    path, rec = stores["int4"]
    steps = [(70, 1, True), (70, 2, True), (69, 3, True), (70, 4, True), (1, 6, False)]  # the last: decode
    ref = _store_path_outputs(path, rec, [(layer, t, seed) for t, seed, _ in steps for layer in LAYERS])
    with _host_store(path, rec) as st:
        dc = DeviceCacheExperts(st, 4 * 2 + 2, rates={}, top_k=2, max_tokens=1, prefill_rows=rows,
                                borrow_slots=True)
        lender = dc.prefill.lender
        share = 4 if rows is None else 3  # lend_share([4, 4], rows): 2 * share >= rows + share
        assert dc.prefill.num_buffers == 2 and lender.lent_slots == {1: share, 2: share}
        assert lender.rows == dc.prefill_rows == (rows or 4) + share
        for layer in LAYERS:  # every slot full, so a loan really empties some
            dc.caches[layer].step(torch.arange(4, device=DEVICE).reshape(2, 2) + 4 * (layer - 1))
        before = {layer: {n: t.clone() for n, t in dc.caches[layer].state().items()} for layer in LAYERS}
        arena = dc.arena.clone()
        got = []
        for t, seed, planned in steps:
            decode = not planned
            dc.begin_step(t, decode=decode)
            if planned and t >= 70:
                assert lender.lent and all((dc.caches[layer].slot_expert[-share:] < 0).all().item() for layer in LAYERS)
            if decode:
                assert not lender.lent
                for layer in LAYERS:
                    now = dc.caches[layer].state()
                    for name in ("slot_expert", "expert_slot", "ptr_table", "ref"):
                        assert torch.equal(now[name], before[layer][name]), (layer, name)
                assert torch.equal(dc.arena, arena)  # the lent slots' records copied back
            got += [dc.forward(layer, *moe_batch(t, seed), decode=decode).cpu() for layer in LAYERS]
        c = dc.cache_counters()
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert c["prefill_loans"] == 2 and c["prefill_borrowed_rows"] == lender.rows and c["prefill_planned_chunks"] == 3
    # the loan adds as many rows as it evicts experts: in-place reads only where rows were short
    # before it (rows=3 < the 4 non-resident experts of a layer: one per layer and chunk)
    assert c["prefill_in_place"] == (0 if rows is None else len(LAYERS) * 3)


def test_lend_share_leaves_room_for_what_the_loan_evicts():
    from tiermoe.moe.prefill_staging import lend_share

    assert lend_share([42] * 24, 86) == 4  # 24 * 4 = 96 >= 86 + 4
    assert lend_share([4, 4], 4) == 4 and lend_share([4, 4], 3) == 3
    assert lend_share([1, 0], 7) == 0 and lend_share([50], 10) == 0  # too few slots; one layer cannot lend
    assert lend_share([3, 3, 0], 0) == 0


def test_warm_start_follows_rates_and_admission_moves_slots(stores):
    """Slots start with the most picked experts by the rates given, and a decode step whose
    misses are hotter than the residents admits them (the resident set changes on the device)."""
    path, rec = stores["int4"]
    with _host_store(path, rec) as st:
        rates = {st.key(layer, e): (0.005 if e in (6, 7) else 0.001) for layer in LAYERS for e in range(8)}
        dc = DeviceCacheExperts(st, 2 * 2, rates=rates, top_k=2, max_tokens=1)  # 2 staging rows, 1 slot per layer
        assert dc.slots_per_layer == {1: 1, 2: 1}
        assert dc.resident(1) in ([6], [7])
        x, _, w = moe_batch(1, seed=0)
        ids = torch.tensor([[0, 1]], device=DEVICE)
        for _ in range(40):  # picked every step: its frequency passes the resident's (decaying) in ~20
            dc.forward(1, x, ids, w)
        assert dc.resident(1)[0] in (0, 1)
        assert dc.cache_counters()["admitted"] >= 1


def test_saved_decisions_come_back_with_their_slot_records(stores):
    """save_decisions / restore_decisions (around the start-up warm-up): after other steps admitted
    and evicted experts, the cache holds exactly the saved state again (tables, CLOCK, pick
    counts, lane marks) and every slot holds its expert's record bytes, re-copied for the slots
    that changed. Fast mode's lane choice, and so its output, depends on all of it."""
    path, rec = stores["int4"]
    with _host_store(path, rec) as st:
        dc = DeviceCacheExperts(st, 10, rates={}, top_k=2, max_tokens=3, lane_cap=2)
        dc.set_lane(2)

        def steps(experts: list[int], n: int, seed: int) -> None:
            for i in range(n):
                x, _, w = moe_batch(1, seed=seed + i)
                ids = torch.tensor([experts[i % len(experts)], experts[(i + 1) % len(experts)]], device=DEVICE)
                for layer in LAYERS:
                    dc.forward(layer, x, ids[None], w)

        steps([0, 1, 2], 6, seed=0)  # a history: 0, 1, 2 resident
        saved = dc.save_decisions()
        want = {layer: {n: t.clone() for n, t in state.items()} for layer, state in saved.items()}
        steps([5, 6, 7], 12, seed=100)  # other steps: 5, 6, 7 admitted over them
        assert any(not torch.equal(c.slot_expert, want[layer]["slot_expert"]) for layer, c in dc.caches.items())
        dc.restore_decisions(saved)
        for layer, cache in dc.caches.items():
            for name, t in want[layer].items():
                assert torch.equal(getattr(cache, name), t), (layer, name)
            entries = st.host_entries(layer)
            rows = ((cache.slot_addr - dc.arena.data_ptr()) // st.record_bytes).tolist()  # arena row of each slot
            for slot, e in enumerate(cache.slot_expert.tolist()):
                if e >= 0:
                    assert torch.equal(dc.arena[rows[slot]].cpu(), entries[e].cpu()), (layer, slot, e)


def test_eligibility_rules(stores, monkeypatch):
    path, rec = stores["int4"]
    m = load_manifest(path)
    all_host = N_EXPERTS * rec / GIB
    plan = device_cache_plan(m, device=DEVICE, gpu_expert_gb=3 * rec / GIB, host_expert_gb=all_host)
    assert plan == (3, 16, None)
    plan = device_cache_plan(m, device=DEVICE, gpu_expert_gb=3 * rec / GIB, host_expert_gb=all_host / 2)
    assert plan == (3, 8, None)  # RAM for one layer's 8 experts: the rest from disk (the disk tier)
    slots, host, why = device_cache_plan(m, device=DEVICE, gpu_expert_gb=3 * rec / GIB, host_expert_gb=7 * rec / GIB)
    assert slots == 0 and "fewer than one MoE layer's 8" in why
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert "runs on CUDA" in device_cache_plan(m, device="cpu", gpu_expert_gb=0, host_expert_gb=all_host)[2]
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    opts = dict(expert_kernel="triton", gpu_expert_gb=3 * rec / GIB, host_expert_gb=all_host / 2)
    with pytest.raises(UserError, match="--device-cache on: host RAM for 7 expert records, fewer than one"):
        _open_backend(path, **dict(opts, host_expert_gb=7 * rec / GIB), device_cache="on")
    be = _open_backend(path, **opts, device_cache="on")  # half the experts in RAM: the disk tier under the cache
    try:
        assert isinstance(be, DeviceCacheExperts) and be.disk is not None and be.disk.capacity == 8 + 1
    finally:
        be.close()
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(UserError, match="--prefill-staging-gb must be a size"):
            _open_backend(path, **opts, prefill_staging_gb=bad)
    with pytest.raises(UserError, match="--device-cache 'sometimes'"):
        _open_backend(path, **opts, device_cache="sometimes")
    be = _open_backend(path, **opts)  # auto: the store path until the disk tier's speed is measured
    try:
        assert not isinstance(be, DeviceCacheExperts) and be.store.residency.slots.capacity == 3
    finally:
        be.close()
    torch_opts = dict(opts, expert_kernel="torch", host_expert_gb=all_host)
    with pytest.raises(UserError, match="Triton expert kernel is not in use"):
        _open_backend(path, **torch_opts, device_cache="on")


@pytest.mark.slow
def test_engine_logits_with_device_cache(stores):
    """The real engine (loader -> MoE layer -> DeviceCacheExperts) on the int4
    store: logits bit-identical to the store-managed Triton path for GPU budgets 100 %, ~10 %
    and 0 %; /stats counters carry the device cache's slot hits; fast mode stays close."""
    from tiermoe.eval.parity import compare

    path, rec = stores["int4"]
    prompt = [5, 17, 33, 64, 101, 250]
    all_host = N_EXPERTS * rec / GIB

    def logits(options: dict) -> tuple[torch.Tensor, dict]:
        return engine_logits_and_counters(path, prompt, {"expert_kernel": "triton", **options})

    ref, c = logits({"device_cache": "off", "gpu_expert_gb": all_host, "host_expert_gb": 0})
    assert "device_cache" not in c
    for slots in (N_EXPERTS, 4, 0):
        got, c = logits({"gpu_expert_gb": slots * rec / GIB, "host_expert_gb": all_host})  # auto: eligible
        assert torch.equal(got, ref), slots
        dc = c["device_cache"]
        assert dc["cache_steps"] == 2 * len(prompt)
        assert dc["table_calls"] == 0  # the 6-token prefill (2 layers) copies its misses to staging rows
        assert dc["prefill_staged"] > 0 or slots == N_EXPERTS
        assert c["slots"]["hits"] == dc["hits"] and c["host"]["hits"] >= dc["misses"]
        assert c["per_decode_token"]["slots_hits"] == pytest.approx(dc["hits"] / c["decode_tokens"])
        if slots == 0:
            assert dc["hits"] == 0 and c["slots"]["capacity"] == 0
        else:
            assert dc["hits"] > 0
    # a fixed share: the measured one rounds to no expert with these 4 KB records
    fast, c = logits({"mode": "fast", "cpu_lane_experts": 1, "cpu_lane_share": 1.0, "gpu_expert_gb": 4 * rec / GIB,
                      "host_expert_gb": all_host})
    assert c["cpu_lane"]["experts"] > 0 and c["device_cache"]["lane_calls"] > 0
    m = compare(ref, fast)
    assert m["kl_mean"] < 1e-2 and m["top1"] >= 0.9, m


def test_prefill_buffers_follow_the_staging_budget(stores):
    """--prefill-staging-gb: one layer's non-resident experts by default; two layers' worth buys a
    second buffer (copies one layer ahead); less than one layer's stages what fits."""
    path, rec = stores["int4"]
    with _host_store(path, rec) as st:
        for rows, want in ((None, (1, 6)), (12, (2, 6)), (40, (2, 6)), (9, (1, 6)), (4, (1, 4)), (0, (1, 0))):
            dc = DeviceCacheExperts(st, 2 * 2 + 2, rates={}, top_k=2, max_tokens=1, prefill_rows=rows)
            assert (dc.prefill.num_buffers, dc.prefill_rows) == want, rows


def test_static_bound_reported_with_routing_statistics(stores, tmp_path):
    """Given routing statistics (--expert-stats), /stats carries the slot hits a decode token that the best static
    placement of the cache's slots would get: the sum of the most picked experts' rates."""
    import json

    from tiermoe.store.planner import config_top_k, key_rates

    path, rec = stores["int4"]
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({f"layers.{layer}": [1, 1, 1, 1, 1, 1, 9, 5] for layer in LAYERS}))
    opts = dict(expert_kernel="triton", gpu_expert_gb=6 * rec / GIB, host_expert_gb=N_EXPERTS * rec / GIB,
                device_cache="on")
    be = _open_backend(path, **opts, expert_stats=str(stats))
    try:
        rates = key_rates(load_manifest(path), str(stats), config_top_k(load_manifest(path).config))[0]
        best = sorted(rates.values(), reverse=True)[: be.slots_total]
        assert be.counters()["slots"]["static_bound"] == pytest.approx(sum(best), abs=1e-3)
    finally:
        be.close()
    be = _open_backend(path, **opts)  # no statistics: uniform rates, no bound to report
    try:
        assert "static_bound" not in be.counters()["slots"]
    finally:
        be.close()
