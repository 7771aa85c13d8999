"""Hostile output paths for the commands that write a directory (`tiny`, `pack`): an empty
string, a path under a file, a file, a non-empty directory. Each is refused with exit code 2 and
one error line naming the path, writes nothing, and never clobbers what is there."""

from __future__ import annotations

import pytest

from testkit.cli import refused as _refused


@pytest.fixture
def a_file(tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("keep me\n")
    return f


def test_tiny_refuses_empty_out_dir(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _refused(capsys, ["tiny", "qwen3_moe", ""], "OUT_DIR", "empty")
    assert list(tmp_path.iterdir()) == []


def test_tiny_refuses_out_dir_under_a_file(a_file, capsys):
    _refused(capsys, ["tiny", "qwen3_moe", str(a_file / "x")], str(a_file / "x"), "Not a directory")


def test_tiny_refuses_a_file(a_file, capsys):
    _refused(capsys, ["tiny", "qwen3_moe", str(a_file)], str(a_file), "not a directory")
    assert a_file.read_text() == "keep me\n"


def test_tiny_refuses_a_non_empty_directory(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"mine": 1}')
    _refused(capsys, ["tiny", "qwen3_moe", str(tmp_path)], str(tmp_path), "not empty")
    assert (tmp_path / "config.json").read_text() == '{"mine": 1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_tiny_unknown_arch_makes_no_directory(tmp_path, capsys):
    _refused(capsys, ["tiny", "nosuch", str(tmp_path / "out")], "nosuch")
    assert not (tmp_path / "out").exists()


def test_tiny_seed_out_of_range(tmp_path, capsys):
    _refused(capsys, ["tiny", "qwen3_moe", str(tmp_path / "out"), "--seed", str(10**25)], "--seed", str(10**25))
    assert not (tmp_path / "out").exists()


def test_pack_refuses_empty_out(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _refused(capsys, ["pack", str(tiny_dir("qwen3_moe")), "", "--quiet"], "OUT", "empty")
    assert list(tmp_path.iterdir()) == []


def test_pack_refuses_out_under_a_file(tiny_dir, a_file, capsys):
    _refused(capsys, ["pack", str(tiny_dir("qwen3_moe")), str(a_file / "x"), "--quiet"], str(a_file / "x"))
