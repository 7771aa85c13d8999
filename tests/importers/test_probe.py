"""The expert shapes of a GGUF import, read from the header alone, and `tiermoe pack FILE.gguf`
checking its group size with them before the import."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from gguf_fixtures import write_gguf

from tiermoe.cli import main
from tiermoe.importers.gguf import gguf_to_hf
from tiermoe.importers.probe import gguf_expert_shape
from tiermoe.store.catalog import Checkpoint


@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_header_shapes_match_the_imported_checkpoint(tmp_path, arch):
    src = tmp_path / "m.gguf"
    write_gguf(src, arch)
    ck = Checkpoint(gguf_to_hf(src, tmp_path / "hf", dtype="float32"))
    assert gguf_expert_shape(src) == (ck.hidden, ck.intermediate)
    (tmp_path / "junk.gguf").write_bytes(b"GGUF\x07\x00\x00\x00")
    assert gguf_expert_shape(tmp_path / "junk.gguf") is None  # the import names what is wrong


def test_pack_gguf_checks_the_group_size_first_and_resumes(tmp_path, capsys):
    src = tmp_path / "m.gguf"
    write_gguf(src, "llama")  # hidden 64; dense ffn 96 cut into 8 experts of 8 (+ a shared expert)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "tiermoe.cli", "pack", str(src), str(tmp_path / "st"), "--quant",
                        "int8", "--group-size", "16"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "importing" not in r.stderr, r.stderr
    assert "these would: 8, 4, 2" in r.stderr and r.stderr.count("\n") == 1
    assert time.monotonic() - t0 < 60
    assert main(["pack", str(src), str(tmp_path / "st"), "--quant", "int8", "--quiet"]) == 0
    assert "(int8, group size 8)" in capsys.readouterr().out
    # the GGUF file, not its temporary import, is the source a second run resumes from
    (tmp_path / "st" / "manifest.json").unlink()
    assert main(["pack", str(src), str(tmp_path / "st"), "--quant", "int8", "--quiet"]) == 0
    assert "0 written" in capsys.readouterr().out
