"""`tiermoe` command line.

Subsystems contribute subcommands through a `register(subparsers)` function in their own
`cli` module, so this file stays a thin dispatcher. Every handler returns an exit code;
`UserError` becomes one line on stderr and exit code 2 (never a traceback).
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


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage too)
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tiermoe", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=_version())
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    subparsers.required = True
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
    try:
        return int(args.handler(args) or 0)
    except UserError as exc:
        print(f"tiermoe: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
