"""One view of the metrics and statistics of ``--workers N`` server processes.

Each worker keeps its own lock-free metrics (nothing shared on the hot path) and publishes
a snapshot of them — every Prometheus sample and its Triton statistics — to a file in the
directory the workers share, a few times a second and at every scrape it answers. A scrape
(or a statistics request) answered by any worker merges its fresh snapshot with the others'
latest ones: counters and histograms are summed, gauges summed (queue depths, sizes) or
maxed (states). Every worker's snapshot only moves forward, and the answering worker
publishes before it reads, so counters never decrease from one scrape to the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import operator
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import Metric

from rtserve.observability.metrics import Metrics, ModelStats, StatDuration, VersionStatistics

log = logging.getLogger(__name__)

# Gauges whose merged value is the largest of the workers' (a state, not an amount).
_MAX_GAUGES = (
    "rtserve_cache_breaker_open",
    "rtserve_slo_objective_seconds",
    "rtserve_slo_window_seconds",
    "rtserve_slo_target_batch_rows",
    "rtserve_llm_objective_seconds",
)
# Gauges whose merged value is the smallest (the most cautious worker's).
_MIN_GAUGES = ("rtserve_slo_budget_factor",)
PUBLISH_PERIOD_S = 0.25


def _family_snapshot(metrics: Metrics) -> list[dict[str, Any]]:
    out = []
    for family in metrics.registry.collect():
        samples = [
            [s.name, s.labels, s.value] for s in family.samples if not s.name.endswith("_created")
        ]
        out.append(
            {
                "name": family.name,
                "type": family.type,
                "help": family.documentation,
                "samples": samples,
            }
        )
    return out


def _stats_to_dict(v: VersionStatistics) -> dict[str, Any]:
    d = dataclasses.asdict(v.stats)
    d["batch_sizes"] = {str(k): dataclasses.asdict(x) for k, x in v.stats.batch_sizes.items()}
    return {"name": v.name, "version": v.version, "stats": d}


def _stats_from_dict(d: dict[str, Any]) -> ModelStats:
    s = d["stats"]
    fields = {
        k: StatDuration(**v) for k, v in s.items() if isinstance(v, dict) and k != "batch_sizes"
    }
    return ModelStats(
        inference_count=s["inference_count"],
        execution_count=s["execution_count"],
        last_inference_ms=s["last_inference_ms"],
        batch_sizes={int(k): StatDuration(**v) for k, v in s["batch_sizes"].items()},
        **fields,
    )


def _add(into: StatDuration, other: StatDuration) -> None:
    into.count += other.count
    into.ns += other.ns


# ModelStats' per-stage durations (every StatDuration field), summed across workers.
_DURATIONS = tuple(
    f.name for f in dataclasses.fields(ModelStats) if f.default_factory is StatDuration
)


def merge_stats(parts: list[ModelStats]) -> ModelStats:
    total = ModelStats()
    for p in parts:
        total.inference_count += p.inference_count
        total.execution_count += p.execution_count
        total.last_inference_ms = max(total.last_inference_ms, p.last_inference_ms)
        for f in _DURATIONS:
            _add(getattr(total, f), getattr(p, f))
        for size, d in p.batch_sizes.items():
            _add(total.batch_sizes.setdefault(size, StatDuration()), d)
    return total


def _combine(family: str) -> Callable[[float, float], float]:
    """How two workers' values of one sample merge: a state's largest or smallest, else
    the sum."""
    if family in _MAX_GAUGES:
        return max
    if family in _MIN_GAUGES:
        return min
    return operator.add


class _Merged:
    """A collector-like object of merged families, for ``generate_latest``."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


class WorkerView:
    def __init__(
        self,
        directory: Path,
        index: int,
        metrics: Metrics,
        statistics: Callable[[], list[VersionStatistics]],
    ) -> None:
        """``statistics``: this worker's statistics of every version it serves."""
        self.directory = directory
        self.index = index
        self.metrics = metrics
        self.own_statistics = statistics
        self.path = directory / f"worker-{index}.json"
        self._task: asyncio.Task[None] | None = None

    def publish(self) -> dict[str, Any]:
        snap = {
            "pid": os.getpid(),
            "families": _family_snapshot(self.metrics),
            "stats": [_stats_to_dict(v) for v in self.own_statistics()],
        }
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(orjson.dumps(snap))
        tmp.replace(self.path)
        return snap

    def _snapshots(self) -> list[dict[str, Any]]:
        own = self.publish()
        snaps = [own]
        for p in sorted(self.directory.glob("worker-*.json")):
            if p == self.path:
                continue
            with contextlib.suppress(OSError, ValueError):
                snaps.append(orjson.loads(p.read_bytes()))
        return snaps

    async def run(self) -> None:
        while True:
            try:
                self.publish()
            except OSError:
                log.exception("publishing this worker's metrics failed")
            await asyncio.sleep(PUBLISH_PERIOD_S)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(OSError):
            self.publish()  # the final counts stay in the merged view

    # ------------------------------------------------------------------ merged answers
    def exposition(self) -> tuple[bytes, str]:
        # Keyed by name and type: a counter ``x_total`` and a histogram ``x`` share the
        # family name ``x`` and must stay two families.
        order: list[tuple[str, str]] = []
        families: dict[tuple[str, str], dict[str, Any]] = {}
        values: dict[tuple[str, str], dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        for snap in self._snapshots():
            for fam in snap["families"]:
                key = (fam["name"], fam["type"])
                if key not in families:
                    families[key] = fam
                    order.append(key)
                    values[key] = {}
                merged = values[key]
                combine = _combine(fam["name"])
                for sample_name, labels, value in fam["samples"]:
                    sample = (sample_name, tuple(sorted(labels.items())))
                    old = merged.get(sample)
                    merged[sample] = value if old is None else combine(old, value)
        out = []
        for key in order:
            fam = families[key]
            metric = Metric(fam["name"], fam["help"], fam["type"])
            for (sample_name, labels), value in values[key].items():
                metric.add_sample(sample_name, dict(labels), value)
            out.append(metric)
        return generate_latest(_Merged(out)), CONTENT_TYPE_LATEST  # type: ignore[arg-type]

    def statistics(self, own: list[VersionStatistics]) -> list[VersionStatistics]:
        """Merge ``own`` (the versions asked for) with the same versions of every worker."""
        wanted = {(v.name, v.version) for v in own}
        parts: dict[tuple[str, str], list[ModelStats]] = {k: [] for k in wanted}
        for snap in self._snapshots():
            for d in snap["stats"]:
                key = (d["name"], d["version"])
                if key in parts:
                    parts[key].append(_stats_from_dict(d))
        return [
            VersionStatistics(v.name, v.version, merge_stats(parts[(v.name, v.version)]))
            for v in own
        ]
