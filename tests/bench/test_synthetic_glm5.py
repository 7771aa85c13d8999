"""`bench make-glm5`: a reduced-width glm5_next store, and the full-width sizes without writing.

The small store (hidden 64, 2 MoE layers + MTP, 32 experts) is written once per module on the
CPU; the tests check that it verifies, that its manifest is a glm5_next store of 3 dense + 2 MoE
layers (the MTP layer's experts packed too), that the real routing statistics sit beside it, and
that the engine loads it and generates. The full-width sizes come from the model skeleton alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tiermoe.bench.synthetic_glm5 import SMALL, Glm5Spec, make_glm5, sizes

from .conftest import run_bench

ROOT = Path(__file__).resolve().parents[2]
SPEC = Glm5Spec(moe_layers=2, seed=5, **SMALL)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("glm5") / "store"
    make_glm5(out, SPEC, device="cpu", log=lambda _m: None)
    return out


def test_store_verifies_and_has_the_glm5_next_layout(store):
    from tiermoe.store import verify_store
    from tiermoe.store.planner import load_stats

    checked, bad = verify_store(store, direct_io=False)
    assert checked == 3 * 32 and not bad
    m = json.loads((store / "manifest.json").read_text())
    cfg = m["model_config"]
    assert cfg["architectures"] == ["Glm5NextForConditionalGeneration"] and cfg["model_type"] == "glm5_next"
    text = cfg["text_config"]
    assert text["num_hidden_layers"] == 5 and text["mlp_layer_types"] == ["dense"] * 3 + ["sparse"] * 2
    assert text["layer_types"][3] == "indexed_attention" and text["num_nextn_predict_layers"] == 1
    assert text["n_routed_experts"] == 32 and text["hc_mult"] == 4
    assert m["num_layers"] == 5 and m["moe_layers"] == [3, 4, 5]  # the MTP layer (5) holds experts too
    assert m["quantization"] == {"kind": "int4", "group_size": 32}
    assert m["expert_prefixes"]["3"] == "model.language_model.layers.3.mlp.experts"
    stats = load_stats(store / "expert-stats.json")
    assert sorted(stats) == [3, 4, 5] and all(len(v) == 32 for v in stats.values())


def test_engine_loads_the_store_and_generates(store):
    from tiermoe.engine.build import build_engine_core
    from tiermoe.engine.llm_engine import generate_ids
    from tiermoe.protocol import SamplingParams

    engine = build_engine_core(str(store), device="cpu", dtype="float32", max_num_seqs=1)
    ids = engine.tokenizer("The capital of France is").input_ids
    out = generate_ids(engine, [ids], SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert len(out) == 6 and max(out) < len(engine.tokenizer)  # rows beyond the tokenizer never win


def test_full_width_sizes_without_writing(tmp_path, capsys):
    s = sizes(Glm5Spec(moe_layers=12))
    assert s["record_bytes"] == 12_976_128  # int4 G128: 3 x 4096 x 2048 weights + bf16 scales, 4 KiB aligned
    assert s["layers"] == 15 and s["moe_layers"] == 13 and s["expert_records"] == 13 * 288
    assert s["expert_bytes"] == 13 * 288 * 12_976_128
    assert s["dense_bytes"] == 8_524_421_844 and s["dense_tensors"] == 439
    rc, out = run_bench(["make-glm5", str(tmp_path / "x"), "--moe-layers", "12", "--sizes-only"], capsys)
    assert rc == 0 and json.loads(out) == s and not (tmp_path / "x").exists()


def test_bad_flags_are_one_line_errors(capsys, tmp_path):
    for argv in (["--top-k", "99"], ["--group", "48"], ["--moe-layers", "0"], ["--kind", "int5"]):
        rc, out = run_bench(["make-glm5", str(tmp_path / "y"), "--small", *argv], capsys)
        assert rc == 2 and out.count("\n") == 1 and "error" in out, (argv, out)
    (tmp_path / "a-file").write_text("not a directory")
    rc, out = run_bench(["make-glm5", str(tmp_path / "a-file"), "--small"], capsys)
    assert rc == 2 and out.count("\n") == 1 and "cannot create the store directory" in out, out


def test_glm4_moe_script_still_writes_a_loadable_store(tmp_path):
    """scripts/synth_glm_store.py, on the shared writer: a tiny mixed store that verifies."""
    from tiermoe.store import verify_store

    out = tmp_path / "glm"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "synth_glm_store.py"), str(out), "--tiny",
                    "--moe-layers", "2", "--device", "cpu", "--cold-kind", "int3", "--cold-group", "16"],
                   check=True, capture_output=True)
    checked, bad = verify_store(out, direct_io=False)
    m = json.loads((out / "manifest.json").read_text())
    assert checked == 2 * 16 and not bad and m["moe_layers"] == [1, 2]
    assert m["quantization"]["cold_kind"] == "int3" and sum(m["quantization"]["records_per_layout"]) == 32
    assert (out / "expert-stats.json").is_file()


@pytest.mark.parametrize("drafting", [0, 1])
def test_mtp_layer_gets_no_slots_unless_drafting(store, drafting, monkeypatch):
    """The MTP layer (5) runs only when drafting: with drafting off the device cache's split and its
    warm start give its experts no slot (rate 0), and the trunk's layers share the budget."""
    from tiermoe.engine.build import engine_config
    from tiermoe.moe.device_cache import split_budget
    from tiermoe.store.planner import key_rates
    from tiermoe.store.records import load_manifest

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the device cache's kernels, settled (not run) on the CPU
    record = load_manifest(store).record_bytes
    cfg = engine_config(str(store), device="cpu", dtype="bfloat16", max_num_seqs=1,
                        options={"device_cache": "on", "expert_kernel": "triton", "gpu_expert_gb": 40 * record / 2**30,
                                 "num_speculative_tokens": drafting})
    dc = cfg.experts.device_cache
    assert dc.idle_layers == (() if drafting else (5,))
    m = load_manifest(store)
    rates, _, _ = key_rates(m, store / "expert-stats.json", 4, dc.idle_layers)
    by_layer = {layer: [rates[r.index] for r in m.records if r.layer == layer] for layer in m.moe_layers}
    _, per_layer = split_budget(dc.slots, [32, 32, 32], 4, 1, dc.stage_misses, list(by_layer.values()))
    assert (per_layer[2] == 0) == (not drafting) and sum(per_layer) > 0
    assert all(r == 0.0 for r in by_layer[5]) == (not drafting)
