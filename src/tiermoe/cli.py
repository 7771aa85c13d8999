"""`tiermoe` command line.

Subsystems contribute subcommands through a `register(subparsers)` function in their own
`cli` module, so this file stays a thin dispatcher. Every handler returns an exit code;
`UserError` becomes one line on stderr and exit code 2 (never a traceback).

The parser class used for every command (`_Parser`) keeps help and errors uniform: every
flag's help ends with its default where it has one and does not say it already; a command
registered with only a one-line `help` gets it as its description too; a usage error prints
one short usage line and one error line (exit 2) instead of the whole usage block. `tiermoe`
with no command prints the help and exits 0, as `vllm` does (git exits 1).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tiermoe.errors import UserError

# Modules that add subcommands; each exposes register(subparsers).
_SUBCOMMAND_MODULES = (
    "tiermoe.models.cli",  # tiny
    "tiermoe.engine.cli",  # generate
    "tiermoe.eval.cli",  # eval parity, eval paired-kl
    "tiermoe.bench.cli",  # bench decode | sweep | stream-rate | gates | panel | floor | report
    "tiermoe.store.cli",  # pack, verify, plan, sim
    "tiermoe.server.cli",  # serve
    "tiermoe.doctor",  # doctor
    "tiermoe.importers.cli",  # import-gguf
)


def _with_default(action: argparse.Action, text: str) -> str:
    """`text` plus "(default: X)" where the flag has a default worth showing and the help does not
    already name one (flags that are off unless given, and None "decided later", are left alone)."""
    default = action.default
    if (not action.option_strings or "default" in text.lower() or default in (None, False, argparse.SUPPRESS)
            or isinstance(action, (argparse._StoreConstAction, argparse.BooleanOptionalAction))):
        return text
    return f"{text} (default: %(default)s)"


class _Formatter(argparse.HelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        return _with_default(action, action.help or "")


class _RawFormatter(argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        return _with_default(action, action.help or "")


class _Commands(argparse._SubParsersAction):
    """Subcommands whose description defaults to their one-line help (see the module doc)."""

    def add_parser(self, name: str, **kwargs):
        if kwargs.get("help") and not kwargs.get("description"):
            text = kwargs["help"]
            kwargs["description"] = text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")
        return super().add_parser(name, **kwargs)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kind = kwargs.get("formatter_class", argparse.HelpFormatter)
        kwargs["formatter_class"] = _RawFormatter if issubclass(kind, argparse.RawDescriptionHelpFormatter) \
            else _Formatter
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _Commands)

    def short_usage(self) -> str:
        """`usage: PROG [options] POSITIONALS`: the full usage block of a command with 30 flags
        buries the one line that says what went wrong."""
        words = []
        for action in self._actions:  # argparse has no public list of a parser's arguments
            if action.option_strings or action.help == argparse.SUPPRESS:
                continue
            name = action.metavar or action.dest
            words.append(f"{name} ..." if action.nargs == argparse.PARSER else
                         f"[{name}]" if action.nargs in ("?", "*") else name)
        return " ".join([f"usage: {self.prog} [options]", *words])

    def error(self, message: str) -> None:  # two lines, exit 2
        print(self.short_usage(), file=sys.stderr)
        print(f"{self.prog}: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tiermoe", description="Serve Mixture-of-Experts models far larger than the GPU "
                     "from tiered expert storage (GPU slots, host RAM, disk). `tiermoe COMMAND --help` "
                     "explains each command.")
    parser.add_argument("--version", action="version", version=_version(), help="print the version and exit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in _SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and (exc.name == name or name.startswith(exc.name + ".")):
                continue  # subsystem not present in this build
            raise
        module.register(subparsers)
    return parser


def _version() -> str:
    from tiermoe import __version__

    return f"tiermoe {__version__}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # `tiermoe` alone: the help, as `vllm` alone prints it
        parser.print_help()
        return 0
    try:
        return int(args.handler(args) or 0)
    except UserError as exc:
        print(f"tiermoe: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
