"""Fixtures: scripted servers on free ports and a runner for `tiermoe bench ...` argv."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from tiermoe.bench import cli as bench_cli
from tiermoe.errors import UserError

from .scripted_server import Behaviour, serve


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise SystemExit(2)


def run_bench(argv: list[str], capsys) -> tuple[int, str]:
    """Run `tiermoe bench <argv>` through the bench parser only (other subsystems not needed)."""
    parser = _Parser(prog="tiermoe")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    bench_cli.register(sub)
    args = parser.parse_args(["bench", *argv])
    old = sys.argv
    sys.argv = ["tiermoe", "bench", *argv]
    try:
        rc = int(args.handler(args) or 0)
    except UserError as exc:
        print(f"tiermoe: error: {exc}", file=sys.stderr)
        rc = exc.exit_code
    finally:
        sys.argv = old
    out = capsys.readouterr()
    return rc, out.out + out.err


def load(path) -> dict:
    return json.loads(open(path).read())


@pytest.fixture(scope="module")
def right_url():
    with serve(Behaviour(right=True)) as url:
        yield url


@pytest.fixture(scope="module")
def wrong_url():
    with serve(Behaviour(right=False, decode_s_per_token=0.05)) as url:
        yield url
