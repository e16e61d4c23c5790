"""The response cache of one model version: L1 (memory) then L2 (Redis) then the model.

Lookup order: L1 → (single-flight on the key) → L2 → run the model. A miss stores the
answer in L1 at once and queues the L2 write, so Redis never delays a response. Cached
arrays are private read-only copies; every caller gets fresh Tensor objects over them, so
a frontend that sets ``parameters`` on an output cannot change what the next caller sees.

Entries are kept as flat tuples of strings and arrays (which the cyclic garbage collector
does not track; it stops tracking such a tuple the first time it sees one), so L1 entries
never reach the oldest generation and a large L1 adds nothing to full-collection pauses.
Tensor objects and nested tuples did: a growing 50k-entry L1 triggered gen-2 collections
of tens of milliseconds each.

A value read from Redis is used only if it is authentic (see ``redis_tier``), decodes,
and matches what the model would answer: the requested output names in order, and, when
the model's output signature is given, each output's datatype and shape (the request's
rows first when the model batches). Anything else is a miss, counted by reason.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

import numpy as np

from rtserve.cache.codec import CacheDecodeError, decode, encode
from rtserve.cache.config import CacheConfig
from rtserve.cache.keys import cache_key
from rtserve.cache.memory import MemoryCache
from rtserve.cache.metrics import CacheMetrics
from rtserve.cache.redis_tier import RedisTier
from rtserve.cache.singleflight import SingleFlight, WaitTimeout
from rtserve.errors import ClientClosed, DeadlineExceeded, InvalidInput, ObjectiveRefused
from rtserve.protocol.types import InferRequest, Tensor

# The tier a response came from, as returned by ResponseCache.lookup_or_run.
TIER_MEMORY = "memory"
TIER_REDIS = "redis"
TIER_MISS = ""
TIER_BYPASS = "bypass"

# Request parameter that opts one call out of the cache: {"parameters": {"cache": false}}.
OPT_OUT_PARAMETER = "cache"

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})

# Cached outputs, flat: (name, datatype, read-only array, parameters, name, ...) where
# parameters is None or a flat (key, value, key, value, ...) tuple.
_Stored = tuple[Any, ...]
_FIELDS = 4
# Failures of the leader's own request (its deadline, its priority, its client), not of
# the work: requests waiting on it start over instead of getting them.
_HANDOFF = (DeadlineExceeded, ObjectiveRefused, ClientClosed)


class OutputSpec(Protocol):
    """One model output as the cache checks it (``rtserve.config.TensorSpec`` fits):
    ``shape`` is per row when the model batches; -1 is any size."""

    @property
    def name(self) -> str: ...
    @property
    def datatype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...


class ResponseCache:
    """Create one per loaded model version whose merged config is enabled.

    ``outputs``: the model's output signature (every output, in the model's order) and
    ``max_batch_size`` (> 0: shapes are per row and the first dimension is the rows):
    values from Redis must match them. Without ``outputs`` only the names requested are
    checked.
    """

    def __init__(
        self,
        config: CacheConfig,
        model_name: str,
        version: str,
        metrics: CacheMetrics,
        outputs: Iterable[OutputSpec] | None = None,
        max_batch_size: int = 0,
    ) -> None:
        if not config.enabled:
            raise ValueError(f"model {model_name!r}: response cache config has no tier enabled")
        self.model_name = model_name
        self.version = version
        # What else the answers depend on, asked per request (an ensemble: its steps' live
        # versions, so a reloaded step never serves the old answers); None: nothing.
        self.salt: Callable[[], str] | None = None
        self._round = config.round_floats
        self._metrics = m = metrics.for_model(model_name, version)
        self._memory: MemoryCache[_Stored] | None = None
        if config.memory is not None:
            memory: MemoryCache[_Stored] = MemoryCache(config.memory.max_bytes, config.memory.ttl_s)
            self._memory = memory
            m.track_bytes(lambda: memory.size_bytes)
        self._redis: RedisTier | None = None
        if config.redis is not None:
            self._redis = RedisTier(config.redis, model_name, version, m)
        self._flights: SingleFlight[bytes, tuple[_Stored, str]] = SingleFlight(_HANDOFF)
        self._outputs: dict[str, tuple[str, tuple[int, ...]]] | None = None
        if outputs is not None:
            self._outputs = {o.name: (o.datatype, tuple(o.shape)) for o in outputs}
        self._batched = max_batch_size > 0

    @property
    def memory(self) -> MemoryCache[_Stored] | None:
        return self._memory

    @property
    def redis(self) -> RedisTier | None:
        return self._redis

    async def lookup_or_run(
        self, request: InferRequest, run: Callable[[], Awaitable[list[Tensor]]]
    ) -> tuple[list[Tensor], str]:
        """``(outputs, tier)``; tier is "memory", "redis", "" (the model ran) or "bypass".

        ``run`` must return the outputs the request asked for, in the order asked. A
        request with ``parameters: {cache: false}`` runs directly and touches no tier.
        Callers waiting on an identical request in flight get its tier.
        """
        outputs, key = self.lookup_memory(request)
        if outputs is not None:
            return outputs, TIER_MEMORY
        if key is None:
            return await run(), TIER_BYPASS
        return await self.fill(key, request, run)

    def lookup_memory(self, request: InferRequest) -> tuple[list[Tensor] | None, bytes | None]:
        """The synchronous first step of :meth:`lookup_or_run`: the L1 probe.

        Returns ``(outputs, key)``: outputs on an L1 hit (tier "memory"); otherwise None and
        the key to hand to :meth:`fill`, or None for both when the request opted out (run it
        directly; tier "bypass"). Lets a callback-style frontend answer L1 hits without
        creating a task.
        """
        params = request.parameters
        if params and OPT_OUT_PARAMETER in params and not wants_cache(params[OPT_OUT_PARAMETER]):
            return None, None
        version = self.version if self.salt is None else f"{self.version}+{self.salt()}"
        key = cache_key(self.model_name, version, request.inputs, request.outputs, self._round)
        memory = self._memory
        if memory is not None:
            stored = memory.get(key)
            if stored is not None:
                self._metrics.memory_hit.inc()
                return _fresh(stored), key
            self._metrics.memory_miss.inc()
        return None, key

    async def fill(
        self,
        key: bytes,
        request: InferRequest,
        run: Callable[[], Awaitable[list[Tensor]]],
        timeout_s: float = 0.0,
    ) -> tuple[list[Tensor], str]:
        """The rest after an L1 miss: single-flight on ``key``, then L2, then ``run``.

        ``timeout_s`` > 0: the request's own deadline, which bounds its wait on an identical
        request in flight (``run`` applies it to a run of its own). A leader that fails on
        its own deadline or client does not fail the requests waiting on it.
        """
        try:
            (stored, tier), shared = await self._flights.do(
                key, self._fill, key, request, run, wait_s=timeout_s
            )
        except WaitTimeout:
            raise DeadlineExceeded(
                f"model '{self.model_name}': request timed out after {timeout_s * 1e3:.3g} ms "
                "waiting for an identical request in flight"
            ) from None
        if shared:
            self._metrics.coalesced.inc()
        return _fresh(stored), tier

    async def close(self) -> None:
        """Send queued Redis writes (briefly), close the client, drop L1 and its series."""
        if self._redis is not None:
            await self._redis.close()
        if self._memory is not None:
            self._memory.clear()
        self._metrics.release()

    async def _fill(
        self, key: bytes, request: InferRequest, run: Callable[[], Awaitable[list[Tensor]]]
    ) -> tuple[_Stored, str]:
        redis = self._redis
        if redis is not None:
            value = await redis.get(key)
            if value is not None:
                stored = self._decode(value, request)
                if stored is not None:
                    self._metrics.redis_hit.inc()
                    if self._memory is not None:
                        self._memory.put(key, stored, len(value))
                    return stored, TIER_REDIS
            self._metrics.redis_miss.inc()
        outputs = await run()
        stored, nbytes = _freeze(outputs)
        if self._memory is not None:
            self._memory.put(key, stored, nbytes)
        if redis is not None:
            try:
                value = encode(outputs)
            except ValueError:
                self._metrics.redis_dropped_writes.inc()
            else:
                redis.put(key, value)
        return stored, TIER_MISS

    def _decode(self, value: bytes, request: InferRequest) -> _Stored | None:
        try:
            tensors = decode(value)
        except CacheDecodeError:
            self._metrics.invalid_values.inc()
            self._metrics.rejected_format.inc()
            return None
        if not self._matches(tensors, request):
            self._metrics.invalid_values.inc()
            self._metrics.rejected_outputs.inc()
            return None
        return _flat(tensors, [t.data for t in tensors])

    def _matches(self, tensors: Sequence[Tensor], request: InferRequest) -> bool:
        """Do the cached outputs look like the model's answer to ``request``?"""
        names = [t.name for t in tensors]
        signature = self._outputs
        if request.outputs:
            if names != [o.name for o in request.outputs]:
                return False
        elif signature is not None and names != list(signature):
            return False
        if signature is None:
            return True
        rows = request.inputs[0].shape[0] if self._batched and request.inputs else None
        for t in tensors:
            spec = signature.get(t.name)
            if spec is None:
                return False
            datatype, dims = spec
            if t.datatype != datatype:
                return False
            shape = t.data.shape
            if rows is not None:
                if not shape or shape[0] != rows:
                    return False
                shape = shape[1:]
            if len(shape) != len(dims) or any(
                want != -1 and got != want for got, want in zip(shape, dims, strict=True)
            ):
                return False
        return True


def wants_cache(value: Any) -> bool:
    """Parse the ``cache`` request parameter; a value that is not a boolean is a 400."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        v = value.strip().lower()
        if v in _TRUE:
            return True
        if v in _FALSE:
            return False
    elif isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise InvalidInput(f"parameters.{OPT_OUT_PARAMETER}: expected true or false, got {value!r}")


def _freeze(outputs: Sequence[Tensor]) -> tuple[_Stored, int]:
    """Private read-only copies of the outputs (a batch's views would pin the whole batch)."""
    arrays = []
    nbytes = 0
    for t in outputs:
        data = np.array(t.data, copy=True, order="C")
        data.flags.writeable = False
        if data.dtype == np.object_:
            nbytes += 8 * data.size + sum(len(e) for e in data.reshape(-1))
        else:
            nbytes += data.nbytes
        arrays.append(data)
    return _flat(outputs, arrays), nbytes


def _flat(tensors: Sequence[Tensor], arrays: Sequence[np.ndarray[Any, Any]]) -> _Stored:
    out: list[Any] = []
    for t, data in zip(tensors, arrays, strict=True):
        params = None
        if t.parameters:
            params = tuple(x for item in t.parameters.items() for x in item)
        out += (t.name, t.datatype, data, params)
    return tuple(out)


def _fresh(stored: _Stored) -> list[Tensor]:
    out = []
    for i in range(0, len(stored), _FIELDS):
        name, datatype, data, params = stored[i : i + _FIELDS]
        p = dict(zip(params[::2], params[1::2], strict=True)) if params else None
        out.append(Tensor(name, datatype, data.shape, data, p))
    return out
