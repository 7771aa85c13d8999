"""The README names every user-facing flag and every environment variable tiermoe reads."""

from __future__ import annotations

import argparse
from pathlib import Path

from tiermoe import env
from tiermoe.cli import build_parser

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
USER_COMMANDS = ("serve", "generate", "pack", "verify", "plan", "sim", "doctor", "tiny", "import-gguf", "eval")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps the subcommands only there
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    found = set()
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        found.update(action.option_strings)
    for sub in _subparsers(parser).values():
        found |= _options(sub)
    return found


def test_every_flag_of_the_user_commands_is_in_the_readme():
    commands = _subparsers(build_parser())
    missing = {f"{name} {flag}" for name in USER_COMMANDS for flag in _options(commands[name]) if flag not in README}
    assert not missing, f"README.md does not mention: {sorted(missing)}"


def test_every_environment_variable_is_in_the_readme():
    missing = [v.name for v in env.VARIABLES if f"`{v.name}`" not in README]
    assert not missing, f"README.md does not mention: {missing}"
