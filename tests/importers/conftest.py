"""Fixtures for the importer tests (helpers live in gguf_fixtures.py)."""

from __future__ import annotations

import os
from unittest import mock

import pytest


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory):
    """The embedded default model converted once per session into a private cache directory."""
    from tiermoe.default_model import ensure_default_model

    cache = tmp_path_factory.mktemp("tiermoe-cache")
    with mock.patch.dict(os.environ, {"TIERMOE_CACHE_DIR": str(cache)}):
        return ensure_default_model(progress=lambda _msg: None)
