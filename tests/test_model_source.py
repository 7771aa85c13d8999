"""MODEL names -> local directories (model_source.py), without a network: Hub repo ids from a fake
cache layout read by the real huggingface_hub code (offline mode), its error paths from a stub Hub
server, and the one-line errors for names that are none of the accepted forms."""

from __future__ import annotations

import pytest
from testkit.fake_hub import StubHub, cache_repo

from tiermoe.errors import UserError
from tiermoe.model_source import check_name, is_repo_id, resolve_model

COMMIT_V1 = "1111111111111111111111111111111111111111"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty Hub cache that huggingface_hub uses for this test, offline unless a test says not."""
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A stand-in checkpoint: resolution only looks for config.json (loading is tested elsewhere)."""
    d = tmp_path_factory.mktemp("ckpt")
    (d / "config.json").write_text('{"model_type": "qwen3_moe"}')
    (d / "model.safetensors").write_bytes(b"")
    return d


def test_repo_id_resolves_to_the_cached_snapshot_offline(hub, checkpoint):
    snapshot = cache_repo(hub, "acme/tiny-moe", checkpoint)
    assert resolve_model("acme/tiny-moe", progress=_no_progress) == snapshot


def test_revision_picks_a_tag_or_a_commit(hub, checkpoint):
    main = cache_repo(hub, "acme/tiny-moe", checkpoint)
    v1 = cache_repo(hub, "acme/tiny-moe", checkpoint, revision="v1", commit=COMMIT_V1)
    assert resolve_model("acme/tiny-moe", revision="v1", progress=_no_progress) == v1
    assert resolve_model("acme/tiny-moe", revision=COMMIT_V1, progress=_no_progress) == v1
    assert resolve_model("acme/tiny-moe", progress=_no_progress) == main


def test_offline_and_not_cached_is_one_line_naming_the_repo(hub):
    with pytest.raises(UserError) as err:
        resolve_model("acme/absent", progress=_no_progress)
    msg = str(err.value)
    assert "acme/absent" in msg and "HF_HUB_OFFLINE=1" in msg and "\n" not in msg


def test_offline_unknown_revision_is_one_line(hub, checkpoint):
    cache_repo(hub, "acme/tiny-moe", checkpoint)
    with pytest.raises(UserError, match=r"acme/tiny-moe \(revision v9\) is not in the Hugging Face cache"):
        resolve_model("acme/tiny-moe", revision="v9", progress=_no_progress)


@pytest.mark.parametrize("code,match", [
    ("RepoNotFound", "acme/absent: no such model on the Hugging Face Hub"),
    ("RevisionNotFound", "--revision v9: no such branch, tag or commit in acme/absent"),
    ("GatedRepo", "acme/absent: a gated repository"),
])
def test_hub_refusals_are_one_line_errors(hub, monkeypatch, code, match):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with StubHub(404 if code != "GatedRepo" else 403, code) as stub:
        monkeypatch.setattr(constants, "ENDPOINT", stub.url)
        with pytest.raises(UserError, match=match) as err:
            resolve_model("acme/absent", revision="v9" if code == "RevisionNotFound" else None,
                          progress=_no_progress)
    assert "\n" not in str(err.value)


def test_repository_without_config_is_refused(hub, tmp_path):
    only_gguf = tmp_path / "gguf-only"
    only_gguf.mkdir()
    (only_gguf / "README.md").write_text("weights elsewhere")
    cache_repo(hub, "acme/model-GGUF", only_gguf)
    with pytest.raises(UserError, match="acme/model-GGUF: the repository has no config.json"):
        resolve_model("acme/model-GGUF", progress=_no_progress)


def test_local_path_wins_over_a_repo_id_of_the_same_spelling(tmp_path, monkeypatch, checkpoint):
    local = tmp_path / "acme" / "tiny-moe"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("acme/tiny-moe") == local.relative_to(tmp_path)


@pytest.mark.parametrize("name,match", [
    ("nope", "model path nope does not exist \\(nor a Hugging Face repo id of the form org/model\\)"),
    ("./acme/absent", "model path ./acme/absent does not exist$"),
    ("a/b/c", "model path a/b/c does not exist"),
    ("acme/model.gguf", "model path acme/model.gguf does not exist$"),
    ("acme--x/y", "does not exist"),
])
def test_names_that_are_no_path_and_no_repo_id(tmp_path, monkeypatch, name, match):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=match):
        check_name(name)
    with pytest.raises(UserError, match=match):
        resolve_model(name)


def test_repo_id_form():
    assert is_repo_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert is_repo_id("Qwen/Qwen3-30B-A3B")
    for bad in ("gpt2", "a/b/c", "/abs/path", "org/", "-org/x", "org/x..y", "o" * 60 + "/" + "m" * 40):
        assert not is_repo_id(bad), bad


def test_a_file_that_is_not_gguf_is_one_line(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("not really")
    with pytest.raises(UserError, match="model.gguf: not a GGUF file"):
        resolve_model(str(fake))


def test_revision_needs_a_repo_id(tmp_path):
    with pytest.raises(UserError, match="--revision applies to a Hugging Face repo id"):
        resolve_model(str(tmp_path), revision="v1")
    with pytest.raises(UserError, match="--revision needs MODEL to be a Hugging Face repo id"):
        resolve_model(None, revision="v1")


def test_packed_store_missing_a_half_is_named(tmp_path):
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(UserError, match="packed expert store without its experts.bin"):
        resolve_model(str(tmp_path))


def _no_progress(_msg: str) -> None:
    pass
