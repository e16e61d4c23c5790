"""Timed batches on a freshly loaded runtime: warmup, and the latency objective's
calibration (its batch-time model is fitted from them).

Both run off the event loop, before the version serves.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from rtserve.config import ModelConfig, TensorSpec
from rtserve.protocol.types import DATATYPE_TO_NUMPY
from rtserve.runtime.base import Runtime
from rtserve.scheduling.slo import calibration_sizes, objective_from_config
from rtserve.scheduling.slo_policy import BatchTimeModel, SLOController, measure

log = logging.getLogger(__name__)


# Sizes tried, in turn, for the dimensions a model leaves open (-1): a CNN with open height
# and width refuses a 1x1 image. A guess is tried only while the batch stays this small.
GUESSES = (1, 32)
MAX_GUESSED_ELEMENTS = 1 << 24


@dataclass(frozen=True, slots=True)
class Warmed:
    """What warmup found: ``batch_ns``, the median time of its largest batch (None: not
    timed, as warmup was off or the model refused every guess at its open dimensions), and
    ``fill``, the size that worked for those dimensions."""

    batch_ns: int | None
    fill: int = 1


def example_batch(
    specs: tuple[TensorSpec, ...], rows: int, batched: bool, fill: int = 1
) -> dict[str, Any]:
    """Zeros (``b""`` for BYTES) of each input's shape, its open dimensions ``fill``."""
    feeds: dict[str, Any] = {}
    for spec in specs:
        dims = tuple(d if d >= 0 else fill for d in spec.shape)
        shape = (rows, *dims) if batched else dims
        if spec.datatype == "BYTES":
            feeds[spec.name] = np.full(shape, b"", dtype=object)
        else:
            feeds[spec.name] = np.zeros(shape, dtype=DATATYPE_TO_NUMPY[spec.datatype])
    return feeds


def warmup(runtime: Runtime, config: ModelConfig) -> Warmed:
    """Run the configured warmup batches on every instance; the median ns of the largest
    batch decides where the model runs. ``warmup: {iterations: 0}`` turns it off.

    Where the inputs leave dimensions open, each of ``GUESSES`` is tried on a first batch;
    if the model refuses them all it loads untimed (its requests bring real sizes) and the
    log says why. A model with no open dimension that fails its warmup fails to load."""
    if config.warmup.iterations == 0:
        return Warmed(None)
    batched = config.max_batch_size > 0
    sizes = config.warmup.batch_sizes
    fill = _working_fill(runtime, config, min(sizes), batched)
    if fill is None:
        return Warmed(None)
    largest = max(sizes)
    times: list[int] = []
    for instance in range(runtime.instance_count):
        for size in sizes:
            feeds = example_batch(runtime.inputs, size, batched, fill)
            for _ in range(config.warmup.iterations):
                start = time.perf_counter_ns()
                runtime.run(instance, feeds)
                if size == largest:
                    times.append(time.perf_counter_ns() - start)
    return Warmed(int(statistics.median(times)) if times else None, fill)


def _working_fill(runtime: Runtime, config: ModelConfig, rows: int, batched: bool) -> int | None:
    """The first of ``GUESSES`` the model runs with (1 when nothing is open), else None."""
    if not any(d < 0 for spec in runtime.inputs for d in spec.shape):
        return 1
    errors = []
    for fill in GUESSES:
        elements = sum(
            math.prod(d if d >= 0 else fill for d in spec.shape) * (rows if batched else 1)
            for spec in runtime.inputs
        )
        if elements > MAX_GUESSED_ELEMENTS:  # (counted before anything is allocated)
            break
        try:
            runtime.run(0, example_batch(runtime.inputs, rows, batched, fill))
        except Exception as exc:
            errors.append(f"{fill}: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        return fill
    log.warning(
        "model %s: warmup skipped: the model refused zeros with its open dimensions set to "
        "%s (%s). It loads untimed; its batches run on threads. Set warmup: {iterations: "
        "0} to skip warmup, or give the inputs' sizes in config.yaml",
        config.name, " or ".join(str(g) for g in GUESSES), "; ".join(errors),
    )  # fmt: skip
    return None


def slo_controller(runtime: Runtime, config: ModelConfig, fill: int = 1) -> SLOController:
    """The latency objective's controller, its batch-time model fitted from timed batches
    (open dimensions ``fill``, as warmup found)."""
    assert config.slo is not None
    batched = config.max_batch_size > 0
    max_rows = max(1, config.max_batch_size)
    sizes = calibration_sizes(max_rows) if batched else (1,)
    samples = measure(
        lambda rows: runtime.run(0, example_batch(runtime.inputs, rows, batched, fill)), sizes
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
