"""ServerMetrics: what ``GET /metrics`` shows, in Prometheus' text format.

Latencies and token counts are observed by the engine thread as tokens are handed out; the
engine's own counters (KV blocks, prefix-cache hits, speculative acceptance, graph misses) are
read from the snapshot the engine thread takes after every step, so a scrape never touches the
engine itself. Each server has its own registry (several can live in one process, as in tests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# seconds; decode steps of small models take milliseconds, prefills of long prompts seconds
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# engine snapshot key -> (metric name, help, kind)
_ENGINE_METRICS = {
    "requests_running": ("graphrt_requests_running", "Requests in the running batch.", "gauge"),
    "requests_waiting": ("graphrt_requests_waiting", "Requests waiting to be scheduled.", "gauge"),
    "used_blocks": ("graphrt_kv_blocks_used", "KV-cache blocks in use.", "gauge"),
    "free_blocks": ("graphrt_kv_blocks_free", "KV-cache blocks free (cached prefixes included).", "gauge"),
    "total_blocks": ("graphrt_kv_blocks_total", "KV-cache blocks in all.", "gauge"),
    "warmed_blocks": ("graphrt_kv_blocks_warmed", "KV-cache blocks faulted in (null block too).", "gauge"),
    "prefix_cache_hits": ("graphrt_prefix_cache_hit_blocks", "KV blocks reused from the prefix cache.", "counter"),
    "preemptions": ("graphrt_preemptions", "Requests preempted for lack of KV blocks.", "counter"),
    "graph_hits": ("graphrt_graph_hits", "Steps replayed by a compiled graph.", "counter"),
    "graph_misses": ("graphrt_graph_misses", "Steps no compiled graph served (run eagerly).", "counter"),
    "compiles": ("graphrt_graph_compiles", "Graphs compiled since start.", "counter"),
    "spec_draft_tokens": ("graphrt_spec_draft_tokens", "Speculative draft tokens scored.", "counter"),
    "spec_accepted_tokens": ("graphrt_spec_accepted_tokens", "Speculative draft tokens accepted.", "counter"),
    "spec_acceptance_rate": ("graphrt_spec_acceptance_rate", "Accepted over scored drafts.", "gauge"),
}


class _EngineCollector:
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.snapshot = snapshot

    def collect(self):
        stats = dict(self.snapshot())
        if "total_blocks" in stats and "free_blocks" in stats:
            stats["used_blocks"] = stats["total_blocks"] - stats["free_blocks"]
        for key, (name, doc, kind) in _ENGINE_METRICS.items():
            if key not in stats:
                continue
            family = GaugeMetricFamily(name, doc) if kind == "gauge" else CounterMetricFamily(name, doc)
            family.add_metric([], float(stats[key]))
            yield family


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("graphrt_prompt_tokens", "Prompt tokens admitted.", registry=r)
        self.generation_tokens = Counter("graphrt_generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter(
            "graphrt_requests_finished", "Requests finished, by reason.", ["finish_reason"], registry=r
        )
        self.http_errors = Counter("graphrt_http_errors", "Requests refused, by status.", ["status"], registry=r)
        self.step_errors = Counter("graphrt_engine_step_errors", "Engine steps that failed.", registry=r)
        self.ttft = Histogram(
            "graphrt_time_to_first_token_seconds",
            "From a request's arrival to its first token.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "graphrt_inter_token_latency_seconds",
            "Time between a request's tokens (a step's tokens share its time).",
            buckets=_ITL_BUCKETS,
            registry=r,
        )

    def watch_engine(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(_EngineCollector(snapshot))

    def observe_tokens(self, arrival: float, last: float | None, now: float, count: int) -> None:
        self.generation_tokens.inc(count)
        if last is None:
            self.ttft.observe(now - arrival)
            count -= 1
            last = now
        for _ in range(count):
            self.itl.observe((now - last) / max(count, 1))

    def finished(self, reason: str | None) -> None:
        self.requests.labels(finish_reason=reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
