"""The product does not import its benchmarks; the benchmarks' commands still join `tiermoe bench`."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "tiermoe"


def test_product_never_imports_benchmarks():
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n == "benchmarks" or n.startswith("benchmarks.") for n in names), path


def test_benchmark_commands_join_the_bench_group():
    from tiermoe.bench import cli as bench_cli

    parser = argparse.ArgumentParser(prog="tiermoe")
    bench_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "moe-gpu", "--tiny"])
    assert args.handler.__module__ == "benchmarks.moe_gpu"
