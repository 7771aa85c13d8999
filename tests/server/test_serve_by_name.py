"""`tiermoe serve org/model` as a user runs it, without a network: the repo comes from a Hugging
Face cache laid out as huggingface_hub leaves it (HF_HOME, HF_HUB_OFFLINE=1), is served under
its repo id and answers the official client; wrong names end in one line and exit code 2."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest
from testkit.cli_server import CliServer
from testkit.fake_hub import StubHub, cache_repo

REPO = "acme/tiny-moe"


def _run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "tiermoe.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def _one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit code 2, the error in one line, before it at most the progress line of a fetch."""
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("tiermoe: error: ") and "Traceback" not in proc.stderr, proc.stderr
    assert all(line.startswith("tiermoe: fetching ") for line in lines[:-1]), proc.stderr
    assert all(n in lines[-1] for n in needles), lines[-1]


@pytest.fixture
def hf_home(tmp_path):
    return {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "TIERMOE_CACHE_DIR": str(tmp_path / "tiermoe")}


@pytest.mark.slow
def test_serve_a_cached_repo_id_offline(tiny_dir, tmp_path, hf_home):
    cache_repo(tmp_path / "hf" / "hub", REPO, tiny_dir("qwen3_moe"))
    with CliServer([REPO, "--device", "cpu", "--max-model-len", "256", "--log-level", "warning"], hf_home) as server:
        assert server.returncode is None, server.stderr
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [REPO]
        r = client.chat.completions.create(model=REPO, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4


def test_uncached_repo_offline_is_one_line(hf_home):
    _one_line_error(_run_cli(["serve", "acme/absent", "--port", "1"], hf_home),
                    "acme/absent", "not in the Hugging Face cache", "HF_HUB_OFFLINE=1")


def test_missing_repo_on_the_hub_is_one_line(hf_home):
    with StubHub(404, "RepoNotFound") as hub:
        env = {**hf_home, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.url}
        _one_line_error(_run_cli(["serve", "acme/absent", "--port", "1"], env),
                        "acme/absent: no such model on the Hugging Face Hub")


@pytest.mark.parametrize("name,needle", [
    ("no-such-model", "model path no-such-model does not exist (nor a Hugging Face repo id"),
    ("./x/model.gguf", "model path ./x/model.gguf does not exist"),
])
def test_names_that_are_neither_path_nor_repo_are_one_line(hf_home, name, needle):
    _one_line_error(_run_cli(["serve", name], hf_home), needle)


def test_a_gguf_name_that_is_no_gguf_is_one_line(hf_home, tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("{}")
    _one_line_error(_run_cli(["serve", str(fake), "--port", "1"], hf_home), "model.gguf: not a GGUF file")
