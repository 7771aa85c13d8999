"""The CLI's refusal of bad input, as the tests check it: exit code 2 and one `tiermoe: error:` line."""

from __future__ import annotations

from tiermoe.cli import main


def refused(capsys, argv: list[str], *words: str) -> str:
    """Run argv in-process; assert exit code 2 and one error line that holds every word; return it."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tiermoe: error:"), err
    assert all(w in err[0] for w in words), err[0]
    return err[0]
