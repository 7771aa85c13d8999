"""Bad model inputs give one line naming the file and field, and exit code 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest


def _generate(model) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tiermoe.cli", "generate", "--model", str(model), "--prompt", "hi",
                           "--max-tokens", "2"], capture_output=True, text=True, timeout=120)


def _assert_one_line_error(proc, *needles):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0]


@pytest.fixture()
def ckpt(tiny_dir, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny_dir("qwen3_moe"), dst)
    return dst


def _edit_config(path, **fields):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(fields)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_directory(tmp_path):
    _assert_one_line_error(_generate(tmp_path / "nope"), "nope", "does not exist")  # model_source.resolve_model


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    _assert_one_line_error(_generate(ckpt), "config.json", "not found")


def test_unknown_architecture(ckpt):
    _edit_config(ckpt, model_type="gpt_bigmoe")
    _assert_one_line_error(_generate(ckpt), "config.json", "model_type", "gpt_bigmoe")


def test_unsupported_field(ckpt):
    _edit_config(ckpt, use_sliding_window=True, sliding_window=64)
    _assert_one_line_error(_generate(ckpt), "config.json", "use_sliding_window")


def test_missing_weights_file(ckpt):
    (ckpt / "model.safetensors").unlink()
    _assert_one_line_error(_generate(ckpt), "safetensors")


def test_missing_tensor(ckpt):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["model.layers.0.self_attn.q_proj.weight"]
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    _assert_one_line_error(_generate(ckpt), "model.layers.0.self_attn.q_proj.weight")


def test_bad_flag_value(ckpt):
    proc = subprocess.run([sys.executable, "-m", "tiermoe.cli", "generate", "--model", str(ckpt), "--prompt", "hi",
                           "--temperature", "-1"], capture_output=True, text=True, timeout=120)
    _assert_one_line_error(proc, "temperature")


def test_generate_prints_only_completion(ckpt):
    proc = _generate(ckpt)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("\n") and len(proc.stdout.splitlines()) <= 2
