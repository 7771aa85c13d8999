"""Headless Chromium from the system's packages, driven with Playwright, for the web page's tests.

The browser is Debian's `chromium` (`make test` installs it as root with apt-get), never one that
Playwright downloads for itself: CI machines reach package registries only, so `playwright
install` fails there. The flags keep Chromium off the network it would otherwise probe at start
(component updates, sync, QUIC, background fetches): on a closed network those make it hang or
fill the log with refused connections. Root needs --no-sandbox; there is no GPU. Each launch gets
a new, empty profile directory.

Where Chromium or the Playwright package is missing the browser tests skip and say how to get
them, except on CI (CI set in the environment), where a skip would hide a broken set-up: there
they fail with the same message.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]
INSTALL_HINT = "`make test` installs it as root (apt-get install chromium); elsewhere install Debian's chromium"


def chromium_path() -> str | None:
    """The system's Chromium launcher, or None."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def unavailable(reason: str) -> None:
    """Skip a browser test for a missing part, or fail on CI, where the set-up must provide it."""
    if os.environ.get("CI"):
        pytest.fail(f"browser test cannot run on CI: {reason}", pytrace=False)
    pytest.skip(reason)


@contextmanager
def chromium(profile_dir: Path, *, width: int = 1400, height: int = 900) -> Iterator[object]:
    """A Playwright BrowserContext of headless system Chromium with a new profile in `profile_dir`."""
    path = chromium_path()
    if path is None:
        unavailable(f"no chromium on PATH: {INSTALL_HINT}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("the playwright package is missing: pip install -e '.[test]'")
    profile_dir.mkdir(parents=True, exist_ok=False)
    with sync_playwright() as driver:
        context = driver.chromium.launch_persistent_context(
            str(profile_dir), executable_path=path, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": width, "height": height}, timeout=60_000)
        try:
            yield context
        finally:
            context.close()
