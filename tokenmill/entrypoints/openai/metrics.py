"""Prometheus metrics with vLLM's names under `tokenmill:`, in a registry owned by one app.

Front-end figures (tokens, latencies, finished requests) are recorded as requests run;
engine-side gauges and counters are pulled from the engine core on each scrape.

Speculative decoding counters (vLLM's `spec_decode_*` names) exist only on a server started with
a speculative config, as in vLLM (whose fix for vllm-project/vllm#15958 stopped exporting them
without one): a dashboard can tell "speculation off" from "nothing accepted yet". With it, every
draft position's series is there from the first scrape, zeros included, so `rate()` over a
window that starts at zero sees the first acceptances.
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


SPEC_DRAFTS = "tokenmill:spec_decode_num_drafts"
SPEC_DRAFT_TOKENS = "tokenmill:spec_decode_num_draft_tokens"
SPEC_ACCEPTED = "tokenmill:spec_decode_num_accepted_tokens"
SPEC_ACCEPTED_PER_POS = "tokenmill:spec_decode_num_accepted_tokens_per_pos"  # label `position`: 0 .. k-1


class _EngineCollector(Collector):
    """Exposes the latest engine stats snapshot (set by `ServerMetrics.update_engine`)."""

    def __init__(self, model_name: str, num_speculative_tokens: int) -> None:
        self.model_name = model_name
        self.num_speculative_tokens = num_speculative_tokens
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
        if self.num_speculative_tokens:
            yield from self._spec_counters(s, labels)

    def _spec_counters(self, s: dict, labels: list[str]) -> Iterator:
        for name, text, value in (
                (SPEC_DRAFTS, "Verified steps of a request with at least one draft token.", s["spec_num_drafts"]),
                (SPEC_DRAFT_TOKENS, "Draft tokens verified.", s["spec_num_draft_tokens"]),
                (SPEC_ACCEPTED, "Draft tokens accepted.", s["spec_num_accepted_tokens"])):
            counter = CounterMetricFamily(name, text, labels=["model_name"])
            counter.add_metric(labels, value)
            yield counter
        per_position = CounterMetricFamily(SPEC_ACCEPTED_PER_POS, "Draft tokens accepted, by draft position.",
                                           labels=["model_name", "position"])
        accepted = s["spec_accepted_per_position"]
        for position in range(self.num_speculative_tokens):
            per_position.add_metric([*labels, str(position)], accepted[position] if position < len(accepted) else 0)
        yield per_position


class ServerMetrics:
    def __init__(self, model_name: str, num_speculative_tokens: int = 0) -> None:
        """`num_speculative_tokens`: k of the engine's speculative config (0: none)."""
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
        self._structured = Counter("tokenmill:structured_output_requests",
                                   "Requests whose output is constrained (a JSON schema, regex, choice, grammar or "
                                   "forced tool call).", labels, registry=r)
        self._compile = Histogram("tokenmill:grammar_compile_seconds", "Grammar compilation time (front-end "
                                  "check; a cached grammar is not compiled again).", labels,
                                  buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0), registry=r)
        self._engine = _EngineCollector(model_name, num_speculative_tokens)
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

    def structured_request(self) -> None:
        self._structured.labels(self.model_name).inc()

    def grammar_compiled(self, seconds: float) -> None:
        self._compile.labels(self.model_name).observe(seconds)

    def update_engine(self, scheduler_stats: dict) -> None:
        self._engine.sched = scheduler_stats

    def render(self) -> bytes:
        return generate_latest(self.registry)
