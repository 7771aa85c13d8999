"""Mixed-precision stores (`pack --cold-quant`): the hot experts chosen from the statistics, the
records back to back at their own lengths, verify, one-line refusals, and exact mode across tiers."""

from __future__ import annotations

import json

import pytest
import torch
from testkit.stores import pack_tiny

from tiermoe.cli import main
from tiermoe.engine.build import build_engine_core
from tiermoe.errors import UserError
from tiermoe.eval.parity import engine_logits, parity_prompts
from tiermoe.store.mixed import hot_experts
from tiermoe.store.records import RECORD_ALIGN, load_manifest


def test_hot_experts_take_the_share_of_picks_most_picked_first():
    assert hot_experts([10, 50, 30, 10], 0.5) == {1}
    assert hot_experts([10, 50, 30, 10], 0.6) == {1, 2}
    assert hot_experts([5, 5, 5, 5], 0.5) == {0, 1}  # ties: lower id first
    assert hot_experts([3, 1], 0.0) == set() and hot_experts([3, 1], 1.0) == {0, 1}
    assert hot_experts([0, 0, 0], 0.2) == {0, 1, 2}  # no picks recorded: nothing is known to be cold


@pytest.fixture(scope="module")
def stats_file(tiny_dir, tmp_path_factory):
    """Skewed pick counts for every MoE layer of the tiny glm4_moe (8 experts a layer): expert 0..2
    take 70 % of the picks."""
    cfg = json.loads((tiny_dir("glm4_moe", "bfloat16") / "config.json").read_text())
    first = int(cfg.get("first_k_dense_replace", 0))
    counts = [40, 20, 10, 8, 8, 6, 5, 3][: int(cfg["n_routed_experts"])]
    path = tmp_path_factory.mktemp("stats") / "stats.json"
    path.write_text(json.dumps({f"model.layers.{layer}.mlp": counts
                                for layer in range(first, int(cfg["num_hidden_layers"]))}))
    return path


@pytest.fixture(scope="module")
def mixed(tiny_dir, tmp_path_factory, stats_file):
    """bf16 hot experts (12,288-byte records) and int3 cold ones (4,096): the tiny model's int4 and
    int3 records both pad to 4,096 bytes, so bf16 makes the records differ in length."""
    return pack_tiny(tiny_dir, tmp_path_factory, "glm4_moe", dtype="bfloat16", quant="bf16",
                     cold_quant="int3", cold_group_size=32, expert_stats=str(stats_file), hot_share=0.6)[1]


def test_mixed_manifest_layouts_offsets_and_verify(mixed, capsys):
    m = load_manifest(mixed)
    assert m.mixed and [lay.kind for lay in m.layouts] == ["bf16", "int3"]
    assert m.record_bytes == m.layouts[0].length == 12288 and m.layouts[1].length == 4096
    q = m.data["quantization"]
    assert q["cold_kind"] == "int3" and q["cold_group_size"] == 32 and q["hot_share"] == 0.6
    assert q["expert_stats"] == "stats.json"
    for layer in m.moe_layers:
        assert m.layout_ids(layer) == [0, 0, 1, 1, 1, 1, 1, 1]  # 40 + 20 of 100 picks reach 0.6
    off = 0
    for r in m.records:
        assert r.offset == off and r.offset % RECORD_ALIGN == 0 and r.length == m.layout_of(r).length
        off += r.length
    assert m.experts_path.stat().st_size == off
    assert main(["verify", str(mixed), "--quiet"]) == 0
    assert capsys.readouterr().out.startswith("ok:")


def test_mixed_records_decode_at_their_own_kind(mixed, tiny_dir):
    """A cold expert's record is the int3 encoding of the checkpoint's weights, a hot one int4's."""
    from tiermoe.store.catalog import Checkpoint
    from tiermoe.store.records import RecordLayout, decode_record, encode_expert

    m = load_manifest(mixed)
    ck = Checkpoint(tiny_dir("glm4_moe", "bfloat16"))
    with open(m.experts_path, "rb") as f:
        for r in (m.record(m.moe_layers[0], 0), m.record(m.moe_layers[0], 5)):
            f.seek(r.offset)
            got = torch.frombuffer(bytearray(f.read(r.length)), dtype=torch.uint8)
            lay = m.layout_of(r)
            want = encode_expert(RecordLayout.build(lay.kind, lay.hidden, lay.intermediate, lay.group_size),
                                 *ck.load_expert(r.layer, r.expert))
            assert torch.equal(got, want)
            gu, _ = decode_record(lay, got, torch.float32)
            assert gu.shape == (2 * lay.intermediate, lay.hidden)
    ck.close()


def _logits(model, **options):
    engine = build_engine_core(str(model), device="cpu", dtype="bfloat16", max_num_seqs=1, options=options)
    prompts = parity_prompts(engine.tokenizer, engine.vocab_size, min_positions=0)[:3]
    out = torch.cat([engine_logits(engine, p) for p in prompts])
    counters = engine.runner.experts.counters()
    engine.runner.experts.close()
    return out, counters


def test_mixed_store_bit_identical_across_tiers(mixed):
    m = load_manifest(mixed)
    entry = m.record_bytes
    all_ram, c_all = _logits(mixed)
    two, c2 = _logits(mixed, host_expert_gb=2 * entry / 2**30)
    none, c0 = _logits(mixed, host_expert_gb=0)
    assert torch.equal(all_ram, two) and torch.equal(all_ram, none)
    assert c_all["disk"]["reads"] == 0 and c0["disk"]["reads"] > 0 and c2["host"]["capacity"] == 2


@pytest.mark.parametrize("extra, message", [
    (["--cold-quant", "int3"], "needs --expert-stats"),
    (["--cold-quant", "int4", "--expert-stats", "S"], "is --quant itself"),
    (["--cold-quant", "int3", "--expert-stats", "missing.json"], "no such file"),
    (["--cold-quant", "int3", "--expert-stats", "S", "--hot-share", "1.5"], "between 0 and 1"),
    (["--expert-stats", "S"], "give --cold-quant too"),
    (["--hot-share", "0.5"], "give --cold-quant too"),  # was ignored: a store of one kind
    (["--cold-quant", "int3", "--cold-group-size", "3", "--expert-stats", "S"], "--cold-group-size 3 does not divide"),
])
def test_pack_cold_quant_refusals(tiny_dir, tmp_path, stats_file, capsys, extra, message):
    extra = [str(stats_file) if a == "S" else a for a in extra]
    rc = main(["pack", str(tiny_dir("glm4_moe", "bfloat16")), str(tmp_path / "out"), "--quant", "int4", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists()


def test_stats_for_another_model_are_refused(tiny_dir, tmp_path):
    from tiermoe.store.pack import pack

    bad = tmp_path / "stats.json"
    bad.write_text(json.dumps({"model.layers.1.mlp": [1, 2, 3]}))  # 3 experts, the model has 8
    with pytest.raises(UserError, match="lists 3 experts"):
        pack(str(tiny_dir("glm4_moe", "bfloat16")), str(tmp_path / "o"), quant="int4", group_size=32,
             cold_quant="int3", expert_stats=str(bad), progress=False, log=lambda _: None)


def test_plan_counts_each_read_at_its_own_length(mixed, stats_file, capsys):
    """The plan says how the store is mixed, and its bound reads each record at its own length: cold
    picks count at their length's share of a tier entry."""
    from tiermoe.store.planner import expected_hits

    m = load_manifest(mixed)
    assert main(["plan", str(mixed), "--stats", str(stats_file), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    n_cold = sum(1 for r in m.records if r.layout)
    assert f"mixed store: {len(m.records) - n_cold} hot bf16 records" in out and f"{n_cold} cold int3" in out
    import re

    picks = int(re.search(r"(\d+) picks per token", out).group(1))
    kib = float(re.search(r"expert bytes per token: ([\d.]+) KiB", out).group(1))
    assert 4 * picks < kib < 12 * picks  # between all-cold (4 KiB records) and all-hot (12 KiB)
    rates = {r.index: 1.0 + (r.expert == 0) for r in m.records}
    weight = {r.index: r.length / m.record_bytes for r in m.records}
    plain, weighted = expected_hits(rates, 0, len(rates)), expected_hits(rates, 0, len(rates), weight)
    assert weighted["host"] < plain["host"] and weighted["slots"] == plain["slots"] == 0


def test_fast_mode_lane_reads_each_record_at_its_own_layout(mixed):
    """The CPU lane computes hot (bf16) and cold (int3) experts of one layer, each at its layout:
    fast mode stays within the lane's rounding of exact mode (a record read at the wrong layout
    would be garbage)."""
    from tiermoe.eval.paired_kl import run_paired_kl

    r = run_paired_kl(str(mixed), device="cpu", dtype="bfloat16", tokens=6, texts=["Hello", "Count to five."],
                      options={"cpu_lane_experts": 4, "cpu_lane_threads": 1})
    assert r["cpu_lane"]["experts"] > 0 and r["cpu_lane"]["kernel"].startswith("native")
    assert r["kl_max"] < 1e-2 and r["top1"] >= 0.9
