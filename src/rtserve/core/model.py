"""A live model version, and how one runtime becomes one.

``ModelVersion`` = runtime + scheduler (the dynamic batcher, or an ensemble's step
scheduler) + response cache + metrics, with ``drain``/``stop``. ``build_runtime_version``
wires a runtime backend's version (load, labels, warmup, the policy ``core/policies.py``
chooses, batcher, cache); ``core/factory.py`` picks the builder for the config's ``backend``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from rtserve.config import ModelConfig, TensorSpec
from rtserve.core.capabilities import Capability
from rtserve.core.labels import read_labels
from rtserve.core.policies import PolicyInput, build_policy
from rtserve.core.warmup import Warmed, warmup
from rtserve.errors import ConfigError, RTServeError
from rtserve.extras import install_hint
from rtserve.observability.metrics import Metrics, ModelMetrics
from rtserve.protocol.limits import DEFAULT_LIMITS, DecodeLimits, limits_for_model
from rtserve.protocol.types import Timings
from rtserve.runtime.base import Runtime
from rtserve.runtime.parameters import RowParameter
from rtserve.scheduling.base import SchedulingPolicy
from rtserve.scheduling.batcher import Batcher

if TYPE_CHECKING:
    from rtserve.cache import CacheConfig, CacheMetrics, ResponseCache

log = logging.getLogger(__name__)

# A model whose largest warmup batch runs faster than this runs inline on the event loop.
INLINE_MAX_BATCH_NS = 1_000_000

Outputs = dict[str, np.ndarray]
T = TypeVar("T")


class VersionScheduler(Protocol):
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
    scheduler: VersionScheduler
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
    # What a backend offers beyond tensors, by key (``core/capabilities.py``; ``GENERATE``:
    # the generation engine of a ``backend: llm`` version); read with ``capability``.
    capabilities: dict[Capability[Any], object] = dataclasses.field(default_factory=dict)

    def capability(self, key: Capability[T]) -> T | None:
        """What the backend offers under ``key``, or None (a plain tensor model)."""
        return self.capabilities.get(key)  # type: ignore[return-value]

    def early_refusal(self, received_ns: int) -> RTServeError | None:
        """The scheduler's refusal before decoding (``VersionScheduler.refuse_early``), or None;
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
    runtime = await _load(load, config, version_dir)
    try:
        if runtime.max_batch_size != config.max_batch_size:
            config = dataclasses.replace(config, max_batch_size=runtime.max_batch_size)
        labels, warmed = await _warm(runtime, config, version_dir)
        given = PolicyInput(runtime, config, version_dir, warmed, ctx.more_expected)
        policy = await build_policy(given)
        cache = ctx.cache_for(config, version, runtime.outputs)
    except BaseException:
        runtime.close()
        raise
    inline = may_inline and _runs_inline(config, runtime, warmed)
    mv = _runtime_version(config, version, ctx, runtime, policy, inline, cache, labels)
    timed = "not timed" if warmed.batch_ns is None else f"{warmed.batch_ns / 1e6:.3f} ms"
    log.info(
        "loaded %s version %s (%s, %s, largest warmup batch %s)",
        config.name, version, config.backend, "inline" if inline else "threaded", timed,
    )  # fmt: skip
    return mv


async def _load(
    load: Callable[[ModelConfig, Path], Runtime], config: ModelConfig, version_dir: Path
) -> Runtime:
    """The runtime, loaded off the event loop; a failure names the directory (and the
    extra to install when a library is missing)."""
    try:
        return await asyncio.get_running_loop().run_in_executor(None, load, config, version_dir)
    except ConfigError:
        raise
    except Exception as exc:
        log.error("loading %s failed", version_dir, exc_info=exc)
        hint = install_hint(exc, config.backend)
        raise ConfigError(
            f"{version_dir}: loading failed: {type(exc).__name__}: {exc}{hint}"
        ) from exc


async def _warm(
    runtime: Runtime, config: ModelConfig, version_dir: Path
) -> tuple[dict[str, tuple[str, ...]], Warmed]:
    """The outputs' class labels, then the warmup batches (both off the event loop)."""
    loop = asyncio.get_running_loop()
    labels = await loop.run_in_executor(None, read_labels, config, version_dir.parent, runtime)
    try:
        warmed = await loop.run_in_executor(None, warmup, runtime, config)
    except Exception as exc:
        raise ConfigError(f"{version_dir}: warmup failed: {type(exc).__name__}: {exc}") from exc
    return labels, warmed


def _runs_inline(config: ModelConfig, runtime: Runtime, warmed: Warmed) -> bool:
    """Whether batches run on the event loop: asked for, or (``auto``) one instance whose
    largest warmup batch took under ``INLINE_MAX_BATCH_NS``."""
    mode = config.onnxruntime.execution
    return mode == "inline" or (
        mode == "auto"
        and runtime.instance_count == 1
        and warmed.batch_ns is not None
        and warmed.batch_ns < INLINE_MAX_BATCH_NS
    )


def _runtime_version(
    config: ModelConfig,
    version: str,
    ctx: BuildContext,
    runtime: Runtime,
    policy: SchedulingPolicy,
    inline: bool,
    cache: ResponseCache | None,
    labels: dict[str, tuple[str, ...]],
) -> ModelVersion:
    """The batcher (started) and its metrics around ``runtime``, as a live version."""
    metrics = ctx.metrics.model(config.name, version)
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
    return ModelVersion(
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
