"""Sampling defaults from the model's generation_config.json (`--generation-config`, as vLLM):
request fields left out take the file's values, given ones win, on every route; without the file
the neutral values (temperature 1.0, the OpenAI API's default) apply. Checked on the parsed
file, on `tiermoe serve`'s resolution, and through real HTTP requests with the official clients
against a tiny model, reading the SamplingParams the engine received."""

from __future__ import annotations

import argparse
import json
import shutil

import anthropic
import openai
import pytest

from tiermoe.errors import UserError
from tiermoe.server.cli import register, resolve
from tiermoe.server.sampling_defaults import SamplingDefaults, load_sampling_defaults

SAMPLE = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
          "eos_token_id": 2}
MSG = [{"role": "user", "content": "Tell me about the sea."}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def _with_config(tiny_dir, tmp_path_factory, name: str, gen: dict | None):
    """A copy of the tiny qwen3_moe checkpoint whose generation_config.json is `gen` (None: none)."""
    d = tmp_path_factory.mktemp(name)
    shutil.copytree(tiny_dir("qwen3_moe"), d, dirs_exist_ok=True)
    (d / "generation_config.json").unlink(missing_ok=True)
    if gen is not None:
        (d / "generation_config.json").write_text(json.dumps(gen))
    return d


# ---- the file -------------------------------------------------------------------------------------------
def test_auto_reads_the_sampling_fields(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(SAMPLE))
    d = load_sampling_defaults("auto", tmp_path)
    assert d.values() == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05}
    assert "temperature 0.7" in d.describe() and "generation_config.json" in d.describe()


def test_no_file_or_vllm_gives_the_neutral_values(tmp_path):
    neutral = SamplingDefaults().values()
    assert neutral["temperature"] == 1.0 and neutral["top_p"] == 1.0 and neutral["top_k"] == 0
    assert load_sampling_defaults("auto", tmp_path).values() == neutral
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))  # a GGUF import's file
    assert load_sampling_defaults("auto", tmp_path).values() == neutral
    (tmp_path / "generation_config.json").write_text(json.dumps(SAMPLE))
    assert load_sampling_defaults("vllm", tmp_path).values() == neutral


def test_a_folder_replaces_the_models_file(tmp_path):
    model, folder = tmp_path / "m", tmp_path / "g"
    model.mkdir()
    folder.mkdir()
    (model / "generation_config.json").write_text(json.dumps(SAMPLE))
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": -1}))
    d = load_sampling_defaults(str(folder), model)
    assert d.temperature == 0.0 and d.top_k == 0 and d.top_p == 1.0


@pytest.mark.parametrize("gen,match", [
    ({"temperature": -1}, "temperature -1 is out of range"),
    ({"top_p": 0}, "top_p 0 is out of range"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ([1, 2], "not a JSON object"),
])
def test_bad_values_fail_at_start_up_in_one_line(tmp_path, gen, match):
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    with pytest.raises(UserError, match=match) as err:
        load_sampling_defaults("auto", tmp_path)
    assert "--generation-config vllm" in str(err.value) and "\n" not in str(err.value)


def test_serve_resolution_reads_the_resolved_models_file(tiny_dir, tmp_path_factory):
    model = _with_config(tiny_dir, tmp_path_factory, "resolve", SAMPLE)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args, defaults = resolve(parser.parse_args(["serve", str(model)]))
    assert defaults.temperature == 0.7 and args.model == str(model) and args.revision is None
    _, defaults = resolve(parser.parse_args(["serve", str(model), "--generation-config", "vllm"]))
    assert defaults.temperature == 1.0


# ---- through the HTTP routes ------------------------------------------------------------------------------
def _server(model_dir, mode: str = "auto"):
    from server_harness import ServerThread
    from tiermoe.engine.async_engine import AsyncEngine
    from tiermoe.engine.build import build_engine_core
    from tiermoe.server.app import create_app

    core = build_engine_core(str(model_dir), device="cpu", dtype="float32", max_model_len=512, max_num_seqs=4)
    seen = []
    add = core.add_request

    def spy(request_id, prompt_ids, params):
        seen.append(params)
        return add(request_id, prompt_ids, params)

    core.add_request = spy
    app = create_app(AsyncEngine(core), served_model_name="tiny",
                     sampling_defaults=load_sampling_defaults(mode, model_dir))
    server = ServerThread(app)
    server.seen = seen
    return server


@pytest.fixture(scope="module")
def sampling_server(tiny_dir, tmp_path_factory):
    with _server(_with_config(tiny_dir, tmp_path_factory, "sampling", SAMPLE)) as server:
        yield server


@pytest.fixture(scope="module")
def greedy_server(tiny_dir, tmp_path_factory):
    with _server(_with_config(tiny_dir, tmp_path_factory, "greedy", {"temperature": 0.0})) as server:
        yield server


def _clients(server):
    return (openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60),
            anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60))


def _sampling(params) -> tuple:
    return params.temperature, params.top_p, params.top_k, params.repetition_penalty


def test_left_out_fields_follow_the_file_on_every_route(sampling_server):
    client, claude = _clients(sampling_server)
    seen = sampling_server.seen
    seen.clear()
    client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, extra_body=NO_THINKING)
    client.completions.create(model="tiny", prompt="The sea", max_tokens=4)
    client.responses.create(model="tiny", input="The sea", max_output_tokens=4)
    claude.messages.create(model="tiny", messages=MSG, max_tokens=4)
    assert [_sampling(p) for p in seen] == [(0.7, 0.8, 20, 1.05)] * 4


def test_given_fields_override_the_file_per_field(sampling_server):
    client, claude = _clients(sampling_server)
    seen = sampling_server.seen
    seen.clear()
    client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, temperature=0, extra_body=NO_THINKING)
    client.completions.create(model="tiny", prompt="The sea", max_tokens=4, temperature=0.3, top_p=0.5,
                              extra_body={"top_k": -1, "repetition_penalty": 1.0})
    client.responses.create(model="tiny", input="The sea", max_output_tokens=4, temperature=1.2)
    claude.messages.create(model="tiny", messages=MSG, max_tokens=4, extra_body={"temperature": 0.1, "top_k": 5})
    assert [_sampling(p) for p in seen] == [(0.0, 0.8, 20, 1.05), (0.3, 0.5, 0, 1.0), (1.2, 0.8, 20, 1.05),
                                            (0.1, 0.8, 5, 1.05)]


def test_n2_without_temperature_samples_on_a_sampling_model(sampling_server):
    client, _ = _clients(sampling_server)
    seen = sampling_server.seen
    seen.clear()
    texts = set()
    for _ in range(3):
        r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=16, n=2,
                                           extra_body={**NO_THINKING, "ignore_eos": True})
        texts.update(c.message.content for c in r.choices)
    assert all(p.temperature == 0.7 and p.seed is None for p in seen) and len(seen) == 6
    assert len(texts) > 1  # six samples of 16 tokens at 0.7: not all the same


def test_a_greedy_file_makes_left_out_temperature_greedy(greedy_server):
    client, _ = _clients(greedy_server)
    seen = greedy_server.seen
    seen.clear()
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=12, n=2,
                                       extra_body={**NO_THINKING, "ignore_eos": True})
    again = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=12, temperature=0,
                                           extra_body={**NO_THINKING, "ignore_eos": True})
    assert [p.temperature for p in seen] == [0.0, 0.0, 0.0]
    assert r.choices[0].message.content == r.choices[1].message.content == again.choices[0].message.content
