"""The built-in web page and its live stats stream (server/web_routes.py, server/live_stats.py).

The page and its vendored libraries come from the package (and the wheel's package-data) and
load nothing from another origin; the stats stream sends well-formed events with every field
the dashboard draws; the heat map counts are the store's real per-expert counters after a real
request; with --api-key every data endpoint refuses without the key (401, OpenAI shape) and
answers with it, while the page's shell (no data) loads; --no-web turns the page off (404).
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import httpx
import pytest

from server_harness import start_server
from tiermoe.server import web_routes
from tiermoe.server.live_stats import compact, cumulative

MSG = [{"role": "user", "content": "Tell me a story"}]
STATS_FIELDS = {"t", "dt", "tok_s", "prompt_tok_s", "ttft_p50_s", "ttft_p90_s", "itl_p50_s", "running", "waiting",
                "kv_usage", "requests", "errors", "decode_tokens", "hits_per_token", "bytes_per_token",
                "hits_per_token_total", "cpu_lane_busy", "floor_fraction"}
# where a page or library could load something: src/href attributes, imports, CSS url(), fetch()
LOADS = re.compile(r"""(?:\b(?:src|href)\s*=\s*["']?|\bimport\s*(?:[\w{}\s,*]+from\s*)?\(?\s*["']|url\(\s*["']?"""
                   r"""|fetch\(\s*["'])((?:https?:)?//[^"')\s]*)""", re.IGNORECASE)
MODULE_IMPORTS = re.compile(r"""^import\s+(?:[\w{}\s,*]+from\s*)?["']([^"']+)["']""", re.MULTILINE)
PAGE_LINKS = re.compile(r"""\b(?:src|href)=["']([^"']+)["']""")


def sse_events(response):
    """(event, data) of each server-sent event of a streaming response (iterate it once)."""
    event = "message"
    for line in response.iter_lines():
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            yield event, json.loads(line[5:])
            event = "message"


def take(stream, count: int, wanted=lambda event, data: True, limit: int = 300) -> list[tuple[str, dict]]:
    """The next `count` events of `stream` (from sse_events) that `wanted` accepts, within
    `limit` events (stats arrive every 0.1 s here: 30 s)."""
    out = []
    for seen, (event, data) in enumerate(stream):
        if seen >= limit:
            raise AssertionError(f"{len(out)} of {count} wanted events in {limit}")
        if wanted(event, data):
            out.append((event, data))
            if len(out) >= count:
                return out
    raise AssertionError(f"the stream ended after {len(out)} events")


def fast(server, heat_s: float = 0.3):
    """Snapshots every 0.1 s instead of every second (the rates do not depend on the interval)."""
    live = server.app.state.live_stats
    live.interval_s, live.heat_interval_s = 0.1, heat_s
    return server


@pytest.fixture(scope="module")
def web_server(tokenizer):
    with start_server(tokenizer, core_kwargs={"max_model_len": 4096, "step_delay_s": 0.002}) as s:
        yield fast(s)


# ---- the page and its assets ------------------------------------------------------------------
def test_page_and_vendored_assets_come_from_the_package(web_server):
    url = web_server.url
    page = httpx.get(url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp
    assert "http" not in csp and "*" not in csp and "unsafe" not in csp
    # every file the page reaches (links, scripts, module imports, transitively) is served from here
    todo, seen = ["/"], set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        r = httpx.get(url + path)
        assert r.status_code == 200, path
        assert not LOADS.findall(r.text), (path, LOADS.findall(r.text))
        base = path if path.endswith("/") else path.rsplit("/", 1)[0] + "/"
        for ref in (PAGE_LINKS if path == "/" else MODULE_IMPORTS).findall(r.text):
            todo.append(str(httpx.URL(url + base).join(ref).path))
    assert {"/web/app.js", "/web/chat.js", "/web/dashboard.js", "/web/heatmap.js", "/web/markdown.js",
            "/web/vendor/uplot/uPlot.esm.js", "/web/vendor/marked/marked.esm.js",
            "/web/vendor/dompurify/purify.es.mjs", "/web/vendor/highlight/core.min.js"} <= seen
    served = web_routes.load_assets()
    assert set(served) >= seen - {"/"}
    for path, asset in served.items():  # every shipped file: its type, caching, and no external load
        r = httpx.get(url + path)
        assert r.status_code == 200 and r.headers["content-type"] == asset.content_type, path
        assert r.headers["cache-control"] and r.headers["etag"] and r.headers["content-security-policy"] == csp
        assert not LOADS.findall(r.text), (path, LOADS.findall(r.text))
    again = httpx.get(url + "/web/app.js", headers={"If-None-Match": served["/web/app.js"].etag})
    assert again.status_code == 304


def test_vendored_files_are_package_data_with_their_licences():
    repo = Path(__file__).resolve().parents[2]
    package, root = repo / "src" / "tiermoe", repo / "src" / "tiermoe" / "server"
    pyproject = tomllib.loads((repo / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["tiermoe"]
    shipped = {p for pattern in patterns for p in package.glob(pattern)}
    web_files = [p for p in (root / "web").rglob("*") if p.is_file()]
    assert web_files and not [p for p in web_files if p not in shipped]
    vendor = root / "web" / "vendor"
    readme = (vendor / "README.md").read_text()
    for lib in ("uplot", "marked", "dompurify", "highlight"):
        assert (vendor / lib / "LICENSE").is_file(), lib
        assert f"vendor/{lib}/" in readme or f"`{lib}/`" in readme, lib


def test_unknown_asset_is_404_in_the_openai_shape(web_server):
    for path in ("/web/nope.js", "/web/vendor/uplot/LICENSE", "/web/%2e%2e/web_routes.py", "/web/vendor/README.md"):
        r = httpx.get(web_server.url + path)
        assert r.status_code == 404, path
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# ---- the live stats stream --------------------------------------------------------------------
def test_stats_stream_sends_the_fields_the_dashboard_draws(web_server):
    import threading

    def chat():
        httpx.post(web_server.url + "/v1/chat/completions", timeout=30,
                   json={"model": "scripted", "messages": MSG, "max_tokens": 300})

    with httpx.stream("GET", web_server.url + "/v1/stats/stream", timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        stream = sse_events(r)
        first = take(stream, 2)
        assert {e for e, _ in first} == {"stats", "heat"}
        heat = dict(first)["heat"]
        assert heat["available"] is False and heat["reason"]  # the scripted core has no experts
        worker = threading.Thread(target=chat)
        worker.start()
        busy = take(stream, 1, lambda e, d: e == "stats" and d["tok_s"] and d["running"])
        worker.join(30)
    snap = busy[0][1]
    assert set(snap) == STATS_FIELDS
    assert snap["dt"] > 0 and snap["tok_s"] > 0 and 0 <= snap["kv_usage"] <= 1 and snap["waiting"] == 0
    assert snap["ttft_p50_s"] is not None and snap["requests"] >= 1
    # the scripted core has no expert tiers, CPU lane or floor: those stay null, never made up
    assert snap["hits_per_token"] is None and snap["cpu_lane_busy"] is None and snap["floor_fraction"] is None


def test_rates_come_from_counter_deltas():
    def engine(decode, slots, host, disk, moved, busy, lane):
        tok = max(1, decode)
        return {"kv_usage": 0.5, "generation_tokens": decode, "prompt_tokens": 100, "decode_floor_s_per_token": 0.01,
                "experts": {"slots": {"hits": 1, "misses": 1}, "decode_tokens": decode, "record_bytes": 1000,
                            "per_decode_token": {"slots_hits": slots / tok, "host_hits": host / tok,
                                                 "disk_reads": disk / tok, "bytes_moved": moved / tok},
                            "cpu_lane": {"decode_experts": lane, "busy_s": busy, "workers": 2}}}

    server = {"requests_running": 1, "requests_waiting": 0, "ttft_s": {"p50": 0.1}}
    a, b = engine(10, 50, 20, 10, 30000, 1.0, 4), engine(30, 150, 40, 30, 90000, 2.0, 14)
    prev, cur = cumulative(a, server, 100.0), cumulative(b, server, 102.0)
    snap = compact(prev, cur, b, server)
    assert snap["tok_s"] == 10 and snap["decode_tokens"] == 20
    assert snap["hits_per_token"] == {"slots": 5, "host": 1, "disk": 1}
    assert snap["hits_per_token_total"] == pytest.approx({"slots": 5, "host": 4 / 3, "disk": 1}, rel=1e-3)
    assert snap["bytes_per_token"] == {"moved": 3000, "disk": 1000, "cpu_lane": 500}
    assert snap["cpu_lane_busy"] == 0.25 and snap["floor_fraction"] == 0.1
    assert compact(None, cur, b, server)["tok_s"] is None  # no previous snapshot: no rate


# ---- the heat map from real counters ------------------------------------------------------------
def test_heat_map_counts_are_the_stores_counters_after_a_real_request(tiny_dir, tmp_path_factory):
    from testkit.servers import ServerThread
    from testkit.stores import pack_tiny

    from tiermoe.engine.async_engine import AsyncEngine
    from tiermoe.engine.build import build_engine_core
    from tiermoe.server.app import create_app

    _, store = pack_tiny(tiny_dir, tmp_path_factory, "qwen3_moe", quant="bf16")
    core = build_engine_core(str(store), device="cpu", dtype="float32", max_model_len=256, max_num_seqs=2,
                             options={"gpu_expert_gb": 0, "host_expert_gb": 0.0001})  # a few experts in RAM
    with ServerThread(create_app(AsyncEngine(core), served_model_name="tiny")) as server:
        fast(server, heat_s=0.1)
        with httpx.stream("GET", server.url + "/v1/stats/stream", timeout=60) as r:
            stream = sse_events(r)
            before = take(stream, 1, lambda e, d: e == "heat")[0][1]
            assert before["available"] and before["measure"] == "uses"
            assert sum(map(sum, before["counts"])) == 0
            reply = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                               json={"messages": MSG, "max_tokens": 6, "ignore_eos": True})
            assert reply.status_code == 200
            experts = httpx.get(server.url + "/stats").json()["engine"]["experts"]  # idle now: final counts
            uses = experts["slots"]["hits"] + experts["slots"]["misses"]
            assert uses > 0
            # heat events taken while the request ran come first; the one after its last step follows
            after = take(stream, 1, lambda e, d: e == "heat" and sum(map(sum, d["counts"])) == uses)[0][1]
            stats = take(stream, 1, lambda e, d: e == "stats")[0][1]
    layers, width = after["layers"], after["experts"]
    assert layers and len(after["counts"]) == len(after["tiers"]) == len(layers)
    assert all(len(row) == width for row in after["counts"] + after["tiers"])
    assert {t for row in after["tiers"] for t in row} <= {0, 1, 2}
    # every use the store counted by tier is one use of one (layer, expert) cell (the sum matched above)
    assert all(sum(row) > 0 for row in after["counts"])  # each MoE layer served the request
    assert set(stats) == STATS_FIELDS


# ---- API key and --no-web -----------------------------------------------------------------------
DATA_REQUESTS = [
    ("GET", "/v1/stats/stream", None), ("GET", "/stats", None), ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions", {"model": "private-model", "messages": MSG, "max_tokens": 4}),
    ("POST", "/v1/completions", {"model": "private-model", "prompt": "hi", "max_tokens": 4}),
    ("POST", "/v1/responses", {"model": "private-model", "input": "hi", "max_output_tokens": 4}),
    ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]}),
]


def test_api_key_guards_every_data_endpoint_but_not_the_empty_shell(tokenizer):
    with start_server(tokenizer, api_key="sekret", served_model_name="private-model") as server:
        fast(server)
        shell = httpx.get(server.url + "/")
        assert shell.status_code == 200 and "private-model" not in shell.text
        assert httpx.get(server.url + "/web/app.js").status_code == 200
        for method, path, body in DATA_REQUESTS:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = httpx.request(method, server.url + path, json=body, headers=headers, timeout=30)
                assert r.status_code == 401, (path, headers, r.status_code)
                error = r.json()["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key"
                assert "private-model" not in r.text
        key = {"Authorization": "Bearer sekret"}
        for method, path, body in DATA_REQUESTS:
            if path == "/v1/stats/stream":
                with httpx.stream("GET", server.url + path, headers=key, timeout=30) as r:
                    assert r.status_code == 200 and take(sse_events(r), 1)[0][0] in ("stats", "heat")
                continue
            r = httpx.request(method, server.url + path, json=body, headers=key, timeout=30)
            assert r.status_code == 200, (path, r.text)


def test_no_web_turns_the_page_off(tokenizer):
    with start_server(tokenizer, web=False) as server:
        for path in ("/", "/web/app.js", "/web/vendor/uplot/uPlot.esm.js"):
            r = httpx.get(server.url + path)
            assert r.status_code == 404, path
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        with httpx.stream("GET", fast(server).url + "/v1/stats/stream", timeout=30) as r:
            assert r.status_code == 200  # the stream is an API, like /stats


def test_serve_has_a_no_web_flag():
    import argparse

    from tiermoe.server.cli import register

    parser = argparse.ArgumentParser(prog="tiermoe")
    register(parser.add_subparsers())
    assert parser.parse_args(["serve"]).no_web is False
    assert parser.parse_args(["serve", "--no-web"]).no_web is True


def test_device_cache_heat_reads_pick_frequencies_and_slots():
    """The device cache's own counters (ExpertCache.freq, 1024 per pick, and expert_slot) become
    the heat map in one host copy; built without a GPU around two layers' state tensors."""
    from types import SimpleNamespace

    import torch

    from tiermoe.engine.expert_heat import FREQ_PER_PICK, expert_heat_map
    from tiermoe.moe.device_cache import DeviceCacheExperts

    backend = DeviceCacheExperts.__new__(DeviceCacheExperts)
    backend.caches = {
        5: SimpleNamespace(num_experts=3, freq=torch.tensor([0, 2 * FREQ_PER_PICK, 512], dtype=torch.int32),
                           expert_slot=torch.tensor([-1, 0, -1], dtype=torch.int32)),
        1: SimpleNamespace(num_experts=3, freq=torch.tensor([FREQ_PER_PICK, 0, 0], dtype=torch.int32),
                           expert_slot=torch.tensor([1, -1, 0], dtype=torch.int32)),
    }
    heat = expert_heat_map(backend)
    assert heat == {"measure": "recent_picks", "layers": [1, 5], "experts": 3,
                    "counts": [[1.0, 0.0, 0.0], [0.0, 2.0, 0.5]], "tiers": [[0, 1, 0], [1, 0, 1]]}
    assert expert_heat_map(None) is None  # resident experts: no heat map


def test_serve_ends_open_stats_streams_on_sigterm():
    """An open dashboard must not hold `tiermoe serve`'s graceful shutdown for the drain timeout."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from testkit.servers import free_port

    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tiermoe.cli", "serve", "--scripted", "--port", str(port),
                             "--drain-timeout", "30", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        with httpx.stream("GET", url + "/v1/stats/stream", timeout=60) as r:
            stream = sse_events(r)
            assert take(stream, 1)[0][0] in ("stats", "heat")
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            for _ in stream:  # the server ends the stream
                pass
        assert proc.wait(20) == 0
        assert time.monotonic() - t0 < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
