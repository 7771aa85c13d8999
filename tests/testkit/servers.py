"""A real uvicorn server in a background thread of the test process, on a free local port."""

from __future__ import annotations

import asyncio
import socket
import threading
import time


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn.Server running `app` in its own thread and event loop; `url` once started.

    Use as a context manager: entering starts the server and waits until it accepts
    connections (or raises if it dies or takes longer than `startup_s`); leaving asks it to
    shut down gracefully. `app` is kept so tests can reach `app.state`."""

    def __init__(self, app, *, log_level: str = "warning", startup_s: float = 30.0):
        import uvicorn

        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level=log_level, lifespan="on",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.app = app
        self.startup_s = startup_s
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + self.startup_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
