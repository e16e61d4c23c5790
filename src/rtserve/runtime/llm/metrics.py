"""Prometheus metrics of generative models: token latencies, token counts, the running
batch and the KV pool. The engine thread records into plain accumulators; the collector
reads them when ``/metrics`` is scraped (as the dataplane's metrics do)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from rtserve.observability.metrics import Accumulator
from rtserve.runtime.llm.options import TokenSLO

TOKEN_LATENCY = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
    10.0, 30.0,
)  # fmt: skip
REQUEST_LATENCY = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_COUNTS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
REASONS = ("stop", "length", "abort")
# The engine's gauge readings (keys) as exposed: name and help. The pool's size is
# "_capacity", not "_total" (a suffix Prometheus keeps for counters).
GAUGES = {
    "running": ("rtserve_llm_running_sequences", "Sequences in the running batch"),
    "waiting": ("rtserve_llm_waiting_sequences", "Sequences waiting to be scheduled"),
    "kv_blocks_used": (
        "rtserve_llm_kv_blocks_used",
        "KV blocks held by sequences (cached free blocks not counted)",
    ),
    "kv_blocks_total": ("rtserve_llm_kv_blocks_capacity", "KV blocks in the pool"),
    "paused": (
        "rtserve_llm_paused_sequences",
        "Streams paused out of the batch because their client does not read them",
    ),
}

HISTOGRAMS = {
    "ttft": ("rtserve_llm_time_to_first_token_seconds", "Time to first token", TOKEN_LATENCY),
    "itl": ("rtserve_llm_inter_token_latency_seconds", "Time between tokens", TOKEN_LATENCY),
    "e2e": ("rtserve_llm_request_seconds", "Arrival to last token", REQUEST_LATENCY),
    "queue": ("rtserve_llm_queue_seconds", "Arrival to first scheduled", REQUEST_LATENCY),
    "prompt": ("rtserve_llm_request_prompt_tokens", "Prompt tokens per request", TOKEN_COUNTS),
    "generated": (
        "rtserve_llm_request_generation_tokens",
        "Generated tokens per request",
        TOKEN_COUNTS,
    ),
}


@dataclass(slots=True)
class LlmMetrics:
    model: str
    version: str
    histograms: dict[str, Accumulator] = field(
        default_factory=lambda: {k: Accumulator(v[2]) for k, v in HISTOGRAMS.items()}
    )
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    refused: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    drafted: int = 0  # speculative decoding: tokens drafted, and of those the model kept
    accepted: int = 0
    gauges: Callable[[], dict[str, float]] = lambda: {}
    prefix: Callable[[], tuple[int, int]] = lambda: (0, 0)
    # The engine's own counters, read when scraped: "preempted" (for KV blocks),
    # "fair_preempted" (for another tenant's share), "stalled" (unread streams paused).
    counts: Callable[[], dict[str, int]] = lambda: {}
    objectives: dict[str, float] = field(default_factory=dict)  # "ttft_p99" -> seconds

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)


def token_objectives(slo: TokenSLO | None) -> dict[str, float]:
    """The objectives a model's ``slo:`` sets, in seconds, as exported (unset ones left out)."""
    if slo is None:
        return {}
    ms = {"ttft_p99": slo.ttft_p99_ms, "itl_p99": slo.itl_p99_ms}
    return {k: v / 1000 for k, v in ms.items() if v > 0}


class LlmCollector(Collector):
    """Every generative model's metrics, labelled by model and version."""

    def __init__(self) -> None:
        self.models: list[LlmMetrics] = []

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        models = list(self.models)
        labels = ["model", "version"]
        for key, (name, doc, _) in HISTOGRAMS.items():
            h = HistogramMetricFamily(name, doc, labels=labels)
            for m in models:
                acc = m.histograms[key]
                h.add_metric([m.model, m.version], acc.buckets(), acc.sum)
            yield h
        finished = CounterMetricFamily(
            "rtserve_llm_requests_finished", "Finished sequences by reason",
            labels=[*labels, "reason"],
        )  # fmt: skip
        counters = {
            "prompt": CounterMetricFamily(
                "rtserve_llm_prompt_tokens_total", "Prompt tokens", labels=labels
            ),
            "generated": CounterMetricFamily(
                "rtserve_llm_generation_tokens_total", "Generated tokens", labels=labels
            ),
            "refused": CounterMetricFamily(
                "rtserve_llm_requests_refused",
                "Requests refused at admission by the token objective or a full queue",
                labels=labels,
            ),
            "preempted": CounterMetricFamily(
                "rtserve_llm_preemptions", "Sequences preempted for KV blocks", labels=labels
            ),
            "fair_preempted": CounterMetricFamily(
                "rtserve_llm_fair_share_preemptions",
                "Sequences preempted to give another tenant its share of the batch",
                labels=labels,
            ),
            "stalled": CounterMetricFamily(
                "rtserve_llm_stalled_streams",
                "Streams paused out of the batch after their client left them unread "
                "for unread_timeout_s",
                labels=labels,
            ),
            "drafted": CounterMetricFamily(
                "rtserve_llm_speculative_draft_tokens",
                "Tokens drafted by speculative decoding (llm.speculative)",
                labels=labels,
            ),
            "accepted": CounterMetricFamily(
                "rtserve_llm_speculative_accepted_tokens",
                "Drafted tokens the model kept (each saves a decode step)",
                labels=labels,
            ),
            "queries": CounterMetricFamily(
                "rtserve_llm_prefix_cache_queries", "Prefix-cache block lookups", labels=labels
            ),
            "hits": CounterMetricFamily(
                "rtserve_llm_prefix_cache_hits", "Prefix-cache blocks found", labels=labels
            ),
        }
        gauges = {
            k: GaugeMetricFamily(name, doc, labels=labels) for k, (name, doc) in GAUGES.items()
        }
        objectives = GaugeMetricFamily(
            "rtserve_llm_objective_seconds",
            "The model's token latency objectives (slo: ttft_p99_ms, itl_p99_ms)",
            labels=[*labels, "objective"],
        )
        for m in models:
            lv = [m.model, m.version]
            for reason, count in m.finished.items():
                finished.add_metric([*lv, reason], count)
            queries, hits = m.prefix()
            counts = m.counts()
            values = {
                "prompt": m.prompt_tokens,
                "generated": m.generated_tokens,
                "refused": m.refused,
                "preempted": counts.get("preempted", 0),
                "fair_preempted": counts.get("fair_preempted", 0),
                "stalled": counts.get("stalled", 0),
                "drafted": m.drafted,
                "accepted": m.accepted,
                "queries": queries,
                "hits": hits,
            }
            for k, c in counters.items():
                c.add_metric(lv, values[k])
            now = m.gauges()
            for k, g in gauges.items():
                g.add_metric(lv, now.get(k, 0.0))
            for objective, seconds in m.objectives.items():
                objectives.add_metric([*lv, objective], seconds)
        yield finished
        yield from counters.values()
        yield from gauges.values()
        yield objectives
