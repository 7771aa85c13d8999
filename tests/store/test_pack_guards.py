"""What `tiermoe pack` refuses and picks by itself: group sizes, foreign and in-use directories."""

import os
import subprocess
import sys
import textwrap

import pytest

from store_fixtures import make_checkpoint
from tiermoe.cli import main
from tiermoe.errors import UserError
from tiermoe.store.facade import ExpertStore
from tiermoe.store.lock import LOCK_NAME
from tiermoe.store.pack import pack
from tiermoe.store.pack_checks import choose_group_size, working_group_sizes
from tiermoe.store.records import load_manifest

QUIET = dict(progress=False, log=lambda s: None)


def test_group_sizes_that_divide_the_shapes():
    assert working_group_sizes(576, 128) == [64, 32, 16]  # SmolLM2 imported with 8 experts
    assert choose_group_size(576, 128, None) == 64
    assert choose_group_size(4096, 1536, None) == 128  # the preferred size where it divides
    assert choose_group_size(4096, 1536, 256) == 256
    assert working_group_sizes(36, 12) == [12, 6, 4, 2]  # no power of two from 16: even common divisors
    with pytest.raises(UserError, match="--group-size 128 does not divide hidden_size 576 .* these would: 64, 32, 16"):
        choose_group_size(576, 128, 128)
    with pytest.raises(UserError, match="use --quant bf16"):
        choose_group_size(63, 21, None)
    # int3 prefers 64 (pack_checks.PREFERRED_GROUP_SIZE) and needs shapes that are multiples of 8
    assert choose_group_size(4096, 2048, None, "int3") == 64
    assert choose_group_size(4096, 2048, None, "int4") == choose_group_size(4096, 2048, None, "int8") == 128
    assert choose_group_size(4096, 2048, 128, "int3") == 128
    assert choose_group_size(96, 48, None, "int3") == 16
    with pytest.raises(UserError, match="int3 needs hidden_size 36 and expert intermediate size 12 to be multiples"):
        choose_group_size(36, 12, None, "int3")


def test_int3_default_group_size_earns_its_bytes():
    """Why int3 picks 64 where int4 picks 128 (pack_checks.PREFERRED_GROUP_SIZE): with eight levels,
    halving the group cuts the weight error clearly (more on heavy tails) for 4 % more bytes."""
    import torch

    from tiermoe.store.quant import dequantize_groupwise, quantize_groupwise
    from tiermoe.store.records import RecordLayout

    def rel(w, g):
        q, s = quantize_groupwise(w, 3, g)
        return ((dequantize_groupwise(q, s, 3, g, torch.float32) - w).norm() / w.norm()).item()

    gen = torch.Generator().manual_seed(0)
    normal = torch.randn(256, 1024, generator=gen)  # [256, 1024]
    chi2 = torch.randn(3, 256, 1024, generator=gen).square().mean(0)  # [256, 1024] chi-square(3) / 3
    student3 = torch.randn(256, 1024, generator=gen) / chi2.sqrt()  # Student-t, 3 degrees of freedom
    ratios = [rel(w, 64) / rel(w, 128) for w in (normal, student3)]
    print("int3 error G64 / G128: normal %.3f, Student-t(3) %.3f" % tuple(ratios))  # 0.947, 0.866
    assert ratios[0] < 0.97 and ratios[1] < 0.9
    bigger = RecordLayout.build("int3", 4096, 2048, 64).length / RecordLayout.build("int3", 4096, 2048, 128).length
    assert bigger == pytest.approx(1.04, abs=0.001)


def test_pack_picks_a_group_size_when_none_is_given(tmp_path, capsys):
    make_checkpoint(tmp_path / "src", hidden=96, inter=48)  # 128, 64 and 32 do not divide 48 and 96
    assert main(["pack", str(tmp_path / "src"), str(tmp_path / "st"), "--quant", "int4", "--quiet"]) == 0
    assert "(int4, group size 16)" in capsys.readouterr().out
    m = load_manifest(tmp_path / "st")
    assert m.layout.group_size == 16 and m.data["quantization"]["group_size"] == 16


def test_pack_int3_refuses_shapes_before_reading(tmp_path, capsys):
    """int3 rows are bit planes of whole bytes: a hidden size that is not a multiple of 8 is refused
    from config.json alone, in one line (exit 2)."""
    make_checkpoint(tmp_path / "src", hidden=36, inter=12, experts=2)
    assert main(["pack", str(tmp_path / "src"), str(tmp_path / "st"), "--quant", "int3", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--quant int3 needs hidden_size 36" in err and "Traceback" not in err and len(err.splitlines()) == 1
    assert not (tmp_path / "st").exists()


def test_wrong_group_size_is_one_line_before_torch_is_imported(tmp_path):
    """The CLI reads config.json and refuses a group size that does not divide it before any slow
    import (on a GGUF file, before the import of the whole file)."""
    make_checkpoint(tmp_path / "src", hidden=96, inter=48)
    code = textwrap.dedent(f"""
        import sys
        from tiermoe.cli import main
        rc = main(["pack", {str(tmp_path / "src")!r}, {str(tmp_path / "st")!r}, "--quant", "int4",
                   "--group-size", "128"])
        print(rc, "torch" in sys.modules)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["2", "False"], r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        "tiermoe: error: --group-size 128 does not divide hidden_size 96 and expert intermediate size 48; these "
        "would: 16 (or leave --group-size out to pick one)"]
    assert not (tmp_path / "st").exists()


def test_pack_refuses_a_non_empty_foreign_directory(tmp_path, capsys):
    make_checkpoint(tmp_path / "src")
    out = tmp_path / "home"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["pack", str(tmp_path / "src"), str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "not empty and holds no earlier pack" in err and err.count("\n") == 1
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # nothing written, not even a lock file
    with pytest.raises(UserError, match="not empty"):
        pack(tmp_path / "src", out, **QUIET)
    # a file as OUT
    assert main(["pack", str(tmp_path / "src"), str(out / "notes.txt"), "--quiet"]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_pack_resumes_only_its_own_unfinished_pack(tmp_path):
    make_checkpoint(tmp_path / "src")
    make_checkpoint(tmp_path / "other", seed=1)
    pack(tmp_path / "src", tmp_path / "st", **QUIET)
    (tmp_path / "st" / "manifest.json").unlink()  # as if interrupted before the end
    res = pack(tmp_path / "src", tmp_path / "st", **QUIET)
    assert res.written == 0 and res.records == 16
    with pytest.raises(UserError, match="another source or other settings"):
        pack(tmp_path / "other", tmp_path / "st", **QUIET)
    with pytest.raises(UserError, match="another source or other settings"):
        pack(tmp_path / "src", tmp_path / "st", quant="fp32", **QUIET)
    assert (tmp_path / "st" / "manifest.json").is_file()  # the refused runs left the store as it was


def test_pack_refuses_a_store_a_process_is_reading(tmp_path, capsys):
    """A process holding the store open (a server, generate) holds store.lock shared; pack into it
    fails with one line naming that process, and the store's bytes stay as they were."""
    make_checkpoint(tmp_path / "src")
    st = tmp_path / "st"
    pack(tmp_path / "src", st, **QUIET)
    before = (st / "experts.bin").read_bytes()
    reader = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from tiermoe.store.facade import ExpertStore
            store = ExpertStore.open({str(st)!r}, host_expert_gb=0, reader_threads=1)
            print("open", flush=True)
            sys.stdin.read()
            store.close()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "open"
        assert main(["pack", str(tmp_path / "src"), str(st), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert f"the store is in use (held by pid {reader.pid})" in err and err.count("\n") == 1
        with pytest.raises(UserError, match=f"held by pid {reader.pid}"):
            pack(tmp_path / "src", st, **QUIET)  # the library call, past the CLI's early check
    finally:
        reader.communicate("", timeout=60)
    assert (st / "experts.bin").read_bytes() == before and (st / "manifest.json").is_file()
    assert pack(tmp_path / "src", st, **QUIET).written == 0  # free again once the reader is gone


def test_an_open_store_holds_its_lock_until_closed(tmp_path):
    make_checkpoint(tmp_path / "src")
    pack(tmp_path / "src", tmp_path / "st", **QUIET)
    assert (tmp_path / "st" / LOCK_NAME).is_file()
    with ExpertStore.open(tmp_path / "st", host_expert_gb=0, reader_threads=1):
        with pytest.raises(UserError, match=f"in use \\(held by pid {os.getpid()}\\)"):
            pack(tmp_path / "src", tmp_path / "st", **QUIET)
    pack(tmp_path / "src", tmp_path / "st", **QUIET)


def test_a_filesystem_without_flock_is_said_not_fatal(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    make_checkpoint(tmp_path / "src")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    said = []
    pack(tmp_path / "src", tmp_path / "st", progress=False, log=said.append)
    assert any("cannot be locked here (No locks available)" in s for s in said), said
    with ExpertStore.open(tmp_path / "st", host_expert_gb=0, reader_threads=1) as st:  # served without the lock
        assert st.fetch(0, [1])
