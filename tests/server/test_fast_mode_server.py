"""Fast mode through a real server on a tiny packed int4 store (CPU): the CPU lane computes decode
misses from the records in place (/stats: no repack per expert use), and a lane that fails fails
its request with a clear error while the server keeps serving the next ones."""

from __future__ import annotations

import httpx
import pytest
from testkit.stores import pack_tiny

from tiermoe.moe.lane_kernel import native_library

pytestmark = pytest.mark.slow
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 6,
        "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def fast_server(tiny_dir, tmp_path_factory):
    from server_harness import ServerThread
    from tiermoe.engine.async_engine import AsyncEngine
    from tiermoe.engine.build import build_engine_core
    from tiermoe.server.app import create_app

    store = pack_tiny(tiny_dir, tmp_path_factory, "glm4_moe", quant="int4", group_size=32)[1]
    core = build_engine_core(str(store), device="cpu", dtype="bfloat16", max_model_len=256, max_num_seqs=2,
                             options={"mode": "fast", "cpu_lane_threads": 1})
    app = create_app(AsyncEngine(core), served_model_name="tiny", max_model_len=256)
    with ServerThread(app) as server:
        yield server, core


def _lane(url: str) -> dict:
    stats = httpx.get(url + "/stats", timeout=30).json()
    assert stats["engine"]["experts"]["mode"] == "fast"
    return stats["engine"]["experts"]["cpu_lane"]


def test_stats_show_no_repack_per_expert_use(fast_server):
    server, _ = fast_server
    before = _lane(server.url)
    r = httpx.post(server.url + "/v1/chat/completions", json=BODY, timeout=120)
    assert r.status_code == 200, r.text
    lane = _lane(server.url)
    used = lane["decode_experts"] - before["decode_experts"]
    assert used > 0  # the request's decode steps gave the lane experts to compute
    if native_library() is not None:
        assert lane["kernel"].startswith("native-") and lane["repacks"] == 0 and lane["repacks_per_expert"] == 0
    else:  # no compiler here: the plain-torch path, which converts every expert it uses
        assert lane["kernel"] == "torch" and lane["repacks"] - before["repacks"] == used
    assert lane["weight_bytes"] > 0 and lane["gbs"] > 0


def test_a_lane_failure_fails_its_request_and_the_server_keeps_serving(fast_server, monkeypatch):
    """The store hands the lane one record it cannot read (cut short): the lane refuses it, the
    request fails with the lane's reason, and the next request is served in full."""
    server, core = fast_server
    store = core.model.expert_backend.store
    real, left = store.lane_records, [1]

    def one_unreadable(layer, expert_ids, **kw):
        out = real(layer, expert_ids, **kw)
        if left[0] and out:
            left[0] -= 1
            e = min(out)
            buf, fut = out[e]
            out[e] = (buf[:64], fut)
        return out

    monkeypatch.setattr(store, "lane_records", one_unreadable)
    r = httpx.post(server.url + "/v1/chat/completions", json=BODY, timeout=120)
    assert r.status_code == 500, r.text
    message = r.json()["error"]["message"]
    assert "CPU lane failed on layer" in message and "not a readable" in message, message
    assert left == [0]
    ok = httpx.post(server.url + "/v1/chat/completions", json=BODY, timeout=120)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6, ok.text
    health = httpx.get(server.url + "/health", timeout=30)
    assert health.status_code == 200, health.text
