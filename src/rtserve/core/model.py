"""A live model version and the one factory that builds it.

``ModelVersion`` = runtime + scheduler (the dynamic batcher, or an ensemble's step
scheduler) + response cache + metrics, with ``drain``/``stop``. ``build_version`` is the
only place that wires them; the config's ``backend`` picks the builder, so a new backend is
one module under ``runtime/`` (or one builder here for a backend that is not a runtime,
like ensembles).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from rtserve.config import ModelConfig, TensorSpec
from rtserve.errors import ConfigError, RTServeError
from rtserve.observability.metrics import Metrics, ModelMetrics
from rtserve.protocol.limits import DEFAULT_LIMITS, DecodeLimits, limits_for_model
from rtserve.protocol.types import DATATYPE_TO_NUMPY, Timings
from rtserve.runtime.base import Runtime, load_runtime
from rtserve.scheduling.batcher import Batcher
from rtserve.scheduling.policy import DynamicBatchPolicy
from rtserve.scheduling.slo import (
    BatchTimeModel,
    SLOController,
    calibration_sizes,
    measure,
    objective_from_config,
)

if TYPE_CHECKING:
    from rtserve.cache import CacheConfig, CacheMetrics, ResponseCache

log = logging.getLogger(__name__)

# A model whose largest warmup batch runs faster than this runs inline on the event loop.
INLINE_MAX_BATCH_NS = 1_000_000
# Backends whose code may hold the GIL or block (user code, torch): never inline.
_NEVER_INLINE = ("python", "torch")

Outputs = dict[str, np.ndarray]


class Scheduler(Protocol):
    """What the dataplane needs from whatever runs a version's requests."""

    def submit(
        self,
        feeds: dict[str, np.ndarray],
        rows: int,
        timings: Timings,
        timeout_s: float = 0.0,
        priority: object = None,
        on_done: Callable[[asyncio.Future[Outputs]], object] | None = None,
    ) -> asyncio.Future[Outputs]:
        """``priority``: the request parameter (a scheduler without priorities ignores it).
        ``on_done``: the future's done callback (a scheduler may call it directly when it
        completes the future, rather than have the loop schedule it)."""
        ...

    def refuse_early(self, received_ns: int) -> RTServeError | None:
        """Before a request is decoded: the error every request would get now (an
        overloaded latency objective), else None."""
        ...

    @property
    def queue_depth(self) -> int: ...

    @property
    def busy(self) -> bool: ...

    async def drain(self) -> None: ...

    async def stop(self) -> None: ...


@dataclass(slots=True)
class ModelVersion:
    name: str
    version: str
    config: ModelConfig
    platform: str
    scheduler: Scheduler
    metrics: ModelMetrics
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    runtime: Runtime | None = None  # None for versions that are not one runtime (ensembles)
    cache: ResponseCache | None = None
    ready: bool = False
    # What one request to this version may cost to decode (sized to its signature).
    decode_limits: DecodeLimits = DEFAULT_LIMITS
    # Class labels per output, in index order (the config's labels files, a ZipMap's classes).
    labels: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def submit(
        self,
        feeds: dict[str, np.ndarray],
        rows: int,
        timings: Timings,
        timeout_s: float = 0.0,
        priority: object = None,
        on_done: Callable[[asyncio.Future[Outputs]], object] | None = None,
    ) -> asyncio.Future[Outputs]:
        return self.scheduler.submit(feeds, rows, timings, timeout_s, priority, on_done)

    def early_refusal(self, received_ns: int) -> RTServeError | None:
        """The scheduler's refusal before decoding (``Scheduler.refuse_early``), or None;
        never with a response cache, whose hits are answered whatever the queue."""
        if self.cache is not None:
            return None
        return self.scheduler.refuse_early(received_ns)

    def check_early(self, received_ns: int) -> None:
        """``early_refusal``, raised: a copy, as the scheduler gives requests refused back to
        back the same object, and a raised exception keeps its traceback."""
        error = self.early_refusal(received_ns)
        if error is not None:
            error = copy.copy(error)
            try:
                raise error
            finally:
                # Not held by this frame, which the traceback holds: that cycle would keep
                # the frame (and the caller's, with the request body) until a cyclic
                # collection, and refusals come by the thousand under overload.
                del error

    async def drain(self) -> None:
        """Wait until every admitted request has been answered."""
        await self.scheduler.drain()

    async def stop(self) -> None:
        """Refuse new requests, finish admitted ones, then release everything."""
        self.ready = False
        await self.scheduler.stop()
        if self.cache is not None:
            await self.cache.close()
        if self.runtime is not None:
            self.runtime.close()


@dataclass(slots=True)
class BuildContext:
    """What building a version needs from the server, given once at construction."""

    metrics: Metrics
    # Whether another request may arrive soon (fed by the transports; see the policy).
    more_expected: Callable[[], bool]
    cache_default: CacheConfig | None = None
    # Resolves another live model (ensembles call their steps through it).
    lookup: Callable[[str, str], ModelVersion] | None = None
    decode_limits: DecodeLimits = DEFAULT_LIMITS  # the server's; tightened per model
    _cache_metrics: CacheMetrics | None = None

    def cache_for(
        self,
        config: ModelConfig,
        version: str,
        outputs: tuple[TensorSpec, ...] | None = None,
    ) -> ResponseCache | None:
        """The model's response cache (its config merged over the server default), or None."""
        if config.response_cache is None and self.cache_default is None:
            return None
        from rtserve.cache import CacheConfig, CacheMetrics, ResponseCache, merge

        own = (
            CacheConfig.from_dict(config.response_cache, config.source)
            if config.response_cache is not None
            else None
        )
        merged = merge(self.cache_default, own)
        if not merged.enabled:
            return None
        if self._cache_metrics is None:
            self._cache_metrics = CacheMetrics(self.metrics.registry)
        return ResponseCache(
            merged,
            config.name,
            version,
            self._cache_metrics,
            outputs=outputs,
            max_batch_size=max(0, config.max_batch_size),
        )


Builder = Callable[[ModelConfig, Path, str, BuildContext], Awaitable[ModelVersion]]


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


MAX_LABELS_BYTES = 16 * 1024 * 1024


def read_labels(
    config: ModelConfig, model_dir: Path, runtime: Runtime
) -> dict[str, tuple[str, ...]]:
    """Each output's class labels: the runtime's own (a ZipMap's classes), then the config's
    ``labels`` files (one label per line, in index order), which take precedence."""
    labels: dict[str, tuple[str, ...]] = dict(getattr(runtime, "labels", None) or {})
    names = [s.name for s in runtime.outputs]
    root = model_dir.resolve()
    for output, file in config.labels.items():
        where = f"{config.source}: labels.{output}"
        if output not in names:
            raise ConfigError(f"{where}: the model has no output {output!r} ({', '.join(names)})")
        path = (model_dir / file).resolve()
        if not path.is_relative_to(root):
            raise ConfigError(f"{where}: {file!r} is outside the model's directory")
        try:
            if path.stat().st_size > MAX_LABELS_BYTES:
                raise ConfigError(f"{where}: {file} is larger than {MAX_LABELS_BYTES} bytes")
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{where}: cannot read {file}: {exc}") from None
        labels[output] = tuple(text.splitlines())
    return labels


async def build_runtime_version(
    config: ModelConfig, version_dir: Path, version: str, ctx: BuildContext
) -> ModelVersion:
    """A version served by one runtime behind the dynamic batcher (ONNX, Python, torch)."""
    loop = asyncio.get_running_loop()
    try:
        runtime = await loop.run_in_executor(None, load_runtime, config, version_dir)
    except ConfigError:
        raise
    except Exception as exc:
        log.error("loading %s failed", version_dir, exc_info=exc)
        raise ConfigError(f"{version_dir}: loading failed: {type(exc).__name__}: {exc}") from exc
    if runtime.max_batch_size != config.max_batch_size:
        config = dataclasses.replace(config, max_batch_size=runtime.max_batch_size)
    try:  # (file reads: off the event loop, as the load)
        labels = await loop.run_in_executor(None, read_labels, config, version_dir.parent, runtime)
    except ConfigError:
        runtime.close()
        raise
    try:
        batch_ns = await loop.run_in_executor(None, warmup, runtime, config)
    except Exception as exc:
        runtime.close()
        raise ConfigError(f"{version_dir}: warmup failed: {type(exc).__name__}: {exc}") from exc
    mode = config.onnxruntime.execution
    inline = config.backend not in _NEVER_INLINE and (
        mode == "inline"
        or (mode == "auto" and runtime.instance_count == 1 and batch_ns < INLINE_MAX_BATCH_NS)
    )
    metrics = ctx.metrics.model(config.name, version)
    controller = None
    if config.slo is not None:
        try:  # timed batches up to max_batch_size: a model may fail where warmup did not
            controller = await loop.run_in_executor(None, slo_controller, runtime, config)
        except Exception as exc:
            runtime.close()
            raise ConfigError(
                f"{version_dir}: slo: timing batches for the latency objective failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    batcher = Batcher(
        f"{config.name}:{version}",
        runtime,
        DynamicBatchPolicy(config.max_batch_size, config.dynamic_batching),
        config.dynamic_batching.max_queue_size,
        batched=config.max_batch_size > 0,
        inline=inline,
        more_expected=ctx.more_expected,
        on_batch=metrics.observe_batch,
        controller=controller,
        stats=metrics.scheduler,
    )
    batcher.start()
    metrics.track_queue_depth(lambda: batcher.queue_depth)
    mv = ModelVersion(
        name=config.name,
        version=version,
        config=config,
        platform=runtime.platform,
        scheduler=batcher,
        metrics=metrics,
        inputs={s.name: s for s in runtime.inputs},
        outputs={s.name: s for s in runtime.outputs},
        runtime=runtime,
        cache=ctx.cache_for(config, version, runtime.outputs),
        # Up to 4x what the model accepts is still decoded, so that the dataplane can name
        # the mismatch (batch size, shape); far beyond that is refused before parsing.
        decode_limits=limits_for_model(
            runtime.inputs, 4 * max(1, config.max_batch_size), ctx.decode_limits
        ),
        labels=labels,
    )
    log.info(
        "loaded %s version %s (%s, %s, largest warmup batch %.3f ms)",
        config.name, version, config.backend, "inline" if inline else "threaded", batch_ns / 1e6,
    )  # fmt: skip
    return mv


async def _build_ensemble(
    config: ModelConfig, version_dir: Path, version: str, ctx: BuildContext
) -> ModelVersion:
    from rtserve.core.ensemble import build_ensemble_version

    return await build_ensemble_version(config, version_dir, version, ctx)


# config.backend -> builder. Runtime backends share one builder (runtime.base picks the
# module); a backend that composes other models brings its own.
BUILDERS: dict[str, Builder] = {
    "onnxruntime": build_runtime_version,
    "python": build_runtime_version,
    "torch": build_runtime_version,
    "ensemble": _build_ensemble,
}


async def build_version(
    config: ModelConfig, version_dir: Path, version: str, ctx: BuildContext
) -> ModelVersion:
    """Build, warm up and return one live (not yet ready) version."""
    builder = BUILDERS.get(config.backend)
    if builder is None:
        raise ConfigError(f"{config.source}: backend: unknown backend {config.backend!r}")
    return await builder(config, version_dir, version, ctx)
