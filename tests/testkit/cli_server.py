"""`tiermoe serve ...` in a child process, as a user starts it: waits for /health, keeps stderr."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import httpx

from testkit.servers import free_port


class CliServer:
    """Context manager: starts `python -m tiermoe.cli serve ARGS --port P`, waits until /health
    answers 200 (or the process exits: then `returncode` is set and `stderr` says why)."""

    def __init__(self, args: list[str], env: dict[str, str], startup_s: float = 180.0, cwd: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "tiermoe.cli", "serve", *args, "--port", str(self.port)]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
        self.startup_s, self.cwd = startup_s, cwd
        self.returncode: int | None = None
        self._err: list[str] = []

    @property
    def stderr(self) -> str:
        return "".join(self._err)

    def __enter__(self) -> CliServer:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=self.env, cwd=self.cwd)
        threading.Thread(target=lambda: self._err.extend(self.proc.stderr), daemon=True).start()
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            self.returncode = self.proc.poll()
            if self.returncode is not None:
                self.proc.wait()
                time.sleep(0.2)  # let the reader thread collect the last lines
                return self
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"tiermoe serve did not become healthy: {self.stderr[-2000:]}")

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
