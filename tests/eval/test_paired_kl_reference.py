"""`tiermoe eval paired-kl --reference`: one store against another (quantized against bf16)."""

from __future__ import annotations

import json

from tiermoe.cli import main
from tiermoe.store.pack import pack


def _pack(src, out, quant, group_size=None):
    pack(str(src), str(out), quant=quant, group_size=group_size, progress=False, log=lambda _: None)
    return out


def test_reference_store_same_records_is_exact_and_int4_is_close(tiny_dir, tmp_path, capsys):
    """A store against its own bytes gives KL 0 and top-1 1.0 (same tokens, same kernels); an int4
    store against the bf16 one is near, and the JSON line names both kinds and record sizes."""
    src = tiny_dir("qwen3_moe")
    bf16 = _pack(src, tmp_path / "bf16", "bf16")
    int4 = _pack(src, tmp_path / "int4", "int4", 32)
    argv = ["eval", "paired-kl", "--tokens", "5", "--prompts", "Hello", "Count to five.", "--device", "cpu",
            "--dtype", "float32"]
    assert main([*argv, "--model", str(bf16), "--reference", str(bf16)]) == 0
    same = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert same["positions"] == 10 and same["kl_max"] == 0.0 and same["top1"] == 1.0
    assert main([*argv, "--model", str(int4), "--reference", str(bf16)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith(f"paired KL of {int4} against {bf16} over 10 positions")
    r = json.loads(lines[-1])
    assert r["kind"] == "int4" and r["group_size"] == 32 and r["reference_kind"] == "bf16"
    assert r["record_bytes"] < r["reference_record_bytes"]
    assert 0 < r["kl_mean"] < 0.05 and r["top1"] >= 0.8


def test_reference_of_another_model_is_refused(tiny_dir, tmp_path, capsys):
    a = _pack(tiny_dir("qwen3_moe"), tmp_path / "a", "bf16")
    b = _pack(tiny_dir("glm4_moe"), tmp_path / "b", "bf16")
    capsys.readouterr()  # the tiny checkpoint writer's progress bars
    rc = main(["eval", "paired-kl", "--model", str(a), "--reference", str(b), "--tokens", "2", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "different experts" in err[0]
