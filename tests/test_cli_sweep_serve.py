"""`tiermoe serve` flags without meaning: refused with exit code 2 and one line naming the flag, before the
model loads and before the port is bound (a refusal after binding would leave a test, or a user, waiting on a
server that never should have started)."""

from __future__ import annotations

import pytest

from testkit.cli import refused as _refused
import tiermoe.server.cli as serve_cli
from tiermoe.cli import main


@pytest.fixture
def no_bind(monkeypatch):
    """Binding the port fails the test instead of starting a server: every refusal must come first."""
    def reached(host, port):
        raise AssertionError(f"serve got as far as binding {host}:{port}")

    monkeypatch.setattr(serve_cli, "_check_port", reached)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_serve_kv_cache_gb_not_finite(no_bind, capsys, value):
    _refused(capsys, ["serve", "--scripted", f"--kv-cache-gb={value}"], "--kv-cache-gb")


@pytest.mark.parametrize("flags", [["--max-num-seqs", "0"], ["--max-num-seqs=-3"], ["--max-num-batched-tokens", "0"],
                                   ["--kv-cache-gb", "0"]])
def test_generate_sizing_zero_refused_as_serve_and_plan_do(tiny_dir, capsys, flags):
    """generate decodes one prompt, so it once clamped these (or read 0 as "the default") in silence."""
    _refused(capsys, ["generate", "--model", str(tiny_dir("qwen3_moe")), "--device", "cpu", "--prompt", "hi",
                      "--max-tokens", "1", *flags], flags[0].split("=")[0])


def test_bench_decode_max_num_seqs_zero(capsys):
    _refused(capsys, ["bench", "decode", "--tiny", "qwen3_moe", "--device", "cpu", "--tokens", "1",
                      "--max-num-seqs", "0"], "--max-num-seqs")


@pytest.mark.parametrize("value", ["0", "-1"])
def test_serve_max_num_seqs_zero(no_bind, capsys, value):
    _refused(capsys, ["serve", "--scripted", f"--max-num-seqs={value}"], "--max-num-seqs")


@pytest.mark.parametrize("flag", ["--drain-timeout=nan", "--drain-timeout=inf", "--drain-timeout=-1",
                                  "--max-body-mb=inf"])
def test_serve_number_without_a_count(no_bind, capsys, flag):
    """These once reached int() after the model loaded: a ValueError or OverflowError traceback."""
    _refused(capsys, ["serve", "--scripted", flag], flag.split("=")[0])


@pytest.mark.parametrize("flag", ["--header-timeout=inf", "--request-timeout=inf", "--drain-timeout=0"])
def test_serve_timeout_without_limit_is_taken(monkeypatch, capsys, flag):
    """inf: no limit (asyncio takes it); --drain-timeout 0: running requests are not waited for."""
    def stop(host, port):
        raise SystemExit("checked")

    monkeypatch.setattr(serve_cli, "_check_port", stop)
    with pytest.raises(SystemExit, match="checked"):
        main(["serve", "--scripted", flag])


@pytest.mark.parametrize("flag", ["--api-key", "--host", "--generation-config", "--served-model-name"])
def test_serve_empty_text(no_bind, capsys, flag):
    """An empty --api-key once served with no key at all; the others changed meaning or failed unclearly."""
    _refused(capsys, ["serve", "--scripted", f"{flag}=", "--log-level", "error"], flag, "empty")
