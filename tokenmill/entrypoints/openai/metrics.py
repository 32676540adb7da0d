"""Prometheus metrics with vLLM's names under `tokenmill:`, in a registry owned by one app.

Front-end figures (tokens, latencies, finished requests) are recorded as requests run;
engine-side gauges and counters are pulled from the engine core on each scrape.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0)


class _EngineCollector(Collector):
    """Exposes the latest engine stats snapshot (set by `ServerMetrics.update_engine`)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.sched: dict | None = None

    def collect(self) -> Iterator:
        if self.sched is None:
            return
        s, labels = self.sched, [self.model_name]
        for name, text, value in (
                ("num_requests_running", "Requests in the running batch.", s["num_running"]),
                ("num_requests_waiting", "Requests waiting to be scheduled.", s["num_waiting"]),
                ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", s["kv_cache_usage"])):
            gauge = GaugeMetricFamily(f"tokenmill:{name}", text, labels=["model_name"])
            gauge.add_metric(labels, value)
            yield gauge
        for name, text, value in (
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s["prefix_cache_queries"]),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s["prefix_cache_hits"]),
                ("num_preemptions", "Preemptions by the scheduler.", s["num_preemptions"])):
            counter = CounterMetricFamily(f"tokenmill:{name}", text, labels=["model_name"])
            counter.add_metric(labels, value)
            yield counter


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry
        self._prompt_tokens = Counter("tokenmill:prompt_tokens", "Prefill tokens processed.", labels, registry=r)
        self._generation_tokens = Counter("tokenmill:generation_tokens", "Generated tokens.", labels, registry=r)
        self._success = Counter("tokenmill:request_success", "Finished requests, by finish reason.",
                                labels + ["finished_reason"], registry=r)
        self._ttft = Histogram("tokenmill:time_to_first_token_seconds", "Time to first token.", labels,
                               buckets=_LATENCY_BUCKETS, registry=r)
        self._itl = Histogram("tokenmill:inter_token_latency_seconds", "Time between successive outputs.",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self._e2e = Histogram("tokenmill:e2e_request_latency_seconds", "Request latency, arrival to finish.",
                              labels, buckets=_E2E_BUCKETS, registry=r)
        self._engine = _EngineCollector(model_name)
        r.register(self._engine)
        self.model_name = model_name

    def prompt_tokens(self, n: int) -> None:
        self._prompt_tokens.labels(self.model_name).inc(n)

    def generation_tokens(self, n: int) -> None:
        self._generation_tokens.labels(self.model_name).inc(n)

    def first_token(self, seconds: float) -> None:
        self._ttft.labels(self.model_name).observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self._itl.labels(self.model_name).observe(seconds)

    def finished(self, reason: str, e2e_seconds: float) -> None:
        self._success.labels(self.model_name, reason).inc()
        self._e2e.labels(self.model_name).observe(e2e_seconds)

    def update_engine(self, scheduler_stats: dict) -> None:
        self._engine.sched = scheduler_stats

    def render(self) -> bytes:
        return generate_latest(self.registry)
