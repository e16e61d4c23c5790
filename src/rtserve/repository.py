"""The model repository on disk: ``<repo>/<model>/config.yaml`` and
``<repo>/<model>/<version>/model.onnx``.

Each model loads on its own: a config or model error is recorded (and reported by the
model's readiness and the repository index) without stopping the other models.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rtserve.config import ModelConfig, TensorSpec, load_yaml, parse_model_config
from rtserve.errors import ConfigError, ModelNotFound, ModelNotReady
from rtserve.observability.metrics import Metrics, ModelMetrics
from rtserve.protocol.types import DATATYPE_TO_NUMPY
from rtserve.runtime.base import Runtime, load_runtime
from rtserve.scheduling.batcher import Batcher
from rtserve.scheduling.policy import DynamicBatchPolicy

log = logging.getLogger(__name__)

# A model whose largest warmup batch runs faster than this runs inline on the event loop.
INLINE_MAX_BATCH_NS = 1_000_000


@dataclass(slots=True)
class ModelVersion:
    name: str
    version: str
    config: ModelConfig
    runtime: Runtime
    batcher: Batcher
    metrics: ModelMetrics
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    cache: Any = None  # rtserve.cache.ResponseCache when configured
    ready: bool = False


@dataclass(slots=True)
class Model:
    name: str
    config: ModelConfig | None = None
    versions: dict[str, ModelVersion] = field(default_factory=dict)
    latest: str = ""
    error: str = ""


def _example_batch(specs: tuple[TensorSpec, ...], rows: int, batched: bool) -> dict[str, Any]:
    feeds: dict[str, Any] = {}
    for spec in specs:
        dims = tuple(d if d >= 0 else 1 for d in spec.shape)
        shape = (rows, *dims) if batched else dims
        if spec.datatype == "BYTES":
            feeds[spec.name] = np.full(shape, "", dtype=object)
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
            feeds = _example_batch(runtime.inputs, size, batched)
            for _ in range(max(1, config.warmup.iterations)):
                start = time.perf_counter_ns()
                runtime.run(instance, feeds)
                if size == largest:
                    times.append(time.perf_counter_ns() - start)
    return int(statistics.median(times)) if times else 0


def version_dirs(model_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())


class ModelRepository:
    def __init__(self, root: Path, metrics: Metrics, cache_default: Any = None) -> None:
        """``cache_default``: the server-wide ``rtserve.cache.CacheConfig`` (or None)."""
        self.root = root
        self.metrics = metrics
        self.cache_default = cache_default
        self._cache_metrics: Any = None
        # Set by the server: whether another request may arrive soon (see the batch policy).
        self.more_expected: Callable[[], bool] | None = None
        self.models: dict[str, Model] = {}

    # ------------------------------------------------------------------ loading
    async def load_all(self) -> None:
        if not self.root.is_dir():
            raise ConfigError(f"{self.root}: model repository is not a directory")
        for model_dir in sorted(p for p in self.root.iterdir() if p.is_dir()):
            if model_dir.name.startswith("."):
                continue
            await self.load_model(model_dir)

    async def load_model(self, model_dir: Path) -> Model:
        name = model_dir.name
        model = Model(name)
        self.models[name] = model
        where = str(model_dir / "config.yaml")
        try:
            config = parse_model_config(load_yaml(model_dir / "config.yaml"), name, where)
            model.config = config
            cache_config = self._cache_config(config)
            versions = version_dirs(model_dir)
            if config.version_policy == "latest":
                versions = versions[-1:]
            elif config.version_policy == "specific":
                missing = set(config.versions) - set(versions)
                if missing:
                    raise ConfigError(
                        f"{where}: version_policy.specific: versions {sorted(missing)} "
                        f"have no directory in {model_dir}"
                    )
                versions = [v for v in versions if v in config.versions]
            if not versions:
                raise ConfigError(
                    f"{model_dir}: no version directories (expected e.g. 1/model.onnx)"
                )
            for v in versions:
                mv = await self._load_version(config, model_dir / str(v), str(v), cache_config)
                model.versions[mv.version] = mv
            model.latest = str(versions[-1])
            log.info("model %s ready (versions %s)", name, ", ".join(model.versions))
        except ConfigError as exc:
            model.error = str(exc)
            log.error("model %s not loaded: %s", name, exc)
        return model

    async def _load_version(
        self, config: ModelConfig, version_dir: Path, version: str, cache_config: Any
    ) -> ModelVersion:
        loop = asyncio.get_running_loop()
        runtime = await loop.run_in_executor(None, load_runtime, config, version_dir)
        if runtime.max_batch_size != config.max_batch_size:
            config = dataclasses.replace(config, max_batch_size=runtime.max_batch_size)
        try:
            batch_ns = await loop.run_in_executor(None, warmup, runtime, config)
        except Exception as exc:
            runtime.close()
            raise ConfigError(f"{version_dir}: warmup failed: {exc}") from exc
        mode = config.onnxruntime.execution
        inline = mode == "inline" or (
            mode == "auto" and runtime.instance_count == 1 and batch_ns < INLINE_MAX_BATCH_NS
        )
        metrics = self.metrics.model(config.name, version)
        batcher = Batcher(
            f"{config.name}:{version}",
            runtime,
            DynamicBatchPolicy(config.max_batch_size, config.dynamic_batching),
            config.dynamic_batching.max_queue_size,
            batched=config.max_batch_size > 0,
            inline=inline,
            on_batch=metrics.observe_batch,
            more_expected=self.more_expected,
        )
        batcher.start()
        metrics.track_queue_depth(lambda: batcher.queue_depth)
        mv = ModelVersion(
            name=config.name,
            version=version,
            config=config,
            runtime=runtime,
            batcher=batcher,
            metrics=metrics,
            inputs={s.name: s for s in runtime.inputs},
            outputs={s.name: s for s in runtime.outputs},
        )
        if cache_config is not None:
            from rtserve.cache import CacheMetrics, ResponseCache

            if self._cache_metrics is None:
                self._cache_metrics = CacheMetrics(self.metrics.registry)
            mv.cache = ResponseCache(cache_config, config.name, version, self._cache_metrics)
        mv.ready = True
        log.info(
            "loaded %s version %s (%s, largest warmup batch %.3f ms)",
            config.name, version, "inline" if inline else "threaded", batch_ns / 1e6,
        )  # fmt: skip
        return mv

    def _cache_config(self, config: ModelConfig) -> Any:
        """The model's response cache config merged over the server default; None if off."""
        if config.response_cache is None and self.cache_default is None:
            return None
        from rtserve.cache import CacheConfig, merge

        own = (
            CacheConfig.from_dict(config.response_cache, config.source)
            if config.response_cache is not None
            else None
        )
        merged = merge(self.cache_default, own)
        return merged if merged.enabled else None

    # ------------------------------------------------------------------ lookup
    def get(self, name: str, version: str = "") -> ModelVersion:
        mv = self.get_loaded(name, version)
        if not mv.ready:
            raise ModelNotReady(f"model '{name}' version {mv.version} is not ready")
        return mv

    def get_loaded(self, name: str, version: str = "") -> ModelVersion:
        """Like ``get`` but also returns versions that are not ready (for metadata/readiness)."""
        model = self.models.get(name)
        if model is None:
            raise ModelNotFound(f"unknown model '{name}'")
        if model.error:
            raise ModelNotReady(f"model '{name}' is not available: {model.error}")
        mv = model.versions.get(version or model.latest)
        if mv is None:
            raise ModelNotFound(
                f"unknown version '{version}' of model '{name}' "
                f"(available: {', '.join(model.versions)})"
            )
        return mv

    def loaded_versions(self) -> list[ModelVersion]:
        return [v for m in self.models.values() for v in m.versions.values()]

    def set_ready(self, ready: bool) -> None:
        for mv in self.loaded_versions():
            mv.ready = ready

    async def stop(self) -> None:
        for mv in self.loaded_versions():
            await mv.batcher.stop()
            if mv.cache is not None:
                await mv.cache.close()
            mv.runtime.close()
