"""Limit row: the model alone, in this process, through onnxruntime at each batch size."""

from __future__ import annotations

import time

import numpy as np

from bench.peers.common import run, session
from bench.results import Measurement
from bench.servers import peer_settings
from bench.stats import percentile
from bench.workloads import WORK, Workload

BATCH_SIZES = (1, 4, 8, 16, 32, 64)
PEER = "onnxruntime"


def model_alone(workload: Workload, seconds_per_size: float) -> list[Measurement]:
    """Rows/s and per-batch latency for each batch size (``load`` is the batch size)."""
    cfg = peer_settings(workload, WORK)
    sess = session(cfg)
    row = workload.sample()
    results: list[Measurement] = []
    for size in BATCH_SIZES:
        feeds = {name: np.repeat(array, size, axis=0) for name, array in row.items()}
        for _ in range(3):
            run(sess, feeds, cfg)
        times: list[float] = []
        deadline = time.perf_counter() + seconds_per_size
        while time.perf_counter() < deadline or len(times) < 5:
            start = time.perf_counter()
            run(sess, feeds, cfg)
            times.append(time.perf_counter() - start)
        p50, p90, p99 = (percentile(times, q) * 1000 for q in (50, 90, 99))
        results.append(
            Measurement(
                PEER,
                workload.name,
                "in-process",
                "limit",
                size,
                rps=size * len(times) / sum(times),
                p50_ms=p50,
                p90_ms=p90,
                p99_ms=p99,
                requests=len(times),
            )
        )
    return results
