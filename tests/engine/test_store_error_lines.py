"""Store faults reach a user of `tiermoe generate` as one line, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tiermoe.store.pack import pack
from tiermoe.store.records import load_manifest


@pytest.fixture(scope="module")
def store(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("st") / "st"
    pack(tiny_dir("qwen3_moe"), out, progress=False, log=lambda _: None)
    return out


def _generate(model, *flags):
    return subprocess.run([sys.executable, "-m", "tiermoe.cli", "generate", "--model", str(model), "--device", "cpu",
                           "--prompt", "hi", "--max-tokens", "3", *flags], capture_output=True, text=True, timeout=300)


def test_corrupt_record_read_at_run_time(store, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in store.iterdir():
        if f.name != "store.lock":
            (bad / f.name).write_bytes(f.read_bytes())
    m = load_manifest(bad)
    with open(m.experts_path, "r+b") as f:
        for r in m.records:  # every record: whichever the first token routes to is damaged
            f.seek(r.offset + 5)
            b = f.read(1)
            f.seek(r.offset + 5)
            f.write(bytes([b[0] ^ 0x20]))
    for flags in (("--host-expert-gb", "0"), ("--host-expert-gb", "0", "--mode", "fast"), ()):
        r = _generate(bad, *flags)  # read when a token needs it; by the CPU lane; at start-up (preload)
        assert r.returncode == 2, (flags, r.stderr)
        assert "Traceback" not in r.stderr and len(r.stderr.splitlines()) <= 2, (flags, r.stderr)
        assert r.stderr.splitlines()[-1].startswith("tiermoe: error: ") and "checksum mismatch" in r.stderr
        assert f"tiermoe verify {bad}" in r.stderr



def test_store_without_its_manifest(store, tmp_path):
    half = tmp_path / "half"
    half.mkdir()
    for f in store.iterdir():
        if f.name not in ("store.lock", "manifest.json"):
            (half / f.name).write_bytes(f.read_bytes())
    r = _generate(half)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"tiermoe: error: {half}: packed expert store without its manifest.json (its pack did not finish, or the "
        "file was removed); run the same `tiermoe pack` command again to finish it"]
