"""`tiermoe bench` and `tiermoe eval` numbers and paths without meaning: refused with exit code 2 and one
line naming the flag, an --out that cannot be written before the measurement is taken, never a traceback."""

from __future__ import annotations

import pytest

from testkit.cli import refused as _refused

DECODE = ["bench", "decode", "--device", "cpu"]


@pytest.mark.parametrize("flags, word", [(["--tokens", "0"], "--tokens"), (["--tokens=-1"], "--tokens"),
                                         (["--batch-sizes", "0"], "--batch-sizes"),
                                         (["--batch-sizes=-1"], "--batch-sizes"),
                                         (["--prompt-len", "0"], "--prompt-len"),
                                         (["--prompt-len", "100000"], "--prompt-len")])
def test_bench_decode_numbers(tiny_dir, capsys, flags, word):
    """These once ended in an InvalidRequest or TypeError traceback, or 0 tok/s measured over nothing."""
    _refused(capsys, [*DECODE, "--model", str(tiny_dir("qwen3_moe")), "--tokens", "2", *flags], word)


def test_bench_decode_out_refused_before_measuring(tmp_path, capsys, monkeypatch):
    """A directory or a path under a file as --out once failed with a traceback after the run."""
    import tiermoe.engine.build as build

    def no_build(*a, **k):
        raise AssertionError("measured before checking --out")

    monkeypatch.setattr(build, "build_engine_core", no_build)
    tiny = ["--tiny", "qwen3_moe"]
    _refused(capsys, [*DECODE, *tiny, "--out", str(tmp_path)], "Is a directory")
    (tmp_path / "f").write_text("keep")
    _refused(capsys, [*DECODE, *tiny, "--out", str(tmp_path / "f" / "x.json")], "Not a directory")
    assert (tmp_path / "f").read_text() == "keep"


@pytest.mark.parametrize("which", ["missing", "file", "empty", "no_config", "packed"])
def test_eval_parity_reference_not_a_checkpoint(tiny_dir, tmp_path, capsys, which):
    """transformers' OSError/ValueError once came as a traceback; a packed store loaded with random experts."""
    model = tiny_dir("qwen3_moe")
    (tmp_path / "f").write_text("x")
    if which == "packed":
        from tiermoe.cli import main

        assert main(["pack", str(model), str(tmp_path / "store")]) == 0
    ref = {"missing": str(tmp_path / "nope"), "file": str(tmp_path / "f"), "empty": "", "no_config": str(tmp_path),
           "packed": str(tmp_path / "store")}[which]
    _refused(capsys, ["eval", "parity", "--model", str(model), "--device", "cpu", "--reference", ref], "--reference")


@pytest.mark.parametrize("flag", ["--gpu-fractions=-0.5", "--gpu-fractions=1,nan", "--host-fractions=-1",
                                  "--host-fractions=inf"])
def test_eval_tiers_fraction_not_a_share(tiny_dir, tmp_path, capsys, flag):
    """Once refused as --gpu-expert-gb / --host-expert-gb, flags `eval tiers` does not have."""
    from tiermoe.cli import main

    assert main(["pack", str(tiny_dir("qwen3_moe")), str(tmp_path / "store")]) == 0
    _refused(capsys, ["eval", "tiers", "--model", str(tmp_path / "store"), "--device", "cpu", flag],
             flag.split("=")[0])


def test_http_benches_refuse_an_unwritable_out_before_running(capsys, tmp_path):
    """`bench sweep` (as stream-rate, gates and panel) checks --out before it sends a request: the URL
    here answers nothing, so a check made only after the run would report the connection instead."""
    _refused(capsys, ["bench", "sweep", "--url", "http://127.0.0.1:9", "--out", str(tmp_path)], "cannot write",
            str(tmp_path))
