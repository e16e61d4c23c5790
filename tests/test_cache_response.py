"""ResponseCache against a real redis-server: tiers, TTL, eviction, isolation, opt-out,
single-flight, Redis dying and coming back, hung Redis, and poisoned values."""

from __future__ import annotations

import asyncio
import functools
import gc
import os
import pickle
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from rtserve.cache import CacheConfig, CacheMetrics, ResponseCache
from rtserve.cache.codec import encode
from rtserve.cache.keys import cache_key
from rtserve.errors import InvalidInput
from rtserve.protocol.types import InferRequest, RequestedOutput, Tensor
from tests.cache_fixtures import RedisServer

MODEL = "mlp"


def async_test(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test (with its fixtures) in a fresh event loop."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(fn(*args, **kwargs))

    return run


def request(seed: int, params: dict[str, Any] | None = None, version: str = "") -> InferRequest:
    x = np.full((1, 8), seed, dtype=np.float32)
    return InferRequest(
        MODEL,
        version,
        [Tensor("input", "FP32", (1, 8), x)],
        [RequestedOutput("output")],
        parameters=params or {},
    )


class Model:
    """A counting stand-in for the batcher: output = 2 * input."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.runs = 0
        self.delay_s = delay_s

    def runner(self, req: InferRequest) -> Callable[[], Awaitable[list[Tensor]]]:
        async def run() -> list[Tensor]:
            self.runs += 1
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            y = req.inputs[0].data * 2
            return [Tensor("output", "FP32", y.shape, y)]

        return run


class Harness:
    def __init__(self, redis: RedisServer | None, registry: CollectorRegistry | None = None):
        self.redis = redis
        self.registry = registry or CollectorRegistry()
        self.metrics = CacheMetrics(self.registry)
        self.model = Model()

    def cache(
        self,
        memory: dict[str, Any] | None = None,
        redis: dict[str, Any] | None = None,
        version: str = "1",
        **extra: Any,
    ) -> ResponseCache:
        section: dict[str, Any] = dict(extra)
        if memory is not None:
            section["memory"] = memory
        if redis is not None:
            assert self.redis is not None
            section["redis"] = {"url": self.redis.url, "ttl_s": 60, **redis}
        cfg = CacheConfig.from_dict(section, "test.yaml")
        return ResponseCache(cfg, MODEL, version, self.metrics)

    async def ask(self, cache: ResponseCache, req: InferRequest) -> str:
        outputs, tier = await cache.lookup_or_run(req, self.model.runner(req))
        assert [t.name for t in outputs] == ["output"]
        np.testing.assert_array_equal(outputs[0].data, req.inputs[0].data * 2)
        return tier

    def count(self, tier: str, result: str, version: str = "1") -> float:
        labels = {"model": MODEL, "version": version, "tier": tier, "result": result}
        return self.registry.get_sample_value("rtserve_cache_requests_total", labels) or 0.0

    def sample(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, {"model": MODEL, **labels})


@async_test
async def test_miss_then_memory_hit_then_redis_hit_from_another_replica(redis: RedisServer) -> None:
    h = Harness(redis)
    a = h.cache(memory={"max_bytes": 1 << 20, "ttl_s": 60}, redis={})
    assert await h.ask(a, request(1)) == ""
    assert await h.ask(a, request(1)) == "memory"
    assert h.model.runs == 1
    assert a.redis is not None
    await a.redis.flush()
    # A second replica (own L1, same Redis) finds the answer in L2, then in its L1.
    b = Harness(redis).cache(memory={"max_bytes": 1 << 20}, redis={})
    b_model = Model()
    out, tier = await b.lookup_or_run(request(1), b_model.runner(request(1)))
    assert tier == "redis" and b_model.runs == 0
    np.testing.assert_array_equal(out[0].data, np.full((1, 8), 2, dtype=np.float32))
    out, tier = await b.lookup_or_run(request(1), b_model.runner(request(1)))
    assert tier == "memory" and b_model.runs == 0
    assert (h.count("memory", "hit"), h.count("memory", "miss")) == (1, 1)
    assert (h.count("redis", "hit"), h.count("redis", "miss")) == (0, 1)
    assert h.sample("rtserve_cache_bytes", version="1") == a.memory.size_bytes > 0  # type: ignore[union-attr]
    await a.close()
    await b.close()
    assert h.sample("rtserve_cache_bytes", version="1") is None


@async_test
async def test_redis_only_tier_hits_after_the_write_lands(redis: RedisServer) -> None:
    h = Harness(redis)
    c = h.cache(redis={})
    assert c.memory is None and c.redis is not None
    assert await h.ask(c, request(2)) == ""
    await c.redis.flush()
    assert await h.ask(c, request(2)) == "redis"
    assert await h.ask(c, request(3)) == ""
    assert h.model.runs == 2
    assert (h.count("redis", "hit"), h.count("redis", "miss")) == (1, 2)
    assert h.count("memory", "miss") == 0
    await c.close()


@async_test
async def test_entries_expire_after_ttl_in_both_tiers(redis: RedisServer) -> None:
    h = Harness(redis)
    mem = h.cache(memory={"max_bytes": 1 << 20, "ttl_s": 0.2})
    l2 = h.cache(redis={"ttl_s": 0.3}, version="2")
    assert await h.ask(mem, request(1)) == ""
    assert await h.ask(l2, request(1, version="2")) == ""
    await l2.redis.flush()  # type: ignore[union-attr]
    assert await h.ask(mem, request(1)) == "memory"
    assert await h.ask(l2, request(1, version="2")) == "redis"
    key = l2.redis.redis_key(cache_key(MODEL, "2", request(1).inputs, request(1).outputs))  # type: ignore[union-attr]
    ttl_ms = int(redis.command(b"PTTL", key)[1:])  # type: ignore[index]
    assert 0 < ttl_ms <= 300
    await asyncio.sleep(0.35)
    assert await h.ask(mem, request(1)) == ""
    assert await h.ask(l2, request(1, version="2")) == ""
    assert h.model.runs == 4
    await mem.close()
    await l2.close()


@async_test
async def test_memory_tier_is_bounded_by_bytes_and_evicts_least_recently_used(
    redis: RedisServer,
) -> None:
    h = Harness(redis)
    c = h.cache(memory={"max_bytes": 700, "ttl_s": 60})  # room for two 32-byte answers
    memory = c.memory
    assert memory is not None
    for seed in (1, 2):
        assert await h.ask(c, request(seed)) == ""
    assert await h.ask(c, request(1)) == "memory"  # 2 is now the least recently used
    assert await h.ask(c, request(3)) == ""
    assert len(memory) == 2 and memory.size_bytes <= 700
    assert await h.ask(c, request(2)) == ""  # evicted
    assert await h.ask(c, request(3)) == "memory"
    assert h.sample("rtserve_cache_bytes", version="1") == memory.size_bytes
    await c.close()


@async_test
async def test_model_versions_and_namespaces_never_share_entries(redis: RedisServer) -> None:
    h = Harness(redis)
    v1 = h.cache(redis={"namespace": "blue"}, version="1")
    v2 = h.cache(redis={"namespace": "blue"}, version="2")
    other_ns = h.cache(redis={"namespace": "green"}, version="1")
    assert await h.ask(v1, request(1)) == ""
    await v1.redis.flush()  # type: ignore[union-attr]
    assert await h.ask(v2, request(1)) == ""
    assert await h.ask(other_ns, request(1)) == ""
    assert await h.ask(v1, request(1)) == "redis"
    for c in (v1, v2, other_ns):
        await c.redis.flush()  # type: ignore[union-attr]
    assert h.model.runs == 3
    assert redis.command(b"DBSIZE") == b":3"
    for prefix in (b"rtserve:blue:mlp:1:*", b"rtserve:blue:mlp:2:*", b"rtserve:green:mlp:1:*"):
        reply = redis.command(b"KEYS", prefix)
        assert reply == b"*1", prefix
    for c in (v1, v2, other_ns):
        await c.close()


@async_test
async def test_request_parameter_cache_false_bypasses_every_tier(redis: RedisServer) -> None:
    h = Harness(redis)
    c = h.cache(memory={"max_bytes": 1 << 20}, redis={})
    for _ in range(2):
        assert await h.ask(c, request(1, {"cache": False})) == "bypass"
    assert await h.ask(c, request(1, {"cache": "false"})) == "bypass"
    assert h.model.runs == 3
    assert len(c.memory) == 0  # type: ignore[arg-type]
    await c.redis.flush()  # type: ignore[union-attr]
    assert redis.command(b"DBSIZE") == b":0"
    assert await h.ask(c, request(1, {"cache": True})) == ""
    assert await h.ask(c, request(1)) == "memory"
    with pytest.raises(InvalidInput, match="parameters.cache: expected true or false"):
        await h.ask(c, request(1, {"cache": "sometimes"}))
    await c.close()


@async_test
async def test_identical_concurrent_requests_run_the_model_once(redis: RedisServer) -> None:
    h = Harness(redis)
    h.model.delay_s = 0.05
    c = h.cache(memory={"max_bytes": 1 << 20}, redis={})
    results = await asyncio.gather(*(h.ask(c, request(7)) for _ in range(50)))
    assert h.model.runs == 1
    assert results == [""] * 50
    assert h.sample("rtserve_cache_coalesced_total", version="1") == 49
    # Different inputs in flight together are not merged.
    await asyncio.gather(*(h.ask(c, request(100 + i)) for i in range(5)))
    assert h.model.runs == 6
    await c.close()


@async_test
async def test_model_errors_reach_every_waiter_and_are_not_cached(redis: RedisServer) -> None:
    h = Harness(redis)
    c = h.cache(memory={"max_bytes": 1 << 20})
    runs = 0

    async def failing() -> list[Tensor]:
        nonlocal runs
        runs += 1
        await asyncio.sleep(0.02)
        raise RuntimeError("inference failed")

    results = await asyncio.gather(
        *(c.lookup_or_run(request(1), failing) for _ in range(5)), return_exceptions=True
    )
    assert runs == 1 and all(isinstance(r, RuntimeError) for r in results)
    assert await h.ask(c, request(1)) == ""
    await c.close()


@async_test
async def test_cached_arrays_cannot_be_changed_by_a_caller(redis: RedisServer) -> None:
    h = Harness(redis)
    c = h.cache(memory={"max_bytes": 1 << 20})
    await h.ask(c, request(1))
    out, tier = await c.lookup_or_run(request(1), h.model.runner(request(1)))
    assert tier == "memory"
    with pytest.raises(ValueError):
        out[0].data[0, 0] = 99
    out[0].parameters = {"binary_data_size": 32}
    out, _ = await c.lookup_or_run(request(1), h.model.runner(request(1)))
    assert out[0].parameters is None
    await c.close()


@async_test
async def test_redis_killed_mid_test_requests_succeed_breaker_opens_then_closes(
    redis: RedisServer,
) -> None:
    h = Harness(redis)
    c = h.cache(redis={"breaker_failures": 3, "breaker_cooldown_s": 0.3, "timeout_ms": 50})
    tier = c.redis
    assert tier is not None
    assert await h.ask(c, request(1)) == ""
    await tier.flush()
    assert await h.ask(c, request(1)) == "redis"
    assert h.sample("rtserve_cache_breaker_open") == 0

    redis.kill()
    started = time.perf_counter()
    for seed in range(10, 20):
        assert await h.ask(c, request(seed)) == ""  # every request still answered
    assert time.perf_counter() - started < 1.0
    assert h.sample("rtserve_cache_breaker_open") == 1
    errors_when_open = h.sample("rtserve_cache_redis_errors_total")
    assert errors_when_open is not None and errors_when_open >= 3
    for seed in range(20, 30):  # open: Redis is not even tried
        assert await h.ask(c, request(seed)) == ""
    assert h.sample("rtserve_cache_redis_errors_total") == errors_when_open

    redis.start()  # same port, empty
    deadline = time.monotonic() + 5.0
    while h.sample("rtserve_cache_breaker_open") != 0:
        assert time.monotonic() < deadline, "breaker never closed after Redis came back"
        await h.ask(c, request(1))  # a lookup after the cool-down starts the probe
        await asyncio.sleep(0.05)
    assert await h.ask(c, request(40)) == ""
    await tier.flush()
    assert await h.ask(c, request(40)) == "redis"
    await c.close()


@async_test
async def test_hung_redis_costs_a_short_timeout_not_a_failed_request(redis: RedisServer) -> None:
    h = Harness(redis)
    c = h.cache(redis={"timeout_ms": 50, "breaker_failures": 2, "breaker_cooldown_s": 60})
    assert await h.ask(c, request(1)) == ""  # connects while Redis is healthy
    assert redis.proc is not None
    os.kill(redis.proc.pid, signal.SIGSTOP)
    try:
        started = time.perf_counter()
        assert await h.ask(c, request(2)) == ""
        assert await h.ask(c, request(3)) == ""
        elapsed = time.perf_counter() - started
        assert elapsed < 0.5, elapsed
        assert h.sample("rtserve_cache_breaker_open") == 1
        started = time.perf_counter()
        assert await h.ask(c, request(4)) == ""
        assert time.perf_counter() - started < 0.02  # open: no Redis wait at all
    finally:
        os.kill(redis.proc.pid, signal.SIGCONT)
    await c.close()


class _Exploit:
    """Unpickling this would create a directory: proof that nothing unpickles values."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.makedirs, (self.path,))


@async_test
async def test_poisoned_redis_values_are_misses_and_never_executed(
    redis: RedisServer, tmp_path: Path
) -> None:
    h = Harness(redis)
    c = h.cache(redis={})
    assert c.redis is not None
    marker = tmp_path / "pwned"
    wrong_outputs = encode([Tensor("other", "FP32", (1,), np.zeros(1, np.float32))])
    poisons = [b"garbage", pickle.dumps(_Exploit(str(marker))), wrong_outputs]
    for i, poison in enumerate(poisons):
        req = request(50 + i)
        key = c.redis.redis_key(cache_key(MODEL, "1", req.inputs, req.outputs))
        assert redis.command(b"SET", key, poison) == b"+OK"
        assert await h.ask(c, req) == ""  # treated as a miss: the model ran
        await c.redis.flush()
        assert await h.ask(c, req) == "redis"  # the miss overwrote the bad value
    assert not marker.exists()
    assert h.sample("rtserve_cache_invalid_values_total") == len(poisons)
    assert h.model.runs == len(poisons)
    await c.close()


@async_test
async def test_concurrent_misses_share_one_mget_round_trip(redis: RedisServer) -> None:
    h = Harness(redis)
    c = h.cache(redis={})
    assert redis.command(b"CONFIG", b"RESETSTAT") == b"+OK"
    tiers = await asyncio.gather(*(h.ask(c, request(200 + i)) for i in range(20)))
    assert tiers == [""] * 20 and h.model.runs == 20
    assert redis.command_calls("mget") == 1
    await c.redis.flush()  # type: ignore[union-attr]
    assert redis.command_calls("set") == 20
    tiers = await asyncio.gather(*(h.ask(c, request(200 + i)) for i in range(20)))
    assert tiers == ["redis"] * 20 and h.model.runs == 20
    assert redis.command_calls("mget") == 2
    await c.close()


@async_test
async def test_a_large_memory_tier_adds_no_objects_for_the_garbage_collector_to_scan() -> None:
    h = Harness(None)
    c = h.cache(memory={"max_bytes": 1 << 26})
    for seed in range(50):  # warm up lazily created objects
        await h.ask(c, request(seed))
    gc.collect()
    before = len(gc.get_objects())
    for seed in range(50, 5050):
        await h.ask(c, request(seed))
    gc.collect()
    assert len(c.memory) == 5050  # type: ignore[arg-type]
    assert len(gc.get_objects()) - before < 100
    await c.close()


@async_test
async def test_output_parameters_survive_both_tiers(redis: RedisServer) -> None:
    h = Harness(redis)
    c = h.cache(memory={"max_bytes": 1 << 20}, redis={})
    req = request(9)
    y = np.arange(3, dtype=np.int64)

    async def run() -> list[Tensor]:
        return [Tensor("output", "INT64", (3,), y, {"content_type": "ids", "k": 2})]

    for expected_tier in ("", "memory"):
        out, tier = await c.lookup_or_run(req, run)
        assert tier == expected_tier
        assert out[0].parameters == {"content_type": "ids", "k": 2}
        np.testing.assert_array_equal(out[0].data, y)
    await c.redis.flush()  # type: ignore[union-attr]
    other = Harness(redis).cache(redis={})
    out, tier = await other.lookup_or_run(req, run)
    assert tier == "redis" and out[0].parameters == {"content_type": "ids", "k": 2}
    assert out[0].shape == (3,) and out[0].datatype == "INT64"
    await c.close()
    await other.close()


@async_test
async def test_synchronous_memory_probe_then_fill_matches_lookup_or_run(redis: RedisServer) -> None:
    h = Harness(redis)
    c = h.cache(memory={"max_bytes": 1 << 20})
    req = request(11)
    outputs, key = c.lookup_memory(req)
    assert outputs is None and key is not None
    out, tier = await c.fill(key, req, h.model.runner(req))
    assert tier == "" and h.model.runs == 1
    outputs, key2 = c.lookup_memory(req)
    assert key2 == key and outputs is not None
    np.testing.assert_array_equal(outputs[0].data, out[0].data)
    assert c.lookup_memory(request(11, {"cache": False})) == (None, None)
    assert (h.count("memory", "hit"), h.count("memory", "miss")) == (1, 1)
    await c.close()
