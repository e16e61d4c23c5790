"""Prometheus metrics.

The hot path records into plain per-model-version accumulators (an integer increment and
a ``bisect`` per histogram, all on the event-loop thread, no locks); a custom collector
turns them into Prometheus counters, gauges and histograms when ``/metrics`` is scraped.
This keeps per-request metrics at well under a microsecond, where ``Histogram.observe``
with its lock and linear bucket scan costs several.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from rtserve.errors import DeadlineExceeded, ModelNotFound, Overloaded, RTServeError, ShuttingDown
from rtserve.protocol.types import Timings

LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
OUTCOMES = ("success", "client_error", "not_found", "overloaded", "timeout", "error")


def outcome_of(exc: BaseException) -> str:
    """The ``outcome`` label of a failed request."""
    if isinstance(exc, Overloaded | ShuttingDown):
        return "overloaded"
    if isinstance(exc, DeadlineExceeded):
        return "timeout"
    if isinstance(exc, ModelNotFound):
        return "not_found"
    if isinstance(exc, RTServeError) and exc.http_status < 500:
        return "client_error"
    return "error"


class Accumulator:
    """Histogram counts for one label set: one bisect and two additions per observation."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, float]]:
        out = []
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            out.append((repr(float(bound)), float(running)))
        out.append(("+Inf", float(running + self.counts[-1])))
        return out


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


@dataclass(frozen=True, slots=True)
class VersionStatistics:
    name: str
    version: str
    stats: ModelStats


class SchedulerStats:
    """What the batcher decides: requests shed before running (by reason and priority) and,
    for a model with a latency objective, the controller's predictions and choices."""

    __slots__ = (
        "shed", "objective_ns", "goodput", "predicted", "observed", "window_ns", "target",
        "budget_factor", "overdue_batches", "reruns",
    )  # fmt: skip

    def __init__(self) -> None:
        self.shed: dict[tuple[str, int], int] = {}
        self.objective_ns = 0  # p99 objective; 0: the model has none
        self.goodput = 0  # answers within the objective
        self.predicted = Accumulator(LATENCY_BUCKETS)  # admission to batch end, as predicted
        self.observed = Accumulator(LATENCY_BUCKETS)  # the same span, as it happened
        self.window_ns = 0  # the controller's last gathering window
        self.target = 0  # the controller's last target batch (rows)
        self.budget_factor = 1.0  # the share of the budget it plans with (latency feedback)
        self.overdue_batches = 0  # batches run from a frontend callback (waited too long)
        self.reruns = 0  # failed batches run again one request at a time

    def count_shed(self, reason: str, priority: int) -> None:
        key = (reason, priority)
        self.shed[key] = self.shed.get(key, 0) + 1


class ModelMetrics:
    """Everything measured about one model version."""

    def __init__(self, model: str, version: str) -> None:
        self.labels = (model, version)
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.client_requests = 0  # sent by clients: an ensemble's step requests are not
        self.e2e = Accumulator(LATENCY_BUCKETS)
        self.queue = Accumulator(LATENCY_BUCKETS)
        self.compute = Accumulator(LATENCY_BUCKETS)
        self.batch_size = Accumulator(BATCH_BUCKETS)
        self.queue_depth: Callable[[], float] = lambda: 0.0
        # An early-exit model's answers per exit depth, read when scraped (None: no exits).
        self.exits: Callable[[], dict[int, int]] | None = None
        self.stats = ModelStats()
        self.scheduler = SchedulerStats()

    def observe_batch(self, rows: int, compute_ns: int) -> None:
        self.batch_size.observe(rows)
        stats = self.stats
        stats.execution_count += 1
        stats.last_inference_ms = time.time_ns() // 1_000_000
        by_size = stats.batch_sizes.get(rows)
        if by_size is None:
            by_size = stats.batch_sizes[rows] = StatDuration()
        by_size.add(compute_ns)

    def observe_success(self, t: Timings, rows: int, end_ns: int) -> None:
        self.outcomes["success"] += 1
        total = end_ns - t.received
        self.e2e.observe(total * 1e-9)
        objective = self.scheduler.objective_ns
        if objective and total <= objective:
            self.scheduler.goodput += 1
        stats = self.stats
        stats.inference_count += rows
        stats.success.add(total)
        if t.batch_start:
            queued = t.batch_start - t.enqueued
            self.queue.observe(queued * 1e-9)
            computed = t.batch_end - t.batch_start
            self.compute.observe(computed * 1e-9)
            # per request, as success and queue are (Triton's statistics): each request
            # of a batch reports the batch's compute time; batch_stats count batches
            stats.compute_infer.add(computed)
            stats.queue.add(queued)
            if t.cache:
                stats.cache_miss.add(total)
        elif t.cache:
            stats.cache_hit.add(total)

    def observe_failure(self, outcome: str, t: Timings, end_ns: int) -> None:
        self.outcomes[outcome] += 1
        self.stats.fail.add(end_ns - t.received)

    def track_queue_depth(self, depth: Callable[[], float]) -> None:
        self.queue_depth = depth

    def track_exits(self, counts: Callable[[], dict[int, int]]) -> None:
        """Read a (new) runtime's exit counts, on top of what earlier loads counted: the
        counter goes on across reloads, like the others."""
        before = self.exits() if self.exits is not None else {}

        def total() -> dict[int, int]:
            now = counts()
            return {d: before.get(d, 0) + now.get(d, 0) for d in sorted({*before, *now})}

        self.exits = total


_HISTOGRAMS = (
    ("rtserve_request_duration_seconds", "e2e",
     "End-to-end latency inside the server (decode to encoded response)"),
    ("rtserve_queue_duration_seconds", "queue", "Time from admission to the start of its batch"),
    ("rtserve_compute_duration_seconds", "compute", "Model run time of the request's batch"),
    ("rtserve_batch_size", "batch_size", "Rows per executed batch"),
)  # fmt: skip


class _ModelCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        models = list(self.metrics.models())
        requests = CounterMetricFamily(
            "rtserve_requests",
            "Inference requests by outcome",
            labels=["model", "version", "outcome"],
        )
        clients = CounterMetricFamily(
            "rtserve_client_requests",
            "Inference requests sent by clients, any outcome (rtserve_requests counts an "
            "ensemble's step requests too, on the step model): what autoscaling follows",
            labels=["model", "version"],
        )
        depth = GaugeMetricFamily(
            "rtserve_queue_depth",
            "Requests waiting in the model's queue",
            labels=["model", "version"],
        )
        for mm in models:
            for outcome, count in mm.outcomes.items():
                requests.add_metric([*mm.labels, outcome], count)
            clients.add_metric(list(mm.labels), mm.client_requests)
            depth.add_metric(list(mm.labels), mm.queue_depth())
        yield requests
        yield clients
        yield depth
        yield _exit_family(models)
        yield from _scheduler_families(models)
        for name, attr, doc in _HISTOGRAMS:
            family = HistogramMetricFamily(name, doc, labels=["model", "version"])
            for mm in models:
                acc: Accumulator = getattr(mm, attr)
                family.add_metric(list(mm.labels), acc.buckets(), acc.sum)
            yield family


def _exit_family(models: list[ModelMetrics]) -> Metric:
    exits = CounterMetricFamily(
        "rtserve_early_exits",
        "Rows answered by an early-exit model, by the backbone depth (layers) of the exit",
        labels=["model", "version", "layer"],
    )
    for mm in models:
        if mm.exits is not None:
            for layer, count in mm.exits().items():
                exits.add_metric([*mm.labels, str(layer)], count)
    return exits


def _scheduler_families(models: list[ModelMetrics]) -> Iterator[Metric]:
    labels = ["model", "version"]
    shed = CounterMetricFamily(
        "rtserve_shed_requests",
        "Requests dropped before their batch ran, by reason (objective, deadline: refused at "
        "admission; expired: deadline passed in the queue; cancelled: client disconnected)",
        labels=[*labels, "reason", "priority"],
    )
    goodput = CounterMetricFamily(
        "rtserve_slo_goodput_requests", "Answers within the latency objective", labels=labels
    )
    objective = GaugeMetricFamily(
        "rtserve_slo_objective_seconds", "The model's p99 latency objective", labels=labels
    )
    window = GaugeMetricFamily(
        "rtserve_slo_window_seconds", "The SLO controller's last gathering window", labels=labels
    )
    target = GaugeMetricFamily(
        "rtserve_slo_target_batch_rows", "The SLO controller's target batch size", labels=labels
    )
    factor = GaugeMetricFamily(
        "rtserve_slo_budget_factor",
        "The share of the latency budget the SLO controller admits and gathers within (cut "
        "when admitted requests finish late, restored while they do not)",
        labels=labels,
    )
    overdue = CounterMetricFamily(
        "rtserve_slo_overdue_batches",
        "Batches of an inline model run from a frontend callback because their oldest "
        "request had waited a quarter of the budget (the event loop was saturated)",
        labels=labels,
    )
    predicted = HistogramMetricFamily(
        "rtserve_slo_predicted_seconds",
        "Predicted time from admission to the end of the request's batch",
        labels=labels,
    )
    observed = HistogramMetricFamily(
        "rtserve_slo_observed_seconds",
        "Observed time from admission to the end of the request's batch (same requests)",
        labels=labels,
    )
    reruns = CounterMetricFamily(
        "rtserve_batch_reruns",
        "Batches of several requests that failed and were run again one request at a time "
        "(so that one request's bad data fails only that request)",
        labels=labels,
    )
    for mm in models:
        st = mm.scheduler
        reruns.add_metric(list(mm.labels), st.reruns)
        for (reason, priority), count in st.shed.items():
            shed.add_metric([*mm.labels, reason, str(priority)], count)
        if st.objective_ns:
            goodput.add_metric(list(mm.labels), st.goodput)
            objective.add_metric(list(mm.labels), st.objective_ns * 1e-9)
            window.add_metric(list(mm.labels), st.window_ns * 1e-9)
            target.add_metric(list(mm.labels), st.target)
            factor.add_metric(list(mm.labels), st.budget_factor)
            overdue.add_metric(list(mm.labels), st.overdue_batches)
            predicted.add_metric(list(mm.labels), st.predicted.buckets(), st.predicted.sum)
            observed.add_metric(list(mm.labels), st.observed.buckets(), st.observed.sum)
    yield from (
        shed, reruns, goodput, objective, window, target, factor, overdue, predicted, observed,
    )  # fmt: skip


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._models: dict[tuple[str, str], ModelMetrics] = {}
        self.registry.register(_ModelCollector(self))
        # Collectors other parts register once (by name), e.g. generative models' metrics.
        self.collectors: dict[str, Collector] = {}
        self.unrouted = Counter(
            "rtserve_unrouted_requests",
            "Inference requests rejected before reaching a model (unknown model, bad body)",
            ["reason"],
            registry=self.registry,
        )

    def model(self, model: str, version: str) -> ModelMetrics:
        key = (model, version)
        found = self._models.get(key)
        if found is None:
            found = self._models[key] = ModelMetrics(model, version)
        return found

    def models(self) -> Iterator[ModelMetrics]:
        return iter(list(self._models.values()))

    def collector(self, name: str, make: Callable[[], Collector]) -> Collector:
        """The collector registered under ``name``, made and registered on first use."""
        found = self.collectors.get(name)
        if found is None:
            found = self.collectors[name] = make()
            self.registry.register(found)
        return found

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def server_timing(t: Timings, end_ns: int) -> str:
    """The ``Server-Timing`` header value: per-stage durations in milliseconds."""
    total = (end_ns - t.received) * 1e-6
    if t.batch_start:
        queue = (t.batch_start - t.enqueued) * 1e-6
        compute = (t.batch_end - t.batch_start) * 1e-6
        if t.cache:
            return (
                f"queue;dur={queue:.3f}, compute;dur={compute:.3f}, batch;desc={t.batch_size}, "
                f"cache;desc={t.cache}, total;dur={total:.3f}"
            )
        return (
            f"queue;dur={queue:.3f}, compute;dur={compute:.3f}, batch;desc={t.batch_size}, "
            f"total;dur={total:.3f}"
        )
    if t.cache:
        return f"cache;desc={t.cache}, total;dur={total:.3f}"
    return f"total;dur={total:.3f}"
