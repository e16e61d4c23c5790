"""A live model version, and how one runtime becomes one.

``ModelVersion`` = runtime + scheduler (the dynamic batcher, or an ensemble's step
scheduler) + response cache + metrics, with ``drain``/``stop``. ``build_runtime_version``
wires a runtime backend's version (load, labels, warmup, SLO calibration, batcher, cache);
``core/factory.py`` picks the builder for the config's ``backend``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from rtserve.config import ModelConfig, TensorSpec
from rtserve.core.labels import read_labels
from rtserve.core.warmup import slo_controller, warmup
from rtserve.errors import ConfigError, RTServeError
from rtserve.extras import install_hint
from rtserve.observability.metrics import Metrics, ModelMetrics
from rtserve.protocol.limits import DEFAULT_LIMITS, DecodeLimits, limits_for_model
from rtserve.protocol.types import Timings
from rtserve.runtime.base import Runtime
from rtserve.runtime.parameters import RowParameter
from rtserve.scheduling.base import SchedulingPolicy
from rtserve.scheduling.batcher import Batcher
from rtserve.scheduling.policy import DynamicBatchPolicy
from rtserve.scheduling.slo_policy import SLOPolicy
from rtserve.scheduling.window import WindowPolicy

if TYPE_CHECKING:
    from rtserve.cache import CacheConfig, CacheMetrics, ResponseCache
    from rtserve.llm.engine import LlmEngine

log = logging.getLogger(__name__)

# A model whose largest warmup batch runs faster than this runs inline on the event loop.
INLINE_MAX_BATCH_NS = 1_000_000

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
    # Request parameters the runtime reads per row (``runtime/parameters.py``); () for most.
    row_parameters: tuple[RowParameter, ...] = ()
    # The generation engine of a generative (``backend: llm``) version, else None.
    llm: LlmEngine | None = None

    def early_refusal(self, received_ns: int) -> RTServeError | None:
        """The scheduler's refusal before decoding (``Scheduler.refuse_early``), or None;
        never with a response cache, whose hits are answered whatever the queue."""
        if self.cache is not None:
            return None
        return self.scheduler.refuse_early(received_ns)

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
        from rtserve.cache import CacheConfig, CacheMetrics, ResponseCache, merge  # (redis: slow)

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


async def build_runtime_version(
    config: ModelConfig,
    version_dir: Path,
    version: str,
    ctx: BuildContext,
    *,
    load: Callable[[ModelConfig, Path], Runtime],
    may_inline: bool = True,
) -> ModelVersion:
    """A version served by one runtime behind the dynamic batcher (ONNX, Python, torch):
    ``load`` builds the runtime; ``may_inline``: whether its batches may run on the event
    loop (a small model's, when a thread hop would cost more than the compute)."""
    loop = asyncio.get_running_loop()
    try:
        runtime = await loop.run_in_executor(None, load, config, version_dir)
    except ConfigError:
        raise
    except Exception as exc:
        log.error("loading %s failed", version_dir, exc_info=exc)
        hint = install_hint(exc, config.backend)
        raise ConfigError(
            f"{version_dir}: loading failed: {type(exc).__name__}: {exc}{hint}"
        ) from exc
    if runtime.max_batch_size != config.max_batch_size:
        config = dataclasses.replace(config, max_batch_size=runtime.max_batch_size)
    try:  # (file reads: off the event loop, as the load)
        labels = await loop.run_in_executor(None, read_labels, config, version_dir.parent, runtime)
    except ConfigError:
        runtime.close()
        raise
    try:
        warmed = await loop.run_in_executor(None, warmup, runtime, config)
    except Exception as exc:
        runtime.close()
        raise ConfigError(f"{version_dir}: warmup failed: {type(exc).__name__}: {exc}") from exc
    mode = config.onnxruntime.execution
    inline = may_inline and (
        mode == "inline"
        or (
            mode == "auto"
            and runtime.instance_count == 1
            and warmed.batch_ns is not None
            and warmed.batch_ns < INLINE_MAX_BATCH_NS
        )
    )
    metrics = ctx.metrics.model(config.name, version)
    controller = None
    if config.slo is not None:
        try:  # timed batches up to max_batch_size: a model may fail where warmup did not
            controller = await loop.run_in_executor(
                None, slo_controller, runtime, config, warmed.fill
            )
        except Exception as exc:
            runtime.close()
            raise ConfigError(
                f"{version_dir}: slo: timing batches for the latency objective failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    try:
        cache = ctx.cache_for(config, version, runtime.outputs)
    except Exception:
        runtime.close()
        raise
    batching = config.dynamic_batching
    policy: SchedulingPolicy = (
        WindowPolicy(
            DynamicBatchPolicy(config.max_batch_size, batching),
            batching.max_queue_size,
            ctx.more_expected,
        )
        if controller is None
        else SLOPolicy(controller, max(1, config.max_batch_size), batching.max_queue_size)
    )
    batcher = Batcher(
        f"{config.name}:{version}",
        runtime,
        policy,
        batched=config.max_batch_size > 0,
        inline=inline,
        max_rows=max(0, config.max_batch_size),
        on_batch=metrics.observe_batch,
        stats=metrics.scheduler,
    )
    batcher.start()
    metrics.track_queue_depth(lambda: batcher.queue_depth)
    exit_counts = getattr(runtime, "exit_counts", None)
    if exit_counts is not None:
        getattr(runtime, "reset_exit_counts")()  # noqa: B009 (warmup's rows are not answers)
        metrics.track_exits(exit_counts)
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
        cache=cache,
        # Up to 4x what the model accepts is still decoded, so that the dataplane can name
        # the mismatch (batch size, shape); far beyond that is refused before parsing.
        decode_limits=limits_for_model(
            runtime.inputs, 4 * max(1, config.max_batch_size), ctx.decode_limits
        ),
        labels=labels,
        row_parameters=tuple(getattr(runtime, "row_parameters", ())),
    )
    timed = "not timed" if warmed.batch_ns is None else f"{warmed.batch_ns / 1e6:.3f} ms"
    log.info(
        "loaded %s version %s (%s, %s, largest warmup batch %s)",
        config.name, version, config.backend, "inline" if inline else "threaded", timed,
    )  # fmt: skip
    return mv
