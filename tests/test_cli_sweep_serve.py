"""`tiermoe serve` flags without meaning: refused with exit code 2 and one line naming the flag, before the
model loads and before the port is bound (a refusal after binding would leave a test, or a user, waiting on a
server that never should have started)."""

from __future__ import annotations

import pytest

from testkit.cli import refused as _refused
import tiermoe.server.cli as serve_cli


@pytest.fixture
def no_bind(monkeypatch):
    """Binding the port fails the test instead of starting a server: every refusal must come first."""
    def reached(host, port):
        raise AssertionError(f"serve got as far as binding {host}:{port}")

    monkeypatch.setattr(serve_cli, "_check_port", reached)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_serve_kv_cache_gb_not_finite(no_bind, capsys, value):
    _refused(capsys, ["serve", "--scripted", f"--kv-cache-gb={value}"], "--kv-cache-gb")
