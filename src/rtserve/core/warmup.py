"""Timed batches on a freshly loaded runtime: warmup, and the latency objective's
calibration (its batch-time model is fitted from them).

Both run off the event loop, before the version serves.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import numpy as np

from rtserve.config import ModelConfig, TensorSpec
from rtserve.protocol.types import DATATYPE_TO_NUMPY
from rtserve.runtime.base import Runtime
from rtserve.scheduling.slo import calibration_sizes, objective_from_config
from rtserve.scheduling.slo_policy import BatchTimeModel, SLOController, measure

log = logging.getLogger(__name__)


def example_batch(specs: tuple[TensorSpec, ...], rows: int, batched: bool) -> dict[str, Any]:
    feeds: dict[str, Any] = {}
    for spec in specs:
        dims = tuple(d if d >= 0 else 1 for d in spec.shape)
        shape = (rows, *dims) if batched else dims
        if spec.datatype == "BYTES":
            feeds[spec.name] = np.full(shape, b"", dtype=object)
        else:
            feeds[spec.name] = np.zeros(shape, dtype=DATATYPE_TO_NUMPY[spec.datatype])
    return feeds


def warmup(runtime: Runtime, config: ModelConfig) -> int:
    """Run the configured warmup batches on every instance; return the median ns of the
    largest batch (used to decide where the model runs)."""
    batched = config.max_batch_size > 0
    largest = max(config.warmup.batch_sizes)
    times: list[int] = []
    for instance in range(runtime.instance_count):
        for size in config.warmup.batch_sizes:
            feeds = example_batch(runtime.inputs, size, batched)
            for _ in range(max(1, config.warmup.iterations)):
                start = time.perf_counter_ns()
                runtime.run(instance, feeds)
                if size == largest:
                    times.append(time.perf_counter_ns() - start)
    return int(statistics.median(times)) if times else 0


def slo_controller(runtime: Runtime, config: ModelConfig) -> SLOController:
    """The latency objective's controller, its batch-time model fitted from timed batches."""
    assert config.slo is not None
    batched = config.max_batch_size > 0
    max_rows = max(1, config.max_batch_size)
    sizes = calibration_sizes(max_rows) if batched else (1,)
    samples = measure(
        lambda rows: runtime.run(0, example_batch(runtime.inputs, rows, batched)), sizes
    )
    objective = objective_from_config(
        config.slo.p99_ms, config.slo.p50_ms, config.priority_levels, config.default_priority
    )
    model = BatchTimeModel.fit(samples)
    alone_ns = model.predict(1)
    if alone_ns > objective.budget_ns:
        # Admitted anyway when nothing is ahead (queueing is not what makes it late), so
        # every request would miss the objective: say so once, where the user looks.
        log.warning(
            "model %s: a batch of one row took %.3g ms when timed, more than the latency "
            "objective leaves for the queue and the model (%.3g ms of p99 %.3g ms): its "
            "requests will miss the objective",
            config.name,
            alone_ns / 1e6,
            objective.budget_ns / 1e6,
            config.slo.p99_ms,
        )
    return SLOController(objective, model)
