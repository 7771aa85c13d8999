"""`tiermoe plan`'s decode upper bound, and routing traces taken wherever statistics are."""

import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from store_fixtures import make_checkpoint
from tiermoe.cli import main
from tiermoe.store.pack import pack
from tiermoe.store.planner import CPU_GBS_PER_THREAD, build_plan, dense_bytes_per_token, load_stats
from tiermoe.store.records import load_manifest
from tiermoe.store.routing_trace import make_header, write_trace
from tiermoe.store.sim import simulate

QUIET = dict(progress=False, log=lambda s: None)


@pytest.fixture
def store(tmp_path):
    make_checkpoint(tmp_path / "src")
    pack(tmp_path / "src", tmp_path / "st", **QUIET)
    return tmp_path / "st"


def test_bound_counts_the_dense_weights_and_the_cpu_threads(store, capsys):
    m = load_manifest(store)
    index = json.loads((store / "model.safetensors.index.json").read_text())
    dense = index["metadata"]["total_size"]
    assert dense_bytes_per_token(m) == dense > 0
    one = build_plan(m, device="cpu", gpu_expert_gb=0, host_expert_gb=1, cpu_threads=1)
    four = build_plan(m, device="cpu", gpu_expert_gb=0, host_expert_gb=1, cpu_threads=4)
    assert one.floor_s["dense"] == pytest.approx(dense / (CPU_GBS_PER_THREAD * 1e9))
    assert four.floor_s["dense"] == pytest.approx(one.floor_s["dense"] / 4)
    for plan in (one, four):  # the expert lanes overlap one another, the dense layers add to them
        lanes = [v for k, v in plan.floor_s.items() if k not in ("dense", "floor")]
        assert plan.floor_s["floor"] == pytest.approx(max(lanes) + plan.floor_s["dense"])
    # the CPU computes the experts read from disk too: with no host tier the cpu lane keeps every pick
    disk = build_plan(m, device="cpu", gpu_expert_gb=0, host_expert_gb=0, cpu_threads=1)
    assert disk.floor_s["cpu"] == pytest.approx(one.floor_s["cpu"]) and disk.floor_s["disk"] > 0
    assert main(["plan", str(store), "--device", "cpu", "--cpu-threads", "2", "--host-expert-gb", "1"]) == 0
    out = capsys.readouterr().out
    assert "decode upper bound: " in out and "weight reads only" in out and "on 2 CPU threads" in out


def test_untied_embedding_table_is_not_read_per_token():
    config = {"vocab_size": 1000, "hidden_size": 64, "tie_word_embeddings": False}
    m = SimpleNamespace(data={"dense_bytes": 10**6, "source_dtype": "bfloat16"}, root=None, config=config)
    assert dense_bytes_per_token(m) == 10**6 - 1000 * 64 * 2
    m.config = {**config, "tie_word_embeddings": True}  # the table is the output head: read whole
    assert dense_bytes_per_token(m) == 10**6


def _trace(path, layers=(0, 1), experts=8):
    picks = np.array([[[0, 1], [2, 3]], [[0, 5], [2, 3]], [[0, 6], [7, 3]]], dtype=np.uint16)  # [3 tokens, L, k]
    decode = np.array([False, True, True])
    write_trace(path, make_header("m", list(layers), experts, 2), picks, decode)
    return path


def test_a_recorded_trace_is_statistics_everywhere(store, tmp_path, capsys):
    trace = _trace(tmp_path / "r.npz")
    stats = load_stats(trace)  # decode tokens only: the prefill token's picks are left out
    assert stats == {0: [2.0, 0, 0, 0, 0, 1.0, 1.0, 0], 1: [0, 0, 1.0, 2.0, 0, 0, 0, 1.0]}
    assert main(["plan", str(store), "--stats", str(trace), "--gpu-expert-gb", str(12288 / 2**30),
                 "--host-expert-gb", "0"]) == 0
    out = capsys.readouterr().out
    assert "statistics from r.npz" in out
    res = simulate(str(trace), slots=2, policies=["lru"], tokens=50, top_k=2)
    assert res[0].policy == "lru"
    assert main(["sim", "--stats", str(trace), "--slots", "2", "--top-k", "2", "--tokens", "50"]) == 0


def test_record_routing_output_feeds_expert_stats(tiny_dir, tmp_path, capsys):
    """The file `--record-routing` writes is what `--expert-stats` and `plan --stats` take."""
    src = tiny_dir("qwen3_moe")
    trace = tmp_path / "own.npz"
    r = subprocess.run([sys.executable, "-m", "tiermoe.cli", "generate", "--model", str(src), "--device", "cpu",
                        "--prompt", "hello", "--max-tokens", "4", "--record-routing", str(trace)],
                       capture_output=True, text=True, timeout=300)  # the trace is complete at exit
    assert r.returncode == 0, r.stderr
    pack(src, tmp_path / "st", **QUIET)
    capsys.readouterr()
    assert main(["plan", str(tmp_path / "st"), "--stats", str(trace), "--device", "cpu"]) == 0
    assert "statistics from own.npz" in capsys.readouterr().out
    assert main(["generate", "--model", str(tmp_path / "st"), "--device", "cpu", "--prompt", "hello",
                 "--max-tokens", "2", "--expert-stats", str(trace), "--host-expert-gb", "0"]) == 0
