"""Building the CLI parser must stay light: no torch import (every `tiermoe` start pays it)."""

from __future__ import annotations

import subprocess
import sys


def test_parser_imports_no_torch():
    code = ("import sys; from tiermoe.cli import build_parser; build_parser(); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_store_quant_choices_match_records():
    from tiermoe.store.cli import QUANT_CHOICES
    from tiermoe.store.records import QUANT_KINDS

    assert tuple(QUANT_CHOICES) == tuple(QUANT_KINDS)
