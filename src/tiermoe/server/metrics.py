"""Prometheus metrics and the /stats summary.

Each app owns a CollectorRegistry (several servers can live in one test process). Request
level figures (TTFT, inter-token latency, tokens, outcomes) are recorded by the server as they
happen; engine figures (KV usage, queue, per-tier expert hits and misses) come from the
engine's `stats()` snapshot taken at scrape time and are exported by `EngineCollector`.

Engine stats keys understood (all optional): kv_usage (0..1) and the expert store's block,
`experts` (or `tiers`): {tier: {"hits": n, "misses": n, ...}, "disk": {"reads": n, ...},
"decode_tokens": n, "per_decode_token": {name: x}}. Any other top-level number is exported
as a gauge `tiermoe_engine_<key>`.

Speculative decoding (`speculative`: the MTP drafter's counters, present only with drafting on)
is exported under vLLM's names with our prefix, so dashboards built for
`vllm:spec_decode_*` map one to one: `tiermoe_spec_decode_num_drafts_total` (verify steps),
`..._num_draft_tokens_total`, `..._num_accepted_tokens_total`,
`..._num_accepted_tokens_per_pos_total{position}`, `..._num_emitted_tokens_total`, and the
gauges `..._draft_acceptance_rate` and `..._num_speculative_tokens`.
"""

from __future__ import annotations

import re
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tiermoe.server.access_log import log_finished

disable_created_metrics()  # the *_created series only add noise to every scrape

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5)
_E2E_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


def _percentile(values, q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def expert_tiers(snap: dict) -> dict[str, dict[str, float]]:
    """{tier: {"hits", "misses"}} from the engine's expert counters (disk reads count as disk hits)."""
    block = snap.get("experts") if isinstance(snap.get("experts"), dict) else snap.get("tiers")
    tiers: dict[str, dict[str, float]] = {}
    for tier, row in (block or {}).items():
        if not isinstance(row, dict):
            continue
        entry = {k: float(row[k]) for k in ("hits", "misses") if _num(row.get(k))}
        if not entry and _num(row.get("reads")):
            entry = {"hits": float(row["reads"])}
        if entry:
            tiers[str(tier)] = entry
    return tiers


def _num(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class EngineCollector:
    """Exports the latest engine stats snapshot (refreshed by the /metrics handler)."""

    def __init__(self):
        self.snapshot: dict = {}

    def collect(self):
        snap = self.snapshot
        kv = GaugeMetricFamily("tiermoe_kv_cache_usage_ratio", "Fraction of KV cache pages in use")
        if isinstance(snap.get("kv_usage"), (int, float)):
            kv.add_metric([], float(snap["kv_usage"]))
        yield kv
        hits = CounterMetricFamily("tiermoe_expert_hits", "Routed-expert picks served by each tier", labels=["tier"])
        misses = CounterMetricFamily("tiermoe_expert_misses", "Routed-expert picks each tier had to fetch",
                                     labels=["tier"])
        for tier, row in expert_tiers(snap).items():
            if "hits" in row:
                hits.add_metric([tier], row["hits"])
            if "misses" in row:
                misses.add_metric([tier], row["misses"])
        yield hits
        yield misses
        experts = snap.get("experts") if isinstance(snap.get("experts"), dict) else {}
        per_tok = GaugeMetricFamily("tiermoe_expert_per_decode_token", "Expert-store events per decode token",
                                    labels=["kind"])
        for kind, value in (experts.get("per_decode_token") or {}).items():
            if _num(value):
                per_tok.add_metric([str(kind)], float(value))
        yield per_tok
        spec = snap.get("speculative")
        if isinstance(spec, dict):
            yield from _spec_decode_families(spec)
        for key, value in snap.items():
            if key == "kv_usage" or not _num(value):
                continue
            name = "tiermoe_engine_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
            g = GaugeMetricFamily(name, f"engine stat {key}")
            g.add_metric([], float(value))
            yield g


_SPEC_COUNTERS = (  # (name after tiermoe_spec_decode_, drafter stats key, help)
    ("num_drafts", "verify_steps", "Draft runs verified by the trunk (one per drafting request per step)"),
    ("num_draft_tokens", "drafted", "Draft tokens proposed by the MTP head"),
    ("num_accepted_tokens", "accepted", "Draft tokens the trunk accepted"),
    ("num_emitted_tokens", "emitted", "Tokens emitted by verify steps (accepted drafts plus the trunk's own)"),
)


def _spec_decode_families(spec: dict):
    """The MTP drafter's counters as Prometheus families (see the module docstring)."""
    for name, key, doc in _SPEC_COUNTERS:
        if _num(spec.get(key)):
            c = CounterMetricFamily(f"tiermoe_spec_decode_{name}", doc)
            c.add_metric([], float(spec[key]))
            yield c
    per_pos = spec.get("accepted_per_position")
    if isinstance(per_pos, list):
        c = CounterMetricFamily("tiermoe_spec_decode_num_accepted_tokens_per_pos",
                                "Accepted draft tokens by draft position (0: the first draft)", labels=["position"])
        for pos, value in enumerate(per_pos):
            if _num(value):
                c.add_metric([str(pos)], float(value))
        yield c
    for name, key, doc in (
        ("draft_acceptance_rate", "acceptance_rate", "Accepted / drafted tokens since start"),
        ("num_speculative_tokens", "num_speculative_tokens", "Draft tokens per verify step (configured)"),
    ):
        if _num(spec.get(key)):
            g = GaugeMetricFamily(f"tiermoe_spec_decode_{name}", doc)
            g.add_metric([], float(spec[key]))
            yield g


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tiermoe_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.finished = Counter("tiermoe_request_finished", "Finished generations by reason", ["reason"], registry=r)
        self.ttft = Histogram("tiermoe_time_to_first_token_seconds", "Time to first token", buckets=_TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("tiermoe_inter_token_latency_seconds", "Time between tokens", buckets=_ITL_BUCKETS,
                             registry=r)
        self.e2e = Histogram("tiermoe_e2e_request_latency_seconds", "Whole generation latency", buckets=_E2E_BUCKETS,
                             registry=r)
        self.prompt_tokens = Counter("tiermoe_prompt_tokens", "Prompt tokens processed", registry=r)
        self.cached_tokens = Counter("tiermoe_prompt_tokens_cached", "Prompt tokens served from the prefix cache",
                                     registry=r)
        self.generation_tokens = Counter("tiermoe_generation_tokens", "Tokens generated", registry=r)
        self.running = Gauge("tiermoe_requests_running", "Requests the engine is running", registry=r)
        self.waiting = Gauge("tiermoe_requests_waiting", "Requests waiting for a running slot", registry=r)
        self.rejected = Counter("tiermoe_requests_rejected", "Requests refused because the queue was full", registry=r)
        self.structured_invalid = Counter(
            "tiermoe_structured_output_invalid", "Outputs that did not satisfy their response_format", registry=r
        )
        self.engine = EngineCollector()
        r.register(self.engine)
        self.started = time.time()
        self._recent_ttft: deque[float] = deque(maxlen=1024)
        self._recent_itl: deque[float] = deque(maxlen=8192)
        self.totals = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "generation_tokens": 0, "errors": 0,
                       "aborted": 0}

    # ---- recording -------------------------------------------------------------------------
    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self._recent_ttft.append(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self._recent_itl.append(seconds)

    def observe_finish(self, run) -> None:
        """A choice finished (or was aborted): counters, and its access log line (access_log.py)."""
        log_finished(run)
        self.finished.labels(run.finish_reason or "unknown").inc()
        self.e2e.observe(time.monotonic() - run.t_submit)
        self.prompt_tokens.inc(run.prompt_tokens)
        self.cached_tokens.inc(run.cached_tokens)
        self.generation_tokens.inc(run.completion_tokens)
        self.totals["prompt_tokens"] += run.prompt_tokens
        self.totals["cached_tokens"] += run.cached_tokens
        self.totals["generation_tokens"] += run.completion_tokens
        if run.finish_reason == "error":
            self.totals["errors"] += 1
        elif run.finish_reason == "abort":
            self.totals["aborted"] += 1

    def observe_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.totals["requests"] += 1

    # ---- export --------------------------------------------------------------------------------
    def render(self, engine_stats: dict, running: int, waiting: int) -> bytes:
        self.engine.snapshot = engine_stats
        self.running.set(running)
        self.waiting.set(waiting)
        return generate_latest(self.registry)

    def summary(self, engine_stats: dict, running: int, waiting: int) -> dict:
        ttft, itl = list(self._recent_ttft), list(self._recent_itl)
        out = {
            "uptime_s": round(time.time() - self.started, 3),
            "requests_running": running,
            "requests_waiting": waiting,
            **self.totals,
            "ttft_s": {"p50": _percentile(ttft, 0.5), "p90": _percentile(ttft, 0.9), "n": len(ttft)},
            "inter_token_latency_s": {"p50": _percentile(itl, 0.5), "p90": _percentile(itl, 0.9), "n": len(itl)},
        }
        tiers = expert_tiers(engine_stats)
        if tiers:
            out["expert_tiers"] = tiers
            block = engine_stats.get("experts") or engine_stats.get("tiers") or {}
            decode = block.get("decode_tokens", engine_stats.get("decode_tokens"))
            if _num(decode) and decode > 0:
                out["expert_tiers_per_decode_token"] = {
                    tier: {k: v / decode for k, v in row.items()} for tier, row in tiers.items()
                }
        return out
