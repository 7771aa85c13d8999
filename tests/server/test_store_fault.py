"""A real server on a real packed store whose records fail their checksum: the request that hits
one gets a 503 naming the record (not a 500), /health turns 503 with the reason, the rest of the
API keeps answering, and `tiermoe pack` refuses to write into the store the server holds."""

import argparse
import json
import os

import httpx
import pytest
from testkit.servers import ServerThread

from tiermoe.engine.async_engine import AsyncEngine
from tiermoe.errors import UserError
from tiermoe.server.app import create_app
from tiermoe.server.cli import build_core, register
from tiermoe.store.pack import pack
from tiermoe.store.records import load_manifest


def _flip_every_record(store) -> None:
    m = load_manifest(store)
    with open(m.experts_path, "r+b") as f:
        for r in m.records:
            f.seek(r.offset + 7)
            b = f.read(1)
            f.seek(r.offset + 7)
            f.write(bytes([b[0] ^ 0x10]))


@pytest.fixture(scope="module")
def faulty_server(tiny_dir, tmp_path_factory):
    src = tiny_dir("qwen3_moe")
    store = tmp_path_factory.mktemp("fault") / "st"
    pack(src, store, progress=False, log=lambda _: None)
    _flip_every_record(store)
    parser = argparse.ArgumentParser(prog="tiermoe")
    register(parser.add_subparsers())
    # no host tier: every expert is read from disk, and checked, when a request needs it
    args = parser.parse_args(["serve", str(store), "--device", "cpu", "--host-expert-gb", "0", "--max-num-seqs", "2"])
    engine = AsyncEngine.build_in_thread(lambda: build_core(args))
    with ServerThread(create_app(engine, served_model_name="m")) as server:
        server.store = store
        server.src = src
        yield server


def test_health_turns_503_after_a_checksum_mismatch(faulty_server):
    url = faulty_server.url
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "store_corrupt" and err["type"] == "service_unavailable"
    assert "checksum mismatch for layer" in err["message"] and "tiermoe verify" in err["message"]
    health = httpx.get(url + "/health")
    assert health.status_code == 503
    h = health.json()
    assert h["status"] == "store failed" and h["error"]["code"] == "store_corrupt"
    assert "checksum mismatch" in h["error"]["message"]
    assert httpx.get(url + "/v1/models").status_code == 200  # what needs no expert still answers
    assert httpx.post(url + "/tokenize", json={"model": "m", "prompt": "hello"}).status_code == 200
    # a stream that already started gets the same reason in band
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as s:
        text = "".join(s.iter_text())
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert any(e.get("error", {}).get("code") == "store_corrupt" for e in events), text


def test_pack_refuses_the_store_the_server_holds(faulty_server):
    before = (faulty_server.store / "experts.bin").stat().st_mtime_ns
    with pytest.raises(UserError, match=f"the store is in use \\(held by pid {os.getpid()}\\)"):
        pack(faulty_server.src, faulty_server.store, progress=False, log=lambda _: None)
    assert (faulty_server.store / "experts.bin").stat().st_mtime_ns == before
