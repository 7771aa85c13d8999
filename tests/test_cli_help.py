"""Help and usage errors of the whole `tiermoe` command tree, walked from the real parser."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from tiermoe.cli import build_parser


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("tiermoe",)):
    """(path, parser) of the top parser and every subcommand at any depth."""
    yield path, parser
    for action in parser._actions:  # argparse keeps the subcommands only there
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, path + (name,))


COMMANDS = list(_commands(build_parser()))


def _flags(parser: argparse.ArgumentParser):
    return [a for a in parser._actions if a.help != argparse.SUPPRESS
            and not isinstance(a, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction))]


def test_the_tree_is_walked():
    names = {" ".join(path) for path, _ in COMMANDS}
    assert {"tiermoe serve", "tiermoe pack", "tiermoe verify", "tiermoe plan", "tiermoe sim", "tiermoe doctor",
            "tiermoe tiny", "tiermoe generate", "tiermoe bench floor"} <= names


@pytest.mark.parametrize("path,parser", COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_every_command_and_flag_has_help_with_its_default(path, parser):
    assert parser.description and len(parser.description) > 20, f"{' '.join(path)}: no description"
    text = "".join(parser.format_help().split())  # wrapping breaks long defaults at spaces and hyphens
    for action in _flags(parser):
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help.strip(), f"{' '.join(path)} {name}: no help"
        shown = action.default not in (None, False) and action.option_strings and not isinstance(
            action, argparse.BooleanOptionalAction)
        if shown and "default" not in action.help.lower():
            assert "".join(f"(default: {action.default})".split()) in text, f"{' '.join(path)} {name}: no default"


@pytest.mark.parametrize("path", [("pack",), ("verify",), ("plan",), ("doctor",), ("tiny",), ("sim",)])
def test_user_commands_have_their_own_description(path):
    parser = dict(COMMANDS)[("tiermoe",) + path]
    assert len(parser.description) > 100  # more than the one-line help repeated


def _run(*argv):
    return subprocess.run([sys.executable, "-m", "tiermoe.cli", *argv], capture_output=True, text=True, timeout=120)


def test_tiermoe_alone_prints_the_help_and_exits_0():
    r = _run()
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: tiermoe") and "serve" in r.stdout and "pack" in r.stdout
    assert r.stderr == ""


@pytest.mark.parametrize("argv,usage", [
    (("pack",), "usage: tiermoe pack [options] src out"),
    (("serve", "--port", "x"), "usage: tiermoe serve [options] [MODEL]"),
    (("no-such-command",), "usage: tiermoe [options] COMMAND ..."),
    (("plan", "st", "--quant", "int2"), "usage: tiermoe plan [options] model"),
])
def test_usage_errors_are_two_lines_and_exit_2(argv, usage):
    r = _run(*argv)
    assert r.returncode == 2
    lines = r.stderr.splitlines()
    assert len(lines) == 2, r.stderr
    assert lines[0] == usage
    assert lines[1].startswith(f"tiermoe {argv[0]}: error: " if argv[0] != "no-such-command" else "tiermoe: error:")
    assert lines[1].endswith("--help`)")
