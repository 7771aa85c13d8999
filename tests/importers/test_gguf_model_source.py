"""A .gguf file named as MODEL: imported once into tiermoe's cache (with progress lines), reused
afterwards, imported again when the file changes, and served or run by every command that takes
a model (`generate` in process, `serve` as a user starts it). The sampling a GGUF recommends
(`general.sampling.*`) and the embedded default model's (its model card's) become the server's
defaults through generation_config.json."""

from __future__ import annotations

import os

import openai
import pytest
from gguf_fixtures import write_gguf
from testkit.cli_server import CliServer

from tiermoe.model_source import resolve_model
from tiermoe.models.tiny_tokenizer import build_tokenizer
from tiermoe.server.sampling_defaults import SamplingDefaults, load_sampling_defaults


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "Tiny-Chat.Q8.gguf"
    write_gguf(path, "llama", tokenizer=build_tokenizer())
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERMOE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_imported_once_then_reused_and_again_when_changed(gguf_file, cache, tmp_path):
    said: list[str] = []
    first = resolve_model(str(gguf_file), progress=said.append)
    assert first.parent == cache / "models" and first.name.startswith("gguf-tiny-chat.q8-")
    assert (first / "config.json").is_file() and (first / "tokenizer.json").is_file()
    assert said == [f"converting GGUF file {gguf_file.name} into {first} (once)", f"{gguf_file.name} imported"]
    said.clear()
    assert resolve_model(str(gguf_file), progress=said.append) == first and said == []
    copy = tmp_path / gguf_file.name
    copy.write_bytes(gguf_file.read_bytes())
    other = resolve_model(str(copy), progress=said.append)
    assert other != first and len(said) == 2  # another file (path, size, mtime): its own import


def test_generate_runs_a_gguf_file(gguf_file, cache, capsys):
    from tiermoe.cli import main

    rc = main(["generate", "--model", str(gguf_file), "--prompt", "hi", "--max-tokens", "3", "--device", "cpu"])
    assert rc == 0 and capsys.readouterr().out.endswith("\n")
    assert [d.name.startswith("gguf-tiny-chat.q8-") for d in (cache / "models").iterdir() if d.is_dir()] == [True]


@pytest.mark.slow
def test_serve_a_gguf_file_by_its_path(gguf_file, tmp_path):
    env = {"TIERMOE_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    args = [str(gguf_file), "--device", "cpu", "--max-model-len", "256", "--log-level", "warning"]
    with CliServer(args, env) as server:
        assert server.returncode is None, server.stderr
        assert f"converting GGUF file {gguf_file.name}" in server.stderr
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [gguf_file.name]
        r = client.chat.completions.create(model=gguf_file.name, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4
    assert os.listdir(tmp_path / "cache" / "models")  # the import stays for the next start


def test_a_ggufs_recommended_sampling_becomes_the_default(cache, tmp_path):
    plain = tmp_path / "plain.gguf"
    write_gguf(plain, "qwen3", tokenizer=build_tokenizer())
    assert load_sampling_defaults("auto", resolve_model(str(plain))) == \
        SamplingDefaults(source="neutral defaults: generation_config.json sets no sampling field")
    tuned = tmp_path / "tuned.gguf"
    write_gguf(tuned, "qwen3", tokenizer=build_tokenizer(), sampling={"temp": 0.6, "top_k": 20, "top_p": 0.95})
    d = load_sampling_defaults("auto", resolve_model(str(tuned)))
    assert (d.temperature, d.top_k, d.top_p, d.min_p) == (0.6, 20, 0.95, 0.0)


def test_the_default_model_samples_as_its_model_card(default_model_dir):
    d = load_sampling_defaults("auto", default_model_dir)
    assert (d.temperature, d.top_p) == (0.2, 0.9)
