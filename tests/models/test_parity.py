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


def test_parity_decode_steps_glm5_next(tiny_dir):
    """Every position as its own decode step (the path decode CUDA graphs replay on a GPU: KDA's
    recurrent step, MLA's gathered attention) agrees with the reference as prefill chunks do."""
    result = run_parity(str(tiny_dir("glm5_next")), None, "cpu", "float32", arch="glm5_next", decode_from=0,
                        reference_decode=False)  # transformers' own decode: tests/eval/test_parity_decode_reference.py
    assert result["positions"] >= 256 and result["decode_from"] == 0 and result["ref_decode_skipped"] == "not asked for"
    assert result["top1"] == 1.0
    assert result["kl_mean"] < 1e-6


@pytest.mark.parametrize("flag", [["--chunk", "0"], ["--decode-from", "-3"]])
def test_eval_parity_cli_rejects_bad_sizes(flag):
    proc = subprocess.run([sys.executable, "-m", "tiermoe.cli", "eval", "parity", "--tiny", "glm4_moe", *flag],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and flag[0] in proc.stderr
