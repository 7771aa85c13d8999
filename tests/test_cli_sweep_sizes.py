"""Sizes in GB given as inf, 1e400 (inf once parsed) or nan: argparse's float() accepts them, so
each command checks them itself: exit code 2 and one line naming the flag, never an
OverflowError or ValueError from turning them into a byte count."""

from __future__ import annotations

import pytest

from testkit.cli import refused as _refused
from tiermoe.cli import main


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_dir):
    out = tmp_path_factory.mktemp("sizes") / "store"
    assert main(["pack", str(tiny_dir("qwen3_moe")), str(out), "--quiet", "--no-direct-io"]) == 0
    return out


@pytest.mark.parametrize("flag", ["--host-expert-gb", "--gpu-expert-gb"])
@pytest.mark.parametrize("value", ["inf", "1e400"])
def test_plan_tier_size_not_finite(store, capsys, flag, value):
    _refused(capsys, ["plan", str(store), "--device", "cpu", flag, value], flag, "finite")


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_pack_shard_size_not_finite(tiny_dir, tmp_path, capsys, value):
    out = tmp_path / "out"
    _refused(capsys, ["pack", str(tiny_dir("qwen3_moe")), str(out), "--quiet", "--shard-size-gb", value],
             "--shard-size-gb", value)
    assert not out.exists()


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_generate_kv_cache_not_finite(store, capsys, value):
    _refused(capsys, ["generate", "--model", str(store), "--device", "cpu", "--prompt", "hi", "--max-tokens", "1",
                      "--kv-cache-gb", value], "--kv-cache-gb", value)
