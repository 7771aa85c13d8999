"""A Hugging Face Hub without a network: the cache layout huggingface_hub reads, and a stub server.

`cache_repo` lays a checkpoint out as `snapshot_download` leaves it in the Hub cache
(models--ORG--NAME/refs/REVISION holding a commit, snapshots/COMMIT/ holding the files), so with
HF_HUB_OFFLINE=1 the real huggingface_hub code finds it there. `StubHub` answers the Hub's API
with the status and X-Error-Code header the real Hub sends for a missing repository or
revision, so the error paths run through huggingface_hub's own error mapping.
"""

from __future__ import annotations

import http.server
import shutil
import threading
from pathlib import Path


def cache_repo(hub_cache: Path, repo_id: str, source: Path, *, revision: str = "main",
               commit: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """Copy checkpoint `source` into `hub_cache` as repo `repo_id` at `revision`; returns the snapshot."""
    repo = Path(hub_cache) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    if not snapshot.exists():
        shutil.copytree(source, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot


class StubHub:
    """An HTTP server on 127.0.0.1 answering every request with `status` and `error_code`."""

    def __init__(self, status: int = 404, error_code: str = "RepoNotFound"):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's naming)
                self.send_response(status)
                self.send_header("X-Error-Code", error_code)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"error": "stub"}')

            do_HEAD = do_GET  # noqa: N815

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StubHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
