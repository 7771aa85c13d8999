"""Output files whose parent is a file: refused with exit code 2 and one line naming the path,
never the cleanup's own NotADirectoryError."""

from __future__ import annotations

from tiermoe.cli import main


def test_record_routing_under_a_file(tiny_dir, tmp_path, capsys):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    target = blocker / "trace.npz"
    capsys.readouterr()
    assert main(["generate", "--model", str(tiny_dir("qwen3_moe")), "--device", "cpu", "--prompt", "hi",
                 "--max-tokens", "1", "--record-routing", str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("tiermoe: error:") and str(target) in err[-1], err
    assert "Traceback" not in "\n".join(err)
