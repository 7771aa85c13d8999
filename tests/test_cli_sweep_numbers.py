"""Integers out of a library's range (a seed numpy or torch cannot take, a tier capacity no list
can hold): refused with exit code 2 and one line naming the flag, or taken as the largest value
that means anything, never an OverflowError or ValueError traceback."""

from __future__ import annotations

import json

import pytest

from testkit.cli import refused as _refused
from tiermoe.cli import main

HUGE = str(10**20)


@pytest.fixture
def stats(tmp_path):
    f = tmp_path / "stats.json"
    f.write_text(json.dumps({f"model.layers.{n}.mlp": [5, 4, 3, 2, 1, 1, 1, 1] for n in range(2)}))
    return str(f)


def test_sim_negative_seed(stats, capsys):
    _refused(capsys, ["sim", "--slots", "4", "--stats", stats, "--seed", "-1"], "--seed -1")


@pytest.mark.parametrize("flags", [["--slots", HUGE], ["--slots", "4", "--host-experts", HUGE, "--policy", "device"]])
def test_sim_capacity_beyond_every_expert(stats, capsys, flags):
    assert main(["sim", "--stats", stats, "--tokens", "50", *flags]) == 0


def test_generate_seed_out_of_range(tiny_dir, capsys):
    _refused(capsys, ["generate", "--model", str(tiny_dir("qwen3_moe")), "--device", "cpu", "--prompt", "hi",
                      "--max-tokens", "1", "--seed", HUGE], "--seed", HUGE)


def test_sim_negative_static_hot(stats, capsys):
    """A negative count once sliced the hot list from its end, pinning every expert but the coldest."""
    _refused(capsys, ["sim", "--slots", "4", "--stats", stats, "--static-hot=-1"], "--static-hot -1")


def test_sim_static_hot_beyond_every_expert_pins_them_all(stats, capsys):
    assert main(["sim", "--stats", stats, "--slots", "4", "--tokens", "50", "--policy", "lru",
                 "--static-hot", HUGE]) == 0


def test_generate_negative_routing_replay_seed(tiny_dir, stats, capsys):
    """numpy's SeedSequence once raised its ValueError as a traceback."""
    _refused(capsys, ["generate", "--model", str(tiny_dir("qwen3_moe")), "--device", "cpu", "--prompt", "hi",
                      "--max-tokens", "1", "--routing-replay", stats, "--routing-replay-seed=-1"],
             "--routing-replay-seed -1")
