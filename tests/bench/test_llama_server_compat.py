"""The bench client against llama-server's dialects, over real HTTP: /tokenize with {"content"}
and logprobs in the chat shape, next to vLLM's / tiermoe's, with the same code for both."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tiermoe.bench import client as http
from tiermoe.bench.panel import PanelMakeConfig, make_panel, top_pairs
from tiermoe.bench.panel import completion_logprobs
from tiermoe.bench.results import write_json

from .conftest import load, run_bench
from .scripted_server import Behaviour, Vocab, build_app, serve, teacher_forced_oracle, tokenize

TEXT = "The quick brown fox jumps over the lazy dog"
WORDS = tokenize(TEXT)  # the scripted servers' tokens: whitespace-led words


async def _ask(url: str, text: str, special: bool = False) -> tuple[int | None, list[int] | None, list[dict]]:
    """count_tokens and token_ids of `text`, plus every /tokenize body the client sent."""
    sent: list[dict] = []

    async def record(req: httpx.Request) -> None:
        sent.append(json.loads(req.content))

    async with http.make_client(url) as c:
        c.event_hooks["request"] = [record]
        return await http.count_tokens(c, "m", text, special), await http.token_ids(c, "m", text, special), sent


def _strict_app() -> FastAPI:
    """A /tokenize that refuses fields it does not know (422), reading only vLLM's body."""
    app = FastAPI()

    @app.post("/tokenize")
    async def tok(req: Request):
        body = await req.json()
        if set(body) - {"model", "prompt", "add_special_tokens"}:
            return JSONResponse({"error": {"message": "extra fields not permitted"}}, status_code=422)
        return {"count": len(tokenize(body["prompt"])), "tokens": list(range(len(tokenize(body["prompt"]))))}

    return app


def _deaf_app() -> FastAPI:
    """Answers {"tokens": []} to everything, on /v1/tokenize only (a tokenizer that reads neither field)."""
    app = FastAPI()

    @app.post("/v1/tokenize")
    async def tok(req: Request):
        return {"tokens": []}

    return app


def test_tokenize_one_body_for_both_dialects():
    with serve(Behaviour(llama_server=True)) as llama, serve(Behaviour()) as ours:
        n_l, ids_l, sent_l = asyncio.run(_ask(llama, TEXT, special=True))
        n_o, ids_o, sent_o = asyncio.run(_ask(ours, TEXT, special=True))
    assert n_l == n_o == len(WORDS) == 9
    assert ids_l is not None and ids_o is not None and len(ids_l) == len(ids_o) == 9
    # one request per call, each carrying both dialects' fields
    assert len(sent_l) == len(sent_o) == 2
    for body in sent_l + sent_o:
        assert body["prompt"] == body["content"] == TEXT
        assert body["add_special_tokens"] is body["add_special"] is True and body["model"] == "m"


def test_tokenize_fallbacks():
    with serve(app=_strict_app()) as strict, serve(app=_deaf_app()) as deaf:
        n, ids, sent = asyncio.run(_ask(strict, TEXT))
        assert n == 9 and ids == list(range(9))
        # the combined body was refused, then vLLM's body alone was read
        assert [sorted(b) for b in sent[:2]] == [
            ["add_special", "add_special_tokens", "content", "model", "parse_special", "prompt"],
            ["add_special_tokens", "model", "prompt"],
        ]
        # an empty answer for non-empty text is "no tokenizer", not zero tokens (after /tokenize 404s)
        n, ids, _ = asyncio.run(_ask(deaf, TEXT))
        assert n is None and ids is None
        n, ids, _ = asyncio.run(_ask(deaf, ""))
        assert n == 0 and ids == []


def test_parse_tokenize_answers():
    assert http.parse_tokenize({"count": 3, "tokens": [5, 6, 7], "max_model_len": 4096}, "a b c") == (3, [5, 6, 7])
    assert http.parse_tokenize({"tokens": [5, 6]}, "a b") == (2, [5, 6])
    # llama-server with "with_pieces": objects with the id and the piece's text
    assert http.parse_tokenize({"tokens": [{"id": 5, "piece": "a"}, {"id": 9, "piece": " b"}]}, "a b") == (2, [5, 9])
    assert http.parse_tokenize({"count": 4}, "a b c d") == (4, None)
    assert http.parse_tokenize({"tokens": []}, "a") is None
    assert http.parse_tokenize(["not", "a", "dict"], "a") is None


# A recorded-style answer of each shape for the same two generated tokens " Paris" " is".
COMPLETIONS_CHOICE = {
    "index": 0, "text": " Paris is", "finish_reason": "length",
    "logprobs": {
        "tokens": [" Paris", " is"],
        "token_logprobs": [-0.11, -0.52],
        "top_logprobs": [{" Paris": -0.11, " Lyon": -2.7, " the": -3.9}, {" is": -0.52, ",": -1.3, " was": -2.2}],
        "text_offset": [27, 33],
    },
}
CHAT_CHOICE = {
    "index": 0,
    "text": " Paris is",
    "finish_reason": "length",
    "logprobs": {
        "content": [
            {
                "id": 6342,
                "token": " Paris",
                "bytes": [32, 80, 97, 114, 105, 115],
                "logprob": -0.11,
                "top_logprobs": [
                    {"id": 6342, "token": " Paris", "bytes": [32, 80, 97, 114, 105, 115], "logprob": -0.11},
                    {"id": 44042, "token": " Lyon", "bytes": [32, 76, 121, 111, 110], "logprob": -2.7},
                    {"id": 279, "token": " the", "bytes": [32, 116, 104, 101], "logprob": -3.9},
                ],
            },
            {
                "id": 374,
                "token": " is",
                "bytes": [32, 105, 115],
                "logprob": -0.52,
                "top_logprobs": [
                    {"id": 374, "token": " is", "bytes": [32, 105, 115], "logprob": -0.52},
                    {"id": 11, "token": ",", "bytes": [44], "logprob": -1.3},
                    {"id": 574, "token": " was", "bytes": [32, 119, 97, 115], "logprob": -2.2},
                ],
            },
        ]
    },
}


def test_completion_logprobs_reads_both_shapes():
    a, b = completion_logprobs(COMPLETIONS_CHOICE), completion_logprobs(CHAT_CHOICE)
    assert a is COMPLETIONS_CHOICE["logprobs"]  # already in the completions shape
    assert a["tokens"] == b["tokens"] == [" Paris", " is"]
    assert a["token_logprobs"] == b["token_logprobs"] == [-0.11, -0.52]
    assert (
        [top_pairs(t) for t in a["top_logprobs"]]
        == [top_pairs(t) for t in b["top_logprobs"]]
        == [
            [[" Paris", -0.11], [" Lyon", -2.7], [" the", -3.9]],
            [[" is", -0.52], [",", -1.3], [" was", -2.2]],
        ]
    )
    assert "text_offset" not in b  # the chat shape has no offsets: echo forcing is not offered
    ids = completion_logprobs(CHAT_CHOICE, ids=True)
    assert ids["tokens"] == ["token_id:6342", "token_id:374"]
    assert [t["token"] for t in ids["top_logprobs"][1]] == ["token_id:374", "token_id:11", "token_id:574"]
    # vLLM's chat shape with return_tokens_as_token_ids already names ids; no "id" field to use
    vllm = {
        "logprobs": {
            "content": [
                {"token": "token_id:7", "logprob": -0.1, "top_logprobs": [{"token": "token_id:7", "logprob": -0.1}]}
            ]
        }
    }
    assert completion_logprobs(vllm, ids=True)["tokens"] == ["token_id:7"]
    assert completion_logprobs({"logprobs": None}) == {} and completion_logprobs({}) == {}


@pytest.fixture(scope="module")
def shared_vocab_panel(tmp_path_factory):
    """A panel with token ids from a vLLM-like reference, and the vocabulary its ids come from."""
    vocab = Vocab()
    out = tmp_path_factory.mktemp("llama-panel") / "panel.json"
    with serve(app=build_app(Behaviour(has_token_ids=True), vocab)) as url:
        write_json(asyncio.run(make_panel(PanelMakeConfig(url=url, max_tokens=6))), str(out))
    return out, vocab


def test_panel_score_on_llama_server_text_forcing(shared_vocab_panel, tmp_path, capsys):
    """No ids asked for: echo is refused, so per-position forcing, aligned through /tokenize's
    {"content"} dialect, scores chat-shaped logprobs like the oracle computed from the toy model."""
    panel_path, vocab = shared_vocab_panel
    b = Behaviour(llama_server=True, noise=4.0)
    out = tmp_path / "score.json"
    text_only = dict(load(panel_path))
    text_only["items"] = [
        {k: v for k, v in it.items() if k not in ("token_ids", "top_ids", "prompt_ids")} for it in text_only["items"]
    ]
    text_only["has_token_ids"] = False
    write_json(text_only, str(tmp_path / "text.json"))
    with serve(app=build_app(b, vocab)) as url:
        rc, text = run_bench(
            ["panel", "score", "--url", url, "--panel", str(tmp_path / "text.json"), "--out", str(out)], capsys
        )
    assert rc == 0, text
    r = load(out)
    top1, kl = teacher_forced_oracle(text_only, b)
    assert r["teacher_forcing"] == ["per-position"]
    assert r["alignment_checked"] and r["positions_misaligned"] == 0 and r["positions"] == 48
    assert r["top1_agreement"] == pytest.approx(top1) and 0 < top1 < 1
    assert r["mean_kl"] == pytest.approx(kl, rel=1e-6) and kl > 0.01
    assert r["greedy_match_fraction"] < 1.0


def test_panel_score_on_llama_server_token_ids(shared_vocab_panel, tmp_path, capsys):
    """A panel with ids: llama-server's per-token "id" gives exact id forcing and id greedy match."""
    panel_path, vocab = shared_vocab_panel
    out = tmp_path / "score.json"
    with serve(app=build_app(Behaviour(llama_server=True), vocab)) as url:
        rc, text = run_bench(
            ["panel", "score", "--url", url, "--panel", str(panel_path), "--mode", "token-ids", "--out", str(out)],
            capsys,
        )
    assert rc == 0, text
    r = load(out)
    assert r["teacher_forcing"] == ["token-ids"] and r["positions"] == 48
    assert r["top1_agreement"] == 1.0 and r["mean_kl"] == pytest.approx(0.0, abs=1e-9)
    assert r["greedy_exact_fraction"] == 1.0


def test_sweep_through_bench_llamacpp_script(tmp_path, capsys):
    """The side-by-side runner's entry point runs the ordinary CLI (nothing swapped in), and
    prompt calibration goes through llama-server's /tokenize: prompts land within 2 % of target."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "sbs" / "bench_llamacpp.py"
    spec = importlib.util.spec_from_file_location("bench_llamacpp", path)
    shim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim)
    assert not hasattr(shim, "_tokenize")
    out = tmp_path / "sweep.json"
    with serve(Behaviour(llama_server=True, report_window=False)) as url:
        rc = shim.main(
            [
                "bench",
                "sweep",
                "--url",
                url,
                "--prefill-sizes",
                "64,128",
                "--reps",
                "1",
                "--concurrency",
                "1",
                "--max-tokens",
                "4",
                "--long-prompt",
                "0",
                "--out",
                str(out),
            ]
        )
    text = capsys.readouterr()
    assert rc == 0, text
    for row in load(out)["prefill"]:
        (run,) = row["runs"]
        assert abs(run["prompt_tokens"] - row["target_tokens"]) <= max(1, 0.02 * row["target_tokens"])


def test_panel_make_from_llama_server(shared_vocab_panel, tmp_path):
    """A panel recorded from llama-server (chat-shaped logprobs with ids) holds the same greedy
    tokens, ids and top-k as one recorded from a vLLM-like server over the same toy model."""
    panel_path, vocab = shared_vocab_panel
    with serve(app=build_app(Behaviour(llama_server=True), vocab)) as url:
        made = asyncio.run(make_panel(PanelMakeConfig(url=url, max_tokens=6)))
    want = load(panel_path)
    assert len(made["items"]) == len(want["items"])
    for got, ref in zip(made["items"], want["items"]):
        assert got["tokens"] == ref["tokens"]
        assert [p[0] for p in got["top"][0]] == [p[0] for p in ref["top"][0]]
        assert got.get("token_ids") == ref.get("token_ids")
