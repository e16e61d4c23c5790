"""Triton's statistics extension, in the JSON shape its clients (and perf_analyzer) read."""

from __future__ import annotations

from typing import Any

from rtserve.core.dataplane import DataPlane
from rtserve.observability.metrics import StatDuration


def _duration(d: StatDuration) -> dict[str, int]:
    return {"count": d.count, "ns": d.ns}


def model_statistics(dataplane: DataPlane, name: str | None, version: str) -> list[dict[str, Any]]:
    repo = dataplane.repository
    if name is None:
        versions = repo.loaded_versions()
    else:
        mv = repo.get_loaded(name, version)
        versions = [mv] if version else list(repo.models[name].versions.values())
    out = []
    for mv in versions:
        s = mv.metrics.stats
        # perf_analyzer requires compute_input/infer/output counts to agree; concatenation
        # and splitting are accounted inside compute_infer, so input/output carry 0 ns.
        compute_count = {"count": s.compute_infer.count, "ns": 0}
        out.append(
            {
                "name": mv.name,
                "version": mv.version,
                "last_inference": s.last_inference_ms,
                "inference_count": s.inference_count,
                "execution_count": s.execution_count,
                "inference_stats": {
                    "success": _duration(s.success),
                    "fail": _duration(s.fail),
                    "queue": _duration(s.queue),
                    "compute_input": compute_count,
                    "compute_infer": _duration(s.compute_infer),
                    "compute_output": compute_count,
                    "cache_hit": _duration(s.cache_hit),
                    "cache_miss": _duration(s.cache_miss),
                },
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
