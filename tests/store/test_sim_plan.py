import json

import numpy as np
import pytest

from store_fixtures import STATS_FILE
from tiermoe.cli import main
from tiermoe.errors import UserError
from tiermoe.store.planner import build_plan, expected_hits, host_memory_available, load_stats, size_tiers
from tiermoe.store.records import load_manifest
from tiermoe.store.sim import sample_trace, simulate


def test_sampled_trace_follows_statistics():
    stats = load_stats(STATS_FILE)
    assert len(stats) == 42 and all(len(v) == 288 for v in stats.values())
    tr = sample_trace(stats, 400, 8, seed=1)
    assert tr.shape == (400, 42, 8)
    # distinct experts per token and layer, keys within their layer's range
    assert all(len(set(row)) == 8 for tok in tr for row in tok)
    lay = tr // 288
    assert np.all(lay == np.arange(42)[None, :, None])
    # the most popular expert of the last layer is picked about as often as its count says
    counts = np.array(stats[44])
    hot = int(counts.argmax())
    freq = np.mean(np.any(tr[:, -1, :] % 288 == hot, axis=-1))
    assert abs(freq - 8 * counts[hot] / counts.sum()) < 0.08


def test_sim_on_real_stats():
    res = {r.policy: r for r in simulate(str(STATS_FILE), slots=1376, policies=["lru", "lfu", "clock", "static", "belady"],
                                         tokens=60, seed=0, host_experts=2000)}
    for r in res.values():
        assert r.tokens == 54 and r.slot_hits + r.slot_misses == pytest.approx(336)
        if r.host_hits is not None:
            assert r.host_hits + r.disk_reads == pytest.approx(r.slot_misses)
    assert res["belady"].slot_misses <= min(r.slot_misses for r in res.values())
    assert res["lfu"].slot_misses < res["lru"].slot_misses  # popularity beats recency on i.i.d. routing
    # the static top-1376 should cover about as much as the statistics predict (38 %)
    assert 0.3 < res["static"].slot_hits / 336 < 0.46


def test_sim_cli(capsys):
    assert main(["sim", "--stats", str(STATS_FILE), "--slots", "100", "--policy", "lru,clock", "--tokens", "20"]) == 0
    out = capsys.readouterr().out
    assert "lru" in out and "clock" in out and "336 picks/token" in out
    assert main(["sim", "--stats", str(STATS_FILE), "--slots", "10", "--policy", "fifo", "--tokens", "5"]) == 2
    assert main(["sim", "--stats", "/nonexistent.json", "--slots", "10"]) == 2


def test_size_tiers():
    cpu = __import__("torch").device("cpu")
    n_s, n_h, _ = size_tiers(record_bytes=2**20, total_experts=100, device=cpu, gpu_expert_gb=None, host_expert_gb=0.05)
    assert (n_s, n_h) == (0, 51)
    n_s, n_h, _ = size_tiers(record_bytes=2**20, total_experts=100, device=cpu, gpu_expert_gb=0.05, host_expert_gb=1)
    assert (n_s, n_h) == (51, 49)  # capped by the experts left
    n_s, n_h, notes = size_tiers(record_bytes=2**20, total_experts=10**9, device=cpu, gpu_expert_gb=None, host_expert_gb=None)
    avail, _ = host_memory_available()
    assert 0 < n_h * 2**20 <= avail and "available minus margin" in notes[0]
    with pytest.raises(UserError):
        size_tiers(record_bytes=1, total_experts=1, device=cpu, gpu_expert_gb=-1, host_expert_gb=0)


def test_expected_hits():
    rates = {0: 4.0, 1: 2.0, 2: 1.0, 3: 1.0}
    assert expected_hits(rates, 1, 2) == {"slots": 4.0, "host": 3.0, "disk": 1.0}


def test_plan_for_store_and_checkpoint(packed_bf16, tmp_path, capsys):
    store, _ = packed_bf16
    m = load_manifest(store)
    plan = build_plan(m, gpu_expert_gb=4 * 12288 / 2**30, host_expert_gb=0)
    assert plan.n_slots == 4 and plan.n_host == 0 and plan.n_disk == 12
    assert plan.hits_per_token["slots"] == pytest.approx(4 * 2 / 8)  # uniform top-2 of 8, 4 slots
    assert plan.floor_s["floor"] > 0
    assert main(["plan", str(store), "--host-expert-gb", "0", "--gpu-expert-gb", "0", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "disk only" in out and "16" in out and "decode upper bound" in out
    # the disk tier's prefill reads, in serve's CPU chunks and in one (uniform top-2 of 8: a chunk reads all 16)
    assert "prefill of a 8,192-token prompt: 16 chunks of 512 tokens read about 256 disk-only experts" in out
    assert "1 chunk of 8,192 tokens read about 16 disk-only experts" in out
    stats = tmp_path / "s.json"
    stats.write_text(json.dumps({"layers.0.mlp": [8, 0, 0, 0, 0, 0, 0, 0], "layers.1.mlp": [1] * 8}))
    assert main(["plan", str(store), "--stats", str(stats), "--gpu-expert-gb", str(12288 / 2**30), "--host-expert-gb", "0"]) == 0
    out = capsys.readouterr().out
    assert "statistics from s.json" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("slots"))
    assert line.split()[-2] == "2.0"  # expert 0 of layer 0 takes both picks of its layer
    # an unpacked checkpoint is planned from its headers
    assert main(["plan", str(store.parent / "src"), "--quant", "int4", "--group-size", "16", "--host-expert-gb", "0"]) == 0
    assert "16 experts of 4.00 KiB" in capsys.readouterr().out
    # int3 is planned with its own record length (and group size 32 picked: 64 does not divide I=32)
    from tiermoe.store.records import RecordLayout

    assert main(["plan", str(store.parent / "src"), "--quant", "int3", "--host-expert-gb", "0"]) == 0
    assert f"16 experts of {RecordLayout.build('int3', 64, 32, 32).length / 1024:.2f} KiB" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"layers.0.mlp": [1, 2]}))
    assert main(["plan", str(store), "--stats", str(bad)]) == 2
    assert "lists 2 experts" in capsys.readouterr().err


def test_plan_for_one_gpu_of_an_expert_parallel_group(packed_bf16, tmp_path, capsys):
    """`plan --tensor-parallel-size 2`: rank 0's share (half of each layer's experts, dealt by the statistics),
    its own GPU budget, and half the picks a token: the per-GPU tiers and bound."""
    store, _ = packed_bf16
    m = load_manifest(store)
    plan = build_plan(m, gpu_expert_gb=2 * 12288 / 2**30, host_expert_gb=3 * 12288 / 2**30, ranks=2)
    assert plan.total_experts == 8 and plan.n_slots == 2 and plan.n_host == 3 and plan.n_disk == 3
    assert sum(plan.hits_per_token.values()) == pytest.approx(2.0)  # half of top-2 x 2 layers (uniform routing)
    assert any("rank 0's share of 16 experts, one of 2 GPUs" in n for n in plan.notes)
    stats = tmp_path / "s.json"
    stats.write_text(json.dumps({"layers.0.mlp": [8, 4, 2, 1, 1, 1, 1, 0], "layers.1.mlp": [1] * 8}))
    assert main(["plan", str(store), "--stats", str(stats), "--tensor-parallel-size", "2", "--device", "cpu",
                 "--host-expert-gb", "0"]) == 0
    out = capsys.readouterr().out
    assert "tier plan: 8 experts" in out and "one of 2 GPUs" in out
    assert main(["plan", str(store), "--tensor-parallel-size", "0"]) == 2
    assert main(["plan", str(store), "--tensor-parallel-size", "5"]) == 2  # 8 experts a layer, top-2: 4 ranks at most
    assert "must be 1 to 4 for this model" in capsys.readouterr().err


def test_plan_on_cuda_counts_the_device_caches_staging_rows_out_of_the_slots(packed_bf16, capsys):
    """On CUDA with host RAM for every expert the device cache serves, and top_k x min(max-num-seqs, 4)
    records of the GPU budget are its staging rows: the plan's slots and hits leave them out."""
    store, _ = packed_bf16
    m = load_manifest(store)  # 16 records of 12 KiB, top-2
    budget = dict(device="cuda", gpu_expert_gb=10 * 12288 / 2**30, host_expert_gb=16 * 12288 / 2**30)
    plan = build_plan(m, **budget, max_num_seqs=2)  # no GPU is queried: both budgets are given
    assert plan.n_slots == 10 - 2 * 2 and plan.n_host == 16 - plan.n_slots and plan.n_disk == 0
    assert plan.hits_per_token["slots"] == pytest.approx(plan.n_slots * 2 / 8)
    assert any("staging rows" in n for n in plan.notes)
    assert build_plan(m, **budget).n_slots == 10 - 5  # 8 sequences: 2 x 4 rows wanted, at most half the budget
    assert build_plan(m, **dict(budget, device="cpu")).n_slots == 10  # no device cache on a CPU
    assert build_plan(m, **dict(budget, host_expert_gb=0)).n_slots == 10  # RAM short: the store path serves
    # RAM for the 6 experts outside the slots but not for all 16: serving's auto takes the store path too
    assert build_plan(m, **dict(budget, host_expert_gb=12 * 12288 / 2**30)).n_slots == 10
    assert main(["plan", str(store), "--max-num-seqs", "0"]) == 2
    assert "--max-num-seqs must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("kind,group,record", [("int4", 128, 12_976_128), ("int3", 128, 9_830_400),
                                                ("int3", 64, 10_223_616)])
def test_plan_uses_the_record_length_of_the_kind(tmp_path, kind, group, record):
    """GLM-5.3-Flash's expert (H 4096, I 2048) as each kind: the plan sizes tiers, and its decode bound
    reads bytes, by that kind's record length (docs/store-format.md)."""
    from tiermoe.store.records import FORMAT_VERSION, Manifest, RecordLayout

    layout = RecordLayout.build(kind, 4096, 2048, group)
    assert layout.length == record
    layers, experts = [1, 2], 288
    data = {"format_version": FORMAT_VERSION, "dense_bytes": 0, "dtype": "bfloat16",
            "model_config": {"hidden_size": 4096, "num_experts_per_tok": 8, "tie_word_embeddings": True},
            "moe_layers": layers, "experts_per_layer": {str(L): experts for L in layers}, "layouts": [layout.to_json()],
            "records": [{"layer": L, "expert": e, "offset": (i * experts + e) * record, "length": record, "sha256": ""}
                        for i, L in enumerate(layers) for e in range(experts)]}
    plan = build_plan(Manifest(data, tmp_path), device="cpu", gpu_expert_gb=0, host_expert_gb=100 * record / 2**30,
                      cpu_threads=16)
    assert plan.record_bytes == record and plan.n_host == 100 and plan.n_disk == 2 * experts - 100
    assert f"{2 * experts} experts of {record / 2**20:.2f} MiB" in plan.table()
    assert plan.floor_s["disk"] == pytest.approx(plan.hits_per_token["disk"] * record / 1.6e9)


def test_sim_device_cache_policy_between_the_bounds():
    """The device cache's own policy (its plain-torch twin) on the real statistics: full slots hit every
    pick, no slots none, and the 11 % budget lands near static placement and under Belady's bound."""
    full = simulate(str(STATS_FILE), slots=42 * 288, policies=["device"], tokens=12, warmup=2)[0]
    assert full.slot_hits == pytest.approx(336) and full.slot_misses == 0
    none = simulate(str(STATS_FILE), slots=0, policies=["device"], tokens=12, warmup=2)[0]
    assert none.slot_hits == 0 and none.slot_misses == pytest.approx(336)
    res = {r.policy: r for r in simulate(str(STATS_FILE), slots=1376, policies=["static", "device", "belady"],
                                         tokens=60, seed=0)}
    dev = res["device"]
    assert dev.slot_hits + dev.slot_misses == pytest.approx(336)
    assert dev.slot_hits <= res["belady"].slot_hits
    assert 0.25 < dev.slot_hits / 336 < 0.46


def test_sim_replays_a_recorded_trace_in_order(tmp_path, capsys):
    """A trace keeps its temporal locality: tokens that repeat the previous token's picks hit in LRU and
    in the device cache once warmed, where independent draws from the same counts would not."""
    from tiermoe.store.routing_trace import make_header, write_trace

    rng = np.random.default_rng(0)
    layers, experts, k, tokens = 3, 64, 4, 200
    base = np.stack([np.stack([rng.choice(experts, k, replace=False) for _ in range(layers)])
                     for _ in range(tokens // 10)])  # [20, L, k]
    picks = np.repeat(base, 10, axis=0)  # [200, L, k]: each routing held for 10 tokens
    decode = np.ones(tokens, dtype=bool)
    decode[:5] = False  # a prefill, skipped by the simulator
    path = tmp_path / "trace.npz"
    write_trace(path, make_header("m", [1, 2, 3], experts, k), picks, decode)
    res = {r.policy: r for r in simulate(None, trace_file=str(path), slots=layers * k, tokens=10_000,
                                         policies=["lru", "device", "belady"], warmup=5)}
    for r in res.values():
        assert r.tokens == 190 and r.slot_hits + r.slot_misses == pytest.approx(layers * k)
    # every 10th token changes the picks: LRU (room for one token's picks) hits the other 9 of 10
    assert res["lru"].slot_hits / (layers * k) == pytest.approx(0.9, abs=0.02)
    assert res["belady"].slot_hits >= res["lru"].slot_hits
    assert main(["sim", "--trace", str(path), "--slots", "12", "--policy", "lru,device"]) == 0
    assert "12 picks/token" in capsys.readouterr().out
    bad = tmp_path / "bad.npz"
    bad.write_bytes(path.read_bytes()[:100])
    assert main(["sim", "--trace", str(bad), "--slots", "12"]) == 2
    assert main(["sim", "--slots", "12"]) == 2


def test_sim_device_cache_over_a_disk_tier(tmp_path):
    """The device cache's slots over a disk tier (sim_tiers.py) on 12 of the real layers, 11 % in slots, RAM for 40 %:
    every pick is a slot hit, a RAM hit or a disk read; the slots reach static placement's hits and RAM's rule
    comes near its disk reads. Read-ahead's reserve of free entries costs reads unless the freed entries keep
    their records (parked), and more the larger it is."""
    stats = load_stats(STATS_FILE)
    path = tmp_path / "stats12.json"
    path.write_text(json.dumps({f"layers.{layer}": stats[layer] for layer in sorted(stats)[:12]}))
    slots, host = 380, 1382

    def run(policies, **kw):
        return {r.policy: r for r in simulate(str(path), slots=slots, policies=policies, tokens=300, seed=1,
                                              host_experts=host, **kw)}

    res = run(["static", "device"], ram_rules=("heat", "exclusive"), reserve=64)
    static = res["static"]
    for name in ("device/heat", "device/exclusive"):
        r = res[name]
        assert r.slot_hits + r.host_hits + r.disk_reads == pytest.approx(96)
        assert r.slot_hits >= 0.97 * static.slot_hits, (name, r, static)
        assert static.disk_reads <= r.disk_reads <= 1.1 * static.disk_reads, (name, r, static)
    lost = run(["device"], reserve=64, lost_reserve=True)["device/heat"]
    big_lost = run(["device"], reserve=170, lost_reserve=True)["device/heat"]
    big = run(["device"], reserve=170)["device/heat"]
    assert res["device/heat"].disk_reads < lost.disk_reads < big_lost.disk_reads
    assert big.disk_reads < lost.disk_reads
    with pytest.raises(UserError, match="ram-rule"):
        simulate(str(path), slots=slots, policies=["device"], tokens=5, host_experts=host, ram_rules=("lru",))
    with pytest.raises(UserError, match="reserve"):
        simulate(str(path), slots=slots, policies=["device"], tokens=5, host_experts=host, reserve=host + 1)


def test_static_hot_pins_without_a_warm_start():
    """--no-warm-start --static-hot N: the N hottest experts are still pinned (they pinned nothing before)."""
    kw = dict(slots=1376, policies=["lru"], tokens=40, seed=0, warmup=0, warm_start=False)
    cold = simulate(str(STATS_FILE), **kw)[0]
    pinned = simulate(str(STATS_FILE), static_hot=1376, **kw)[0]
    static = simulate(str(STATS_FILE), slots=1376, policies=["static"], tokens=40, seed=0, warmup=0)[0]
    assert pinned.slot_hits == pytest.approx(static.slot_hits)  # every slot pinned: the static placement
    assert pinned.slot_hits > cold.slot_hits  # an empty LRU cache warms up from its misses
