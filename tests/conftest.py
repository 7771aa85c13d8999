"""Shared fixtures: tiny random checkpoints, written once per test session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """tiny_dir(arch) -> path of a tiny fp32 checkpoint of that family (cached per session)."""
    from tiermoe.models.tiny import write_tiny

    made: dict[str, object] = {}

    def get(arch: str, dtype: str = "float32"):
        key = f"{arch}-{dtype}"
        if key not in made:
            made[key] = write_tiny(arch, tmp_path_factory.mktemp(key), dtype=dtype)
        return made[key]

    return get
