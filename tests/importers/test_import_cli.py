"""`tiermoe import-gguf` through the real argument parser (registered like every subsystem)."""

from __future__ import annotations

import argparse
import json

from gguf_fixtures import write_gguf

from tiermoe.errors import UserError
from tiermoe.importers import cli


def _run(argv):
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.handler(args)


def test_import_gguf_command(tmp_path, capsys):
    src = tmp_path / "m.gguf"
    write_gguf(src, "qwen3")
    assert _run(["import-gguf", str(src), str(tmp_path / "out"), "--experts-per-layer", "4", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "glm4_moe from qwen3 GGUF, float32" in out and "exact" in out
    assert "experts from 6 F32 tensors (dequantized)" in out and "Q3_K" not in out
    assert json.loads((tmp_path / "out" / "tiermoe_import.json").read_text())["expert_source_types"] == {"F32": 6}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["use_qk_norm"] is True


def test_import_gguf_reports_user_errors(tmp_path):
    try:
        _run(["import-gguf", str(tmp_path / "nope.gguf"), str(tmp_path / "out")])
    except UserError as exc:
        assert "nope.gguf: no such GGUF file" in str(exc)
    else:
        raise AssertionError("expected UserError")
