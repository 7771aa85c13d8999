"""The built-in web page in a real browser: Debian's headless Chromium (testkit/browser.py) drives
the page that `tiermoe serve` serves for the embedded default model, as a user would.

Without --api-key: a chat message gets its answer streamed into the page (the text grows while the
request runs, then the finish line follows), and the dashboard's counters move after the answer
(requests, time to first token, generated tokens per second), read from the page's own tiles and
checked against the server's /stats; screenshots of both views are saved under the test's
tmp_path. With --api-key: the page opened without the key shows the key dialog and no data (no
model, no counters, no answer) while every data request the browser makes gets 401; a wrong key
is refused; the right one unlocks the same page.

The server is a `tiermoe serve` subprocess with no model argument, as `make serve` starts it; its
cache directory is the test session's converted default model (tests/conftest.py), so the
conversion is shared with the importer tests. Every wait is on a condition of the page.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from testkit.browser import chromium
from testkit.servers import free_port

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"  # the served name of the embedded default model
QUESTION = "What is the capital of France?"
KEY = "web-page-key"
WAIT_MS = 90_000  # a generous bound for one page condition on a busy 2-core machine
DATA_PATHS = ("/v1/models", "/v1/stats/stream", "/v1/chat/completions", "/stats")

# The dashboard's tiles as {label: value} (dashboard.js fills them from each stats event).
TILES_JS = """() => Object.fromEntries([...document.querySelectorAll('#tiles .tile')]
  .map((t) => [t.querySelector('.label').textContent, t.querySelector('.value').textContent]))"""
# Records, while the request runs (Stop shown), each new text of the last answer, and every tok/s value shown.
RECORD_JS = """() => {
  const seen = window.seenByTest = { partials: [], tokS: [] };
  const stop = document.getElementById('stop');
  new MutationObserver(() => {
    const answer = document.querySelector('#messages .msg.assistant:last-child .content');
    const text = answer ? answer.textContent.trim() : '';
    if (!stop.hidden && text && seen.partials[seen.partials.length - 1] !== text) seen.partials.push(text);
  }).observe(document.getElementById('messages'), { subtree: true, childList: true, characterData: true });
  new MutationObserver(() => {
    for (const tile of document.querySelectorAll('#tiles .tile')) {
      const label = tile.querySelector('.label').textContent;
      if (label === 'tok/s') seen.tokS.push(tile.querySelector('.value').textContent);
    }
  }).observe(document.getElementById('tiles'), { subtree: true, childList: true, characterData: true });
}"""
# Each data request made from the page without a key: [path, status, body].
UNKEYED_JS = """async (paths) => Promise.all(paths.map(async (path) => {
  const post = path === '/v1/chat/completions';
  const r = await fetch(path, post ? { method: 'POST', headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ messages: [{ role: 'user', content: 'hi' }], max_tokens: 4 }) } : {});
  return [path, r.status, await r.text()];
}))"""


@contextmanager
def serve(default_model_dir: Path, log: Path, *flags: str) -> Iterator[str]:
    """`tiermoe serve` for the default model on a free port, until it answers /health; yields its URL."""
    port = free_port()
    env = {**os.environ, "TIERMOE_CACHE_DIR": str(default_model_dir.parent.parent), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "tiermoe.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"tiermoe serve exited with {proc.returncode}: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"tiermoe serve did not answer /health: {log.read_text()[-2000:]}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)  # the next probe of a process that is still loading
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with chromium(tmp_path_factory.mktemp("chromium") / "profile") as context:
        context.set_default_timeout(WAIT_MS)
        yield context


def open_page(browser, url: str):
    """A new tab on the page; returns it with the (method, path, status) of every response it gets
    and the uncaught errors of its scripts."""
    page = browser.new_page()
    responses: list[tuple[str, str, int]] = []
    errors: list[str] = []
    page.on("response", lambda r: responses.append((r.request.method, urlsplit(r.url).path, r.status)))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url + "/")
    return page, responses, errors


def ask(page, question: str, max_tokens: int) -> str:
    """Sends `question` from the composer at temperature 0; returns the answer's text once its
    finish line is shown."""
    from playwright.sync_api import expect

    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#prompt", question)
    page.press("#prompt", "Enter")
    answer = page.locator("#messages .msg.assistant").last
    expect(answer.locator(".meta")).to_contain_text("finish:", timeout=WAIT_MS)
    expect(page.locator("#send")).to_be_visible()
    return answer.locator(".content").inner_text().strip()


def plain_words(text: str) -> str:
    """The words of a markdown answer as the page renders them: emphasis, heading and code marks
    dropped, whitespace collapsed."""
    return " ".join(re.sub(r"[*_`#>]", " ", text).split())


def tiles(page) -> dict[str, str]:
    return page.evaluate(TILES_JS)


def test_chat_answer_streams_in_and_the_dashboard_counts_it(browser, default_model_dir, tmp_path):
    from playwright.sync_api import expect

    with serve(default_model_dir, tmp_path / "serve.log") as url:
        page, responses, errors = open_page(browser, url)
        expect(page.locator("#model")).to_have_value(MODEL, timeout=WAIT_MS)  # the picker lists the served model
        expect(page.locator("#conn")).to_have_text("live", timeout=WAIT_MS)  # the stats stream is open
        # the first stats event arrived; nothing was generated yet
        page.wait_for_function(f"() => /^\\d+$/.test(({TILES_JS})()['requests'])", timeout=WAIT_MS)
        before = tiles(page)
        assert before["time to first token"] == "–" and before["tok/s"] in ("–", "0.0"), before
        page.evaluate(RECORD_JS)

        answer = ask(page, QUESTION, max_tokens=32)
        assert answer, answer
        meta = page.locator("#messages .msg.assistant .meta").last.inner_text()
        usage = re.search(r"finish: stop · first token [\d.]+ s · (\d+) prompt \+ (\d+) generated tokens", meta)
        assert usage, meta
        seen = page.evaluate("() => window.seenByTest")
        # streamed: the answer was shown in parts, growing, before the request ended
        partials = seen["partials"]
        assert len(partials) >= 2, partials
        assert all(len(a) < len(b) for a, b in zip(partials, partials[1:])), partials
        assert answer.startswith(partials[0]) and len(partials[0]) < len(answer), (partials, answer)

        # the dashboard's counters moved: tokens per second, a time to first token, HTTP requests
        page.wait_for_function("() => window.seenByTest.tokS.some((v) => parseFloat(v) > 0)", timeout=WAIT_MS)
        page.wait_for_function(f"() => /^\\d+ ms$/.test(({TILES_JS})()['time to first token'])", timeout=WAIT_MS)
        after = tiles(page)
        assert int(after["requests"]) > int(before["requests"]), (before, after)
        server = httpx.get(url + "/stats", timeout=30).json()["server"]  # what the tiles were drawn from
        assert server["ttft_s"]["n"] == 1 and server["errors"] == 0, server
        assert server["generation_tokens"] == int(usage[2]) and server["prompt_tokens"] == int(usage[1]), server

        expect(page.locator("#dashboard")).to_be_hidden()  # one view at a time
        page.screenshot(path=tmp_path / "web-chat.png")
        page.click("button.tab[data-view=dashboard]")
        expect(page.locator("#chat")).to_be_hidden()
        expect(page.locator("#tiles")).to_be_in_viewport()
        expect(page.locator("#charts .chart canvas").first).to_be_in_viewport()
        page.screenshot(path=tmp_path / "web-dashboard.png")
        for name in ("web-chat.png", "web-dashboard.png"):
            assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name

        data = [(m, p, s) for m, p, s in responses if p in DATA_PATHS]
        assert {p for _, p, _ in data} == {"/v1/models", "/v1/stats/stream", "/v1/chat/completions"}, data
        assert all(s == 200 for _, _, s in data), data
        assert not errors, errors

        # the page shows the model's own answer: the same request through the API gives the same text
        # (greedy; the words themselves depend on the machine's float arithmetic, so they are not fixed here)
        api = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": 32})
        assert api.status_code == 200, api.text
        assert api.json()["usage"]["completion_tokens"] == int(usage[2]), (api.json(), meta)
        assert plain_words(api.json()["choices"][0]["message"]["content"]) == plain_words(answer), (api.text, answer)


def test_with_an_api_key_the_page_shows_no_data_without_it(browser, default_model_dir, tmp_path):
    from playwright.sync_api import expect

    with serve(default_model_dir, tmp_path / "serve.log", "--api-key", KEY) as url:
        page, responses, errors = open_page(browser, url)
        expect(page.locator("#key-dialog")).to_be_visible(timeout=WAIT_MS)  # the page asks for the key
        assert ("GET", "/v1/models", 401) in responses, responses
        # no data: no model in the picker, no counters, no conversation, no stats stream
        assert page.locator("#model option").count() == 0
        assert page.locator("#tiles .tile").count() == 0 and page.locator("#messages .msg").count() == 0
        expect(page.locator("#conn")).to_have_text("offline")
        assert MODEL not in page.content()
        # every data request from this page without the key is refused, and its body names nothing
        for path, status, body in page.evaluate(UNKEYED_JS, list(DATA_PATHS)):
            assert status == 401, (path, status, body)
            assert MODEL not in body and "tok_s" not in body and "invalid_api_key" in body, (path, body)

        page.fill("#key-input", "not-the-key")
        page.click("#key-form button[type=submit]")
        expect(page.locator("#key-error")).to_be_visible(timeout=WAIT_MS)  # refused: asked again
        assert page.locator("#model option").count() == 0 and page.locator("#tiles .tile").count() == 0
        refused = [(m, p, s) for m, p, s in responses if p in DATA_PATHS]
        assert refused and all(s == 401 for _, _, s in refused), refused

        # the right key unlocks the same page: model, live stats, and a chat answer
        mark = len(responses)
        page.fill("#key-input", KEY)
        page.click("#key-form button[type=submit]")
        expect(page.locator("#model")).to_have_value(MODEL, timeout=WAIT_MS)
        expect(page.locator("#conn")).to_have_text("live", timeout=WAIT_MS)
        assert ask(page, QUESTION, max_tokens=8)
        unlocked = [(m, p, s) for m, p, s in responses[mark:] if p in DATA_PATHS]
        assert {p for _, p, _ in unlocked} == {"/v1/models", "/v1/stats/stream", "/v1/chat/completions"}
        assert all(s == 200 for _, _, s in unlocked), unlocked
        assert not errors, errors
