"""The built-in web page (`GET /`: chat + live dashboard) and the live stats stream.

The page is plain HTML/CSS/JS under `server/web/` with its libraries vendored under
`web/vendor/` (their licences beside them): no build step, no network at run time. Files are
read once when the app is built and served from memory with their content type, an ETag, and
a Content-Security-Policy that allows this origin only (no external scripts, styles, images or
connections; no inline scripts).

With `--api-key` the shell (`/` and `/web/...`) is served without the key, because a browser
cannot send a header when it navigates; it holds no data and asks for the key, which the page
then sends with every data request (the stats stream, /v1/models, chat). `--no-web` leaves
out the page (404) but keeps `/v1/stats/stream`, which is an API like /stats.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from tiermoe.server.errors import APIError
from tiermoe.server.live_stats import LiveStats
from tiermoe.server.streaming import EventStream

WEB_DIR = Path(__file__).parent / "web"
ASSET_PREFIX = "/web/"
STREAM_PATH = "/v1/stats/stream"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; connect-src 'self'; "
       "font-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY"}
VENDOR_MAX_AGE_S = 86400  # vendored libraries change only with the package


def is_shell_path(path: str) -> bool:
    """Paths of the page itself: served without the API key (they hold no data)."""
    return path == "/" or path.startswith(ASSET_PREFIX)


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str
    etag: str
    cache_control: str


def load_assets(root: Path = WEB_DIR) -> dict[str, Asset]:
    """{"/web/<relative path>": Asset} for every servable file under `root` (read once)."""
    assets = {}
    for path in sorted(root.rglob("*")):
        content_type = CONTENT_TYPES.get(path.suffix)
        if content_type is None or not path.is_file():
            continue
        body = path.read_bytes()
        rel = path.relative_to(root).as_posix()
        vendored = rel.startswith("vendor/")
        cache = f"public, max-age={VENDOR_MAX_AGE_S}" if vendored else "no-cache"
        etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
        assets[ASSET_PREFIX + rel] = Asset(body, content_type, etag, cache)
    return assets


def _serve(request: Request, asset: Asset) -> Response:
    headers = {"ETag": asset.etag, "Cache-Control": asset.cache_control, **SECURITY_HEADERS}
    if request.headers.get("if-none-match") == asset.etag:
        return Response(status_code=304, headers=headers)
    return Response(asset.body, media_type=asset.content_type, headers=headers)


def register(app: FastAPI, live: LiveStats, *, web: bool) -> None:
    """The stats stream always; the page and its assets unless `web` is False."""

    @app.get(STREAM_PATH, include_in_schema=False)
    async def stats_stream():
        return EventStream(live.events())

    if not web:
        return
    assets = load_assets()
    index = assets[ASSET_PREFIX + "index.html"]

    @app.get("/", include_in_schema=False)
    async def page(request: Request):
        return _serve(request, index)

    @app.get(ASSET_PREFIX + "{path:path}", include_in_schema=False)
    async def asset(request: Request, path: str):
        found = assets.get(ASSET_PREFIX + path)
        if found is None:
            raise APIError(404, f"no such file: {ASSET_PREFIX}{path}", code="not_found")
        return _serve(request, found)
