"""Shared fixtures: tiny random checkpoints and the converted default model, made once per test session."""

from __future__ import annotations

import os
from unittest import mock

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


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory):
    """The embedded default model converted once per session into a private cache directory
    (`default_model_dir.parent.parent` is that cache: TIERMOE_CACHE_DIR for a `tiermoe serve` that
    should find it). Shared by the importer tests and the web page's browser test, because the
    conversion takes tens of seconds on a small CPU machine."""
    from tiermoe.default_model import ensure_default_model

    cache = tmp_path_factory.mktemp("tiermoe-cache")
    with mock.patch.dict(os.environ, {"TIERMOE_CACHE_DIR": str(cache)}):
        return ensure_default_model(progress=lambda _msg: None)
