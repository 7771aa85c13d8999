"""Every family against the transformers reference: fp32, CPU, teacher-forced."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tiermoe.eval.parity import run_parity
from tiermoe.models.tiny import TINY_ARCHS


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_parity_fp32(arch, tiny_dir):
    result = run_parity(str(tiny_dir(arch)), None, "cpu", "float32", arch=arch)
    assert result["positions"] >= 256
    assert result["top1"] == 1.0
    assert result["kl_mean"] < 1e-6
    assert result["max_abs_logit_diff"] < 1e-3


def test_eval_parity_cli_prints_json_last():
    proc = subprocess.run([sys.executable, "-m", "tiermoe.cli", "eval", "parity", "--tiny", "glm4_moe"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert list(result)[:6] == ["arch", "positions", "top1", "kl_mean", "kl_max", "max_abs_logit_diff"]
    assert result["arch"] == "glm4_moe" and result["top1"] == 1.0 and result["kl_mean"] < 1e-6


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_parity_bf16_bit_identical(arch, tiny_dir):
    """bf16 on the CPU: every op mirrors the reference's dtype handling (parameters it keeps in
    fp32 included, models/fp32_params.py), so the logits are the reference's bit for bit."""
    result = run_parity(str(tiny_dir(arch)), None, "cpu", "bfloat16", arch=arch, fp32_floor=False)
    assert result["positions"] >= 256
    assert result["top1"] == 1.0 and result["max_abs_logit_diff"] == 0.0
