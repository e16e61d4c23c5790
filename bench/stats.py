"""Percentiles, medians over rounds, and ratios to rtserve."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from statistics import median
from typing import TypeVar

from bench.results import Measurement

T = TypeVar("T")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile out of range: {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = math.ceil(position)
    if low == high:
        return float(ordered[low])
    weight = position - low
    return float(ordered[low] * (1 - weight) + ordered[high] * weight)


def ratio(value: float | None, reference: float | None) -> float | None:
    """``value / reference``, or None when either is missing or the reference is zero."""
    if value is None or reference is None or reference == 0 or math.isnan(reference):
        return None
    if math.isnan(value):
        return None
    return value / reference


def middle(values: Iterable[float | None]) -> float | None:
    """The median of the values that are numbers (None and NaN left out), or None."""
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return float(median(kept)) if kept else None


def combine_rounds(measurements: Sequence[Measurement]) -> list[Measurement]:
    """One Measurement per point: medians over the rounds that succeeded, errors summed.

    A point whose every round failed keeps the last round's error text.
    """
    groups: dict[tuple[str, str, str, str, float], list[Measurement]] = {}
    for m in measurements:
        groups.setdefault((m.peer, m.workload, m.client, m.mode, m.load), []).append(m)
    combined: list[Measurement] = []
    for (peer, workload, client, mode, load), items in groups.items():
        good = [m for m in items if m.ok]
        if not good:
            combined.append(Measurement(peer, workload, client, mode, load, error=items[-1].error))
            continue
        merged = Measurement(
            peer,
            workload,
            client,
            mode,
            load,
            rps=middle(m.rps for m in good) or 0.0,
            p50_ms=middle(m.p50_ms for m in good),
            p90_ms=middle(m.p90_ms for m in good),
            p99_ms=middle(m.p99_ms for m in good),
            errors=sum(m.errors for m in items),
            requests=sum(m.requests for m in good),
            round=len(good),
        )
        merged.extra = {"rounds_rps": [round(m.rps, 1) for m in good]}
        if len(good) < len(items):
            merged.extra["failed_rounds"] = len(items) - len(good)
        combined.append(merged)
    return combined


def saturated(m: Measurement, max_p99_ms: float = 2000.0) -> bool:
    """An open-loop point past what the server (or client) can carry."""
    if not m.ok:
        return True
    unfinished = int(m.extra.get("unfinished", 0))
    return m.rps < 0.7 * m.load or unfinished > 0 or (m.p99_ms or 0.0) > max_p99_ms


def round_ratios(
    measurements: Sequence[Measurement],
    subject: str,
    references: Sequence[str],
    client: str = "wrk",
) -> list[dict[str, float | None]]:
    """Per round: ``subject``'s req/s over each reference's, both measured in that round.

    Servers of one round run back to back, so a round's ratio compares like with like
    even when the machine's speed drifts between rounds. Rows are ordered by round; a
    failed or missing point gives None.
    """
    by_round: dict[int, dict[str, Measurement]] = {}
    for m in measurements:
        if m.client == client and m.mode == "closed":
            by_round.setdefault(m.round, {})[m.peer] = m
    rows: list[dict[str, float | None]] = []
    for round_no in sorted(by_round):
        points = by_round[round_no]
        own = points.get(subject)
        row: dict[str, float | None] = {}
        for ref in references:
            other = points.get(ref)
            ok = own is not None and own.ok and other is not None and other.ok
            row[ref] = ratio(own.rps, other.rps) if ok and own and other else None
        rows.append(row)
    return rows


def median_ratio(rows: Sequence[dict[str, float | None]], reference: str) -> float | None:
    """The median of the per-round ratios to ``reference`` (rounds without one are skipped)."""
    return middle(row.get(reference) for row in rows)


def rotated(items: Sequence[T], round_no: int) -> list[T]:
    """``items`` starting at ``round_no`` (mod its length): alternating rounds rotate the order
    so that no server always runs first or right after the heaviest one."""
    shift = round_no % len(items) if items else 0
    return [*items[shift:], *items[:shift]]
