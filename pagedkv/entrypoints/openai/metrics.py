"""GET /metrics: the engine's state and the requests' latencies in Prometheus' text format.

The names are vLLM's (vllm/v1/metrics/loggers.py) with the prefix `pagedkv:`. Two kinds of numbers:
the engine's state (requests running and waiting, KV cache usage, prefix-cache counters) is read
from the engine when Prometheus scrapes; what happens to each request (time to first token, time
per output token, how it finished) is observed by the server as the request's outputs arrive.
Each server has its own registry, so several can live in one process (the tests start them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedkv.engine.async_llm import EngineSnapshot
from pagedkv.engine.request import CompletionOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""Prometheus' text exposition format."""

# Buckets as vLLM's: from a fast decode step to a long queue.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)


class EngineCollector(Collector):
    """Reads a snapshot of the engine at each scrape, so the numbers are never stale."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str) -> None:
        self.snapshot = snapshot
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        labels = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            metric = GaugeMetricFamily(f"pagedkv:{name}", doc, labels=labels)
            metric.add_metric([self.model_name], value)
            return metric

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            metric = CounterMetricFamily(f"pagedkv:{name}", doc, labels=labels)
            metric.add_metric([self.model_name], value)
            return metric

        yield gauge("num_requests_running", "Requests in the engine's running batch.", s.num_requests_running)
        yield gauge("num_requests_waiting", "Requests waiting or preempted.", s.num_requests_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", s.kv_cache_usage)
        queries, hits = s.num_prefix_cache_queries, s.num_prefix_cache_hits
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits)
        yield gauge("prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries.", s.prefix_cache_hit_rate)
        yield counter(
            "num_preemptions", "Requests preempted (their blocks freed, recomputed later).", s.num_preemptions
        )


class ServerMetrics:
    """The registry behind GET /metrics: the engine's collector and the per-request histograms."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(EngineCollector(snapshot, model_name))
        labels = ["model_name"]
        self.ttft = Histogram(
            "pagedkv:time_to_first_token_seconds",
            "Seconds from a request's arrival to its first output token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "pagedkv:time_per_output_token_seconds",
            "A choice's mean seconds per output token after its first.",
            labels,
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "pagedkv:e2e_request_latency_seconds",
            "Seconds from a request's arrival to its last output.",
            labels,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self.success = Counter(
            "pagedkv:request_success",
            "Choices finished, by finish reason (stop, length, abort).",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "pagedkv:prompt_tokens", "Prompt tokens of the requests started.", labels, registry=self.registry
        )
        self.generation_tokens = Counter(
            "pagedkv:generation_tokens", "Tokens generated.", labels, registry=self.registry
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)


class RequestTracker:
    """One HTTP request's timings: its arrival, its first token, each choice's first token and end."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self.choice_first_token: dict[int, float] = {}
        self.finished: set[int] = set()

    def start(self, num_prompt_tokens: int) -> None:
        self.metrics.prompt_tokens.labels(self.metrics.model_name).inc(num_prompt_tokens)

    def observe(self, index: int, completion: CompletionOutput) -> None:
        """Choice `index` now holds `completion` (cumulative)."""
        if index in self.finished or not completion.token_ids:
            return
        now = time.monotonic()
        name = self.metrics.model_name
        if self.first_token is None:
            self.first_token = now
            self.metrics.ttft.labels(name).observe(now - self.arrival)
        first = self.choice_first_token.setdefault(index, now)
        if completion.finish_reason is not None:
            self.finished.add(index)
            num_tokens = len(completion.token_ids)
            if num_tokens > 1:
                self.metrics.tpot.labels(name).observe((now - first) / (num_tokens - 1))
            self.metrics.generation_tokens.labels(name).inc(num_tokens)
            self.metrics.success.labels(name, completion.finish_reason).inc()

    def end(self, num_choices: int) -> None:
        """The HTTP request is over: answered, or its client went away (its unfinished choices were
        aborted, and count as such)."""
        name = self.metrics.model_name
        self.metrics.e2e.labels(name).observe(time.monotonic() - self.arrival)
        for index in range(num_choices):
            if index not in self.finished:
                self.finished.add(index)
                self.metrics.success.labels(name, "abort").inc()
