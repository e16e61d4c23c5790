"""L2: Redis through redis-py's asyncio client. Redis trouble never fails a request.

Every call is bounded by the tier's short timeout and never retried; a failure counts as a
miss (reads) or a dropped write. A circuit breaker skips Redis after repeated failures and
probes it with PING in the background once per cool-down, so no request waits on a dead
Redis.

A redis-py command costs ~45 us of CPU whatever its size, more than a small model's share
of a batch, so both directions are batched: reads issued in the same event-loop iteration
go out as one ``MGET``, and writes go through a bounded queue drained by one background
task that pipelines ``SET key value PX ttl`` (a miss pays a deque append, never a round
trip).

Values are authenticated: what is stored is ``value + HMAC-SHA256(key, redis key + value)``
(32 bytes), so a value written by anyone without the key, or moved from another key, is
a miss (counted as ``rtserve_cache_rejected_values{reason="signature"}``). Without a
configured key each process uses its own random key (see ``RedisTierConfig``), with one
warning per process.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
from collections import deque
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from rtserve.cache.breaker import BreakerState, CircuitBreaker
from rtserve.cache.config import RedisTierConfig
from rtserve.cache.metrics import ModelCacheMetrics

_WRITE_BATCH = 128
_READ_BATCH = 128
TAG_BYTES = 32
_TAG_CONTEXT = b"rtserve-cache-v1\0"
log = logging.getLogger(__name__)
_process_keys: dict[int, bytes] = {}


def process_key() -> bytes:
    """This process's random signing key (a forked child draws its own)."""
    pid = os.getpid()
    key = _process_keys.get(pid)
    if key is None:
        key = _process_keys[pid] = secrets.token_bytes(32)
    return key


def _unkeyed(model_name: str) -> bytes:
    """The per-process key, with one warning per process (not one per model)."""
    if os.getpid() not in _process_keys:
        log.warning(
            "model %s (and any other without a key): response_cache.redis has no hmac_key "
            "or hmac_key_env, so values are signed with a random key of this process: "
            "other processes, replicas and this server after a restart reject them "
            '(rtserve_cache_rejected_values{reason="signature"}); see docs/cache.md',
            model_name,
        )
    return process_key()


def _tag(key: bytes, redis_key: bytes, value: bytes) -> bytes:
    return hmac.digest(key, b"".join((_TAG_CONTEXT, redis_key, b"\0", value)), "sha256")


def sign(key: bytes, redis_key: bytes, value: bytes) -> bytes:
    """``value`` followed by its tag; the tag binds the value to its Redis key."""
    return value + _tag(key, redis_key, value)


def verify(key: bytes, redis_key: bytes, stored: bytes) -> bytes | None:
    """The value inside ``stored`` if its tag is right, else None."""
    if len(stored) < TAG_BYTES:
        return None
    value = stored[:-TAG_BYTES]
    if not hmac.compare_digest(_tag(key, redis_key, value), stored[-TAG_BYTES:]):
        return None
    return value


def key_prefix(namespace: str, model_name: str, version: str) -> bytes:
    """Every key of one model version starts with this, so a new version never reads old ones."""
    return f"rtserve:{namespace}:{model_name}:{version}:".encode()


class RedisTier:
    def __init__(
        self, config: RedisTierConfig, model_name: str, version: str, metrics: ModelCacheMetrics
    ) -> None:
        timeout_s = config.timeout_ms / 1000.0
        self.prefix = key_prefix(config.namespace, model_name, version)
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s)
        self._timeout_s = timeout_s
        self._ttl_ms = max(1, int(config.ttl_s * 1000))
        self._max_pending = config.max_pending_writes
        self._metrics = metrics
        self._key = config.hmac_key if config.hmac_key is not None else _unkeyed(model_name)
        self._client = aioredis.Redis.from_url(
            config.url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        self._pending: deque[tuple[bytes, bytes]] = deque()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._writer: asyncio.Task[None] | None = None
        self._reads: list[tuple[bytes, asyncio.Future[bytes | None]]] = []
        self._readers: set[asyncio.Task[None]] = set()
        self._probe: asyncio.Task[None] | None = None
        self._closed = False
        metrics.breaker_open.set(0)

    def redis_key(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    async def get(self, key: bytes) -> bytes | None:
        """The stored value, or None on a miss, an error, while the breaker is open, or
        when the value is not signed with this tier's key for this Redis key."""
        if not self._usable():
            return None
        redis_key = self.redis_key(key)
        fut: asyncio.Future[bytes | None] = asyncio.get_running_loop().create_future()
        self._reads.append((redis_key, fut))
        if len(self._reads) == 1:
            asyncio.get_running_loop().call_soon(self._send_reads)
        stored = await fut
        if stored is None:
            return None
        value = verify(self._key, redis_key, stored)
        if value is None:
            self._metrics.invalid_values.inc()
            self._metrics.rejected_signature.inc()
        return value

    def _send_reads(self) -> None:
        """Runs once per loop iteration that queued reads: one MGET per ``_READ_BATCH``."""
        reads, self._reads = self._reads, []
        loop = asyncio.get_running_loop()
        for i in range(0, len(reads), _READ_BATCH):
            task = loop.create_task(self._mget(reads[i : i + _READ_BATCH]))
            self._readers.add(task)
            task.add_done_callback(self._readers.discard)

    async def _mget(self, reads: list[tuple[bytes, asyncio.Future[bytes | None]]]) -> None:
        values: Sequence[object] = ()
        try:
            async with asyncio.timeout(self._timeout_s * 2):
                values = await self._client.mget([k for k, _ in reads])
        except Exception:
            self._failed()
        else:
            self._succeeded()
        finally:  # also when cancelled by close(): nobody is left waiting
            for i, (_, fut) in enumerate(reads):
                value = values[i] if i < len(values) else None
                if not fut.done():
                    fut.set_result(value if isinstance(value, bytes) else None)

    def put(self, key: bytes, value: bytes) -> None:
        """Queue a write; returns at once. Dropped (and counted) if the queue is full."""
        if self._closed or not self._usable() or len(self._pending) >= self._max_pending:
            self._metrics.redis_dropped_writes.inc()
            return
        redis_key = self.redis_key(key)
        self._pending.append((redis_key, sign(self._key, redis_key, value)))
        self._idle.clear()
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_loop())
        self._wake.set()

    async def flush(self) -> None:
        """Wait until the queued writes have been sent (or dropped); for tests and close."""
        if self._writer is not None and not self._writer.done():
            await self._idle.wait()

    async def close(self) -> None:
        self._closed = True
        if self._writer is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.1, self._timeout_s * 4)):
                    await self.flush()
        for task in (self._writer, self._probe, *self._readers):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        with contextlib.suppress(Exception):
            await self._client.aclose()

    async def disconnect(self) -> None:
        """Close the open connections; the next command opens new ones (before a VM
        snapshot is taken: no connection may be restored in several copies)."""
        await self._client.connection_pool.disconnect()

    def _usable(self) -> bool:
        breaker = self.breaker
        if breaker.state is BreakerState.CLOSED:
            return True
        if breaker.probe_due() and not self._closed:
            self._probe = asyncio.get_running_loop().create_task(self._run_probe())
        return False

    async def _run_probe(self) -> None:
        try:
            async with asyncio.timeout(self._timeout_s * 2):
                await self._client.ping()
        except Exception:
            self._failed()
        else:
            self._succeeded()

    def _succeeded(self) -> None:
        if self.breaker.state is not BreakerState.CLOSED:
            self._metrics.breaker_open.set(0)
        self.breaker.record_success()

    def _failed(self) -> None:
        self._metrics.redis_errors.inc()
        if self.breaker.record_failure():
            self._metrics.breaker_open.set(1)
            dropped = len(self._pending)
            self._pending.clear()
            if dropped:
                self._metrics.redis_dropped_writes.inc(dropped)

    async def _write_loop(self) -> None:
        pending = self._pending
        px = self._ttl_ms
        while True:
            await self._wake.wait()
            self._wake.clear()
            while pending:
                n = min(len(pending), _WRITE_BATCH)
                pipe = self._client.pipeline(transaction=False)
                for _ in range(n):
                    k, v = pending.popleft()
                    pipe.set(k, v, px=px)
                try:
                    async with asyncio.timeout(self._timeout_s * 2):
                        await pipe.execute()
                except Exception:
                    self._failed()
                    self._metrics.redis_dropped_writes.inc(n)
                else:
                    self._succeeded()
            self._idle.set()
