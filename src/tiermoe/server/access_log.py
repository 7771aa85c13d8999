"""The server's log lines about traffic: one per finished generation, and a throughput line.

A user of vLLM or llama-server expects to see in the log that a request came and went, and how
fast the server runs while busy. Two loggers, so that either can be switched off on its own
(`tiermoe serve --disable-log-requests`, `--disable-log-stats`, as vLLM names them); the
throughput line is written by live_stats.ThroughputLog, from the same snapshots as the
dashboard's stream:

  tiermoe.server.requests  one INFO line per finished choice: its id (the request's, with the
                           choice's index for chat completions), route, prompt tokens
                           (cached among them), completion tokens, finish reason, seconds, the
                           decode rate after the first token, the time to the first token
  tiermoe.server.stats     every STATS_LOG_INTERVAL_S while there is traffic (and once after it
                           stops), vLLM's line: average prompt and generation throughput over the
                           interval, running and waiting requests, KV cache usage, and for packed
                           stores the expert picks per decode token: slot hits and slot misses,
                           the latter split into host-tier hits and disk reads

Tier figures come from the engine's cumulative counters, so they are per interval, not per
request: a batched step serves the experts of all its requests at once.
"""

from __future__ import annotations

import logging
import time

REQUESTS_LOGGER = "tiermoe.server.requests"
STATS_LOGGER = "tiermoe.server.stats"
STATS_LOG_INTERVAL_S = 10.0  # vLLM's default interval
ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "messages": "/v1/messages",
          "responses": "/v1/responses"}

request_log = logging.getLogger(REQUESTS_LOGGER)
stats_log = logging.getLogger(STATS_LOGGER)


def log_finished(run) -> None:
    """The access line of one finished choice (a generation.ChoiceRun)."""
    if not request_log.isEnabledFor(logging.INFO):
        return
    now = time.monotonic()
    route = ROUTES.get(run.endpoint, run.endpoint)
    parts = [f"prompt {run.prompt_tokens} tokens ({run.cached_tokens} cached)",
             f"completion {run.completion_tokens} tokens", f"finish {run.finish_reason}",
             f"{now - run.t_submit:.2f} s"]
    if run.t_first is not None:
        decode_s = now - run.t_first
        if run.completion_tokens > 1 and decode_s > 0:
            parts.append(f"{(run.completion_tokens - 1) / decode_s:.1f} tok/s")
        parts.append(f"first token {run.t_first - run.t_submit:.2f} s")
    if run.error:
        parts.append(f"error: {run.error}")
    request_log.info("%s %s: %s", run.request_id, route, ", ".join(parts))
