"""Hostile input to the store commands (`verify`, `plan`, `pack`): every refusal is exit code 2 and
one `tiermoe: error:` line naming the bad value, never a traceback."""

from __future__ import annotations

import json
import shutil

import pytest

from testkit.cli import refused as _refused
from tiermoe.cli import main


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_dir):
    """A packed tiny qwen3_moe store (bf16)."""
    out = tmp_path_factory.mktemp("sweep") / "store"
    assert main(["pack", str(tiny_dir("qwen3_moe")), str(out), "--quiet", "--no-direct-io"]) == 0
    return out


def _copy_with_manifest(store, tmp_path, data) -> str:
    bad = tmp_path / "bad"
    shutil.copytree(store, bad)
    (bad / "manifest.json").write_text(json.dumps(data))
    return str(bad)


@pytest.mark.parametrize("command", [["verify"], ["plan", "--device", "cpu"]])
def test_manifest_that_is_a_list(store, tmp_path, capsys, command):
    bad = _copy_with_manifest(store, tmp_path, [1, 2])
    _refused(capsys, [command[0], bad, *command[1:]], "manifest.json", "JSON object")


@pytest.mark.parametrize("field, value", [("experts_per_layer", [8]), ("model_config", "x")])
def test_manifest_field_of_the_wrong_type(store, tmp_path, capsys, field, value):
    data = json.loads((store / "manifest.json").read_text())
    data[field] = value
    bad = _copy_with_manifest(store, tmp_path, data)
    _refused(capsys, ["plan", bad, "--device", "cpu"], "manifest.json", "malformed")


def test_plan_unknown_device(store, capsys):
    _refused(capsys, ["plan", str(store), "--device", "tpu"], "--device", "tpu")


def test_verify_more_threads_than_records(store, capsys):
    """A reader beyond one a record has nothing to read: 10**20 of them finish at once, not by
    allocating 2 * 10**20 buffers."""
    assert main(["verify", str(store), "--threads", str(10**20), "--quiet", "--no-direct-io"]) == 0
