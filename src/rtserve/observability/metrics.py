"""Prometheus metrics. Label children are resolved once per model version and kept, so an
observation on the hot path is a plain method call (~1 µs)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from rtserve.protocol.types import Timings

LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
OUTCOMES = ("success", "client_error", "not_found", "overloaded", "timeout", "error")


@dataclass(slots=True)
class StatDuration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int) -> None:
        self.count += 1
        self.ns += ns


@dataclass(slots=True)
class ModelStats:
    """Triton-style statistics of one model version (served by the statistics extension)."""

    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    success: StatDuration = field(default_factory=StatDuration)
    fail: StatDuration = field(default_factory=StatDuration)
    queue: StatDuration = field(default_factory=StatDuration)
    compute_infer: StatDuration = field(default_factory=StatDuration)
    cache_hit: StatDuration = field(default_factory=StatDuration)
    cache_miss: StatDuration = field(default_factory=StatDuration)
    batch_sizes: dict[int, StatDuration] = field(default_factory=dict)


class ModelMetrics:
    """The label children and statistics of one model version."""

    def __init__(self, metrics: Metrics, model: str, version: str) -> None:
        labels = (model, version)
        self.outcome = {o: metrics.requests.labels(model, version, o) for o in OUTCOMES}
        self.e2e = metrics.request_latency.labels(*labels)
        self.queue = metrics.queue_latency.labels(*labels)
        self.compute = metrics.compute_latency.labels(*labels)
        self.batch_size = metrics.batch_size.labels(*labels)
        self.queue_depth = metrics.queue_depth.labels(*labels)
        self.stats = ModelStats()

    def observe_batch(self, rows: int, compute_ns: int) -> None:
        self.batch_size.observe(rows)
        stats = self.stats
        stats.execution_count += 1
        stats.compute_infer.add(compute_ns)
        by_size = stats.batch_sizes.get(rows)
        if by_size is None:
            by_size = stats.batch_sizes[rows] = StatDuration()
        by_size.add(compute_ns)

    def observe_success(self, t: Timings, rows: int, end_ns: int) -> None:
        self.outcome["success"].inc()
        total = end_ns - t.received
        self.e2e.observe(total / 1e9)
        stats = self.stats
        stats.inference_count += rows
        stats.success.add(total)
        if t.batch_start:
            queued = t.batch_start - t.enqueued
            self.queue.observe(queued / 1e9)
            self.compute.observe((t.batch_end - t.batch_start) / 1e9)
            stats.queue.add(queued)
            if t.cache:
                stats.cache_miss.add(total)
        elif t.cache:
            stats.cache_hit.add(total)

    def observe_failure(self, outcome: str, t: Timings, end_ns: int) -> None:
        self.outcome[outcome].inc()
        self.stats.fail.add(end_ns - t.received)

    def track_queue_depth(self, depth: Callable[[], float]) -> None:
        self.queue_depth.set_function(depth)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        labels = ["model", "version"]
        self.requests = Counter(
            "rtserve_requests", "Inference requests by outcome", [*labels, "outcome"], registry=r
        )
        self.request_latency = Histogram(
            "rtserve_request_duration_seconds",
            "End-to-end latency inside the server (decode to encoded response)",
            labels, buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_latency = Histogram(
            "rtserve_queue_duration_seconds", "Time from admission to the start of its batch",
            labels, buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.compute_latency = Histogram(
            "rtserve_compute_duration_seconds", "Model run time of the request's batch",
            labels, buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_size = Histogram(
            "rtserve_batch_size", "Rows per executed batch", labels,
            buckets=BATCH_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_depth = Gauge(
            "rtserve_queue_depth", "Requests waiting in the model's queue", labels, registry=r
        )
        self.unrouted = Counter(
            "rtserve_unrouted_requests",
            "Inference requests rejected before reaching a model (unknown model, bad body)",
            ["reason"], registry=r,
        )  # fmt: skip
        self._models: dict[tuple[str, str], ModelMetrics] = {}

    def model(self, model: str, version: str) -> ModelMetrics:
        key = (model, version)
        found = self._models.get(key)
        if found is None:
            found = self._models[key] = ModelMetrics(self, model, version)
        return found

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def server_timing(t: Timings, end_ns: int) -> str:
    """The ``Server-Timing`` header value: per-stage durations in milliseconds."""
    parts = []
    if t.batch_start:
        parts.append(f"queue;dur={(t.batch_start - t.enqueued) / 1e6:.3f}")
        parts.append(f"compute;dur={(t.batch_end - t.batch_start) / 1e6:.3f}")
        parts.append(f"batch;desc={t.batch_size}")
    if t.cache:
        parts.append(f"cache;desc={t.cache}")
    parts.append(f"total;dur={(end_ns - t.received) / 1e6:.3f}")
    return ", ".join(parts)
