"""Prometheus metrics of the response cache; label children are resolved once per model."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge


@dataclass(slots=True)
class ModelCacheMetrics:
    """One model version's pre-resolved children: the hot path only calls ``inc``."""

    memory_hit: Counter
    memory_miss: Counter
    redis_hit: Counter
    redis_miss: Counter
    coalesced: Counter
    redis_errors: Counter
    redis_dropped_writes: Counter
    invalid_values: Counter
    rejected_signature: Counter
    rejected_format: Counter
    rejected_outputs: Counter
    breaker_open: Gauge
    _owner: CacheMetrics
    _model: str
    _version: str

    def track_bytes(self, read: Callable[[], float]) -> None:
        """Report L1's size by calling ``read`` at scrape time (no hot-path cost)."""
        self._owner.bytes.labels(self._model, self._version).set_function(read)

    def release(self) -> None:
        """Forget this version's L1 size series (the version was unloaded)."""
        with contextlib.suppress(KeyError):
            self._owner.bytes.remove(self._model, self._version)


class CacheMetrics:
    """The cache's metric families, registered once per server on ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "rtserve_cache_requests",
            "Response-cache lookups by tier and result (hit|miss).",
            ["model", "version", "tier", "result"],
            registry=registry,
        )
        self.coalesced = Counter(
            "rtserve_cache_coalesced",
            "Requests answered by an identical request already in flight (single-flight).",
            ["model", "version"],
            registry=registry,
        )
        self.redis_errors = Counter(
            "rtserve_cache_redis_errors",
            "Redis calls that failed or timed out (the request went on without Redis).",
            ["model"],
            registry=registry,
        )
        self.redis_dropped_writes = Counter(
            "rtserve_cache_redis_dropped_writes",
            "Redis writes dropped because the write queue was full or the breaker open.",
            ["model"],
            registry=registry,
        )
        self.invalid_values = Counter(
            "rtserve_cache_invalid_values",
            "Redis values rejected (treated as misses): not authentic, malformed, or not "
            "matching the model's outputs.",
            ["model"],
            registry=registry,
        )
        self.rejected_values = Counter(
            "rtserve_cache_rejected_values",
            "Redis values rejected by reason: signature (HMAC check failed: written "
            "without the key or under another key), format (not a cache entry), outputs "
            "(names, datatypes or shapes do not match the model's outputs).",
            ["model", "reason"],
            registry=registry,
        )
        self.breaker_open = Gauge(
            "rtserve_cache_breaker_open",
            "1 while the Redis circuit breaker is open (Redis skipped), else 0.",
            ["model"],
            registry=registry,
        )
        self.bytes = Gauge(
            "rtserve_cache_bytes",
            "Bytes held by the in-process (L1) cache.",
            ["model", "version"],
            registry=registry,
        )

    def for_model(self, model: str, version: str) -> ModelCacheMetrics:
        req = self.requests
        return ModelCacheMetrics(
            memory_hit=req.labels(model, version, "memory", "hit"),
            memory_miss=req.labels(model, version, "memory", "miss"),
            redis_hit=req.labels(model, version, "redis", "hit"),
            redis_miss=req.labels(model, version, "redis", "miss"),
            coalesced=self.coalesced.labels(model, version),
            redis_errors=self.redis_errors.labels(model),
            redis_dropped_writes=self.redis_dropped_writes.labels(model),
            invalid_values=self.invalid_values.labels(model),
            rejected_signature=self.rejected_values.labels(model, "signature"),
            rejected_format=self.rejected_values.labels(model, "format"),
            rejected_outputs=self.rejected_values.labels(model, "outputs"),
            breaker_open=self.breaker_open.labels(model),
            _owner=self,
            _model=model,
            _version=version,
        )
