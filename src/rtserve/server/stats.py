"""Triton's statistics extension, in the JSON shape its clients (and perf_analyzer) read."""

from __future__ import annotations

from typing import Any

from rtserve.observability.metrics import StatDuration, VersionStatistics

INFERENCE_STATS = (
    "success",
    "fail",
    "queue",
    "compute_input",
    "compute_infer",
    "compute_output",
    "cache_hit",
    "cache_miss",
)


def _duration(d: StatDuration) -> dict[str, int]:
    return {"count": d.count, "ns": d.ns}


def inference_stats(v: VersionStatistics) -> dict[str, StatDuration]:
    """The extension's inference_stats. perf_analyzer requires compute_input/infer/output
    counts to agree; concatenation and splitting are accounted inside compute_infer, so
    input/output carry 0 ns."""
    s = v.stats
    compute_count = StatDuration(s.compute_infer.count, 0)
    return {
        "success": s.success,
        "fail": s.fail,
        "queue": s.queue,
        "compute_input": compute_count,
        "compute_infer": s.compute_infer,
        "compute_output": compute_count,
        "cache_hit": s.cache_hit,
        "cache_miss": s.cache_miss,
    }


def statistics_json(versions: list[VersionStatistics]) -> list[dict[str, Any]]:
    out = []
    for v in versions:
        s = v.stats
        out.append(
            {
                "name": v.name,
                "version": v.version,
                "last_inference": s.last_inference_ms,
                "inference_count": s.inference_count,
                "execution_count": s.execution_count,
                "inference_stats": {k: _duration(d) for k, d in inference_stats(v).items()},
                "batch_stats": [
                    {
                        "batch_size": size,
                        "compute_input": {"count": d.count, "ns": 0},
                        "compute_infer": _duration(d),
                        "compute_output": {"count": d.count, "ns": 0},
                    }
                    for size, d in sorted(s.batch_sizes.items())
                ],
            }
        )
    return out
