"""Live stats streams (one per open dashboard) are counted in a pool of their own: a user's
dashboard tabs, open for hours, must not take that address's share of API slots (its requests and
the page itself got 429) nor make /health call an idle server saturated; they stay bounded."""

import contextlib

import anthropic
import httpx
from server_harness import start_server


def test_open_dashboards_leave_the_api_slots_to_requests(tokenizer):
    with start_server(tokenizer, core_kwargs={"max_model_len": 2048}, max_model_len=2048,
                      max_connections=2, max_connections_per_client=2) as s, contextlib.ExitStack() as open_streams:
        for _ in range(2):
            r = open_streams.enter_context(httpx.stream("GET", s.url + "/v1/stats/stream", timeout=30))
            assert r.status_code == 200
        ac = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0, timeout=30)
        m = ac.messages.create(model="scripted", max_tokens=20, messages=[{"role": "user", "content": "2 * 3?"}])
        assert m.content[-1].text == "6"
        assert httpx.get(s.url + "/", timeout=10).status_code == 200
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200
        third = httpx.get(s.url + "/v1/stats/stream", timeout=10)  # still bounded, in their own pool
        assert third.status_code == 429 and "stats streams" in third.json()["error"]["message"]
        assert third.headers["retry-after"]
