"""Redis cache values are authenticated (HMAC-SHA256, bound to their key) and checked
against the model's outputs before use: poisoned values written under the server's keys
by someone without the key, or signed but wrong, are misses that are counted, never
answers. Real redis-server; the last test runs a real rtserve server."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis as redis_py
from prometheus_client import CollectorRegistry

from rtserve.cache import CacheConfig, CacheMetrics, ResponseCache
from rtserve.cache.codec import encode
from rtserve.cache.keys import cache_key
from rtserve.cache.redis_tier import TAG_BYTES, sign
from rtserve.config import TensorSpec
from rtserve.errors import ConfigError
from rtserve.protocol.types import InferRequest, Tensor
from tests.cache_fixtures import RedisServer
from tests.conftest import RunningServer, start_server
from tests.models import build_scale

MODEL = "m"
KEY = "k" * 32
SIGNATURE = (TensorSpec("y", "FP32", (4,)), TensorSpec("n", "INT64", ()))


def request(seed: float, rows: int = 1) -> InferRequest:
    x = np.full((rows, 4), seed, dtype=np.float32)
    return InferRequest(MODEL, "1", [Tensor("x", "FP32", x.shape, x)], None)


def answer(req: InferRequest) -> list[Tensor]:
    x = req.inputs[0].data
    y = x * 2
    n = np.full((x.shape[0],), 7, dtype=np.int64)
    return [Tensor("y", "FP32", y.shape, y), Tensor("n", "INT64", n.shape, n)]


class Harness:
    def __init__(self, redis: RedisServer, key: str | None = KEY, signature: bool = True):
        self.redis = redis
        self.registry = CollectorRegistry()
        section: dict[str, Any] = {"redis": {"url": redis.url, "ttl_s": 60}}
        if key is not None:
            section["redis"]["hmac_key"] = key
        cfg = CacheConfig.from_dict(section, "test.yaml")
        self.cache = ResponseCache(
            cfg,
            MODEL,
            "1",
            CacheMetrics(self.registry),
            outputs=SIGNATURE if signature else None,
            max_batch_size=8,
        )
        self.runs = 0

    async def ask(self, req: InferRequest) -> tuple[list[Tensor], str]:
        async def run() -> list[Tensor]:
            self.runs += 1
            return answer(req)

        return await self.cache.lookup_or_run(req, run)

    def redis_key(self, req: InferRequest) -> bytes:
        assert self.cache.redis is not None
        return self.cache.redis.redis_key(cache_key(MODEL, "1", req.inputs, req.outputs))

    def rejected(self, reason: str) -> float:
        labels = {"model": MODEL, "reason": reason}
        return self.registry.get_sample_value("rtserve_cache_rejected_values_total", labels) or 0

    def invalid(self) -> float:
        labels = {"model": MODEL}
        return self.registry.get_sample_value("rtserve_cache_invalid_values_total", labels) or 0


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def assert_correct(outputs: list[Tensor], req: InferRequest) -> None:
    expected = answer(req)
    assert [t.name for t in outputs] == ["y", "n"]
    for got, want in zip(outputs, expected, strict=True):
        assert got.datatype == want.datatype
        np.testing.assert_array_equal(got.data, want.data)


def test_signed_values_hit_and_unsigned_poison_under_the_same_key_is_a_counted_miss(
    redis: RedisServer,
) -> None:
    async def go() -> None:
        h = Harness(redis)
        req = request(1.0)
        outputs, tier = await h.ask(req)
        assert tier == "" and h.runs == 1
        assert h.cache.redis is not None
        await h.cache.redis.flush()
        stored = redis.reply(b"GET", h.redis_key(req)) or b""
        assert len(stored) > TAG_BYTES
        outputs, tier = await h.ask(req)
        assert tier == "redis" and h.runs == 1
        assert_correct(outputs, req)
        # Well-formed values with arbitrary numbers, wrong shapes, dtypes and names,
        # written without the key: every one is a miss and the model runs.
        poisons = [
            encode([Tensor("y", "FP32", (1, 4), np.full((1, 4), 666, np.float32)),
                    Tensor("n", "INT64", (1,), np.array([7]))]),
            encode([Tensor("y", "FP64", (3, 9), np.zeros((3, 9)))]),
            encode([Tensor("evil", "BYTES", (1,), np.array([b"x"], dtype=object))]),
            b"not a cache value at all",
        ]  # fmt: skip
        for i, poison in enumerate(poisons):
            await h.cache.redis.flush()
            assert redis.command(b"SET", h.redis_key(req), poison) == b"+OK"
            outputs, tier = await h.ask(req)
            assert tier == "" and h.runs == 2 + i
            assert_correct(outputs, req)
        assert h.rejected("signature") == len(poisons) == h.invalid()
        await h.cache.close()

    run(go())


def test_tampered_payload_and_a_value_moved_from_another_key_are_misses(
    redis: RedisServer,
) -> None:
    async def go() -> None:
        h = Harness(redis)
        a, b = request(1.0), request(2.0)
        await h.ask(a)
        assert h.cache.redis is not None
        await h.cache.redis.flush()
        stored = redis.reply(b"GET", h.redis_key(a)) or b""
        value = stored.split(b"\r\n", 1)[1][:-2]
        # The signed answer for `a` placed under `b`'s key: never served for `b`.
        assert redis.command(b"SET", h.redis_key(b), value) == b"+OK"
        outputs, tier = await h.ask(b)
        assert tier == "" and h.runs == 2
        assert_correct(outputs, b)
        # One flipped byte inside the payload, tag kept.
        flipped = bytearray(value)
        flipped[-TAG_BYTES - 20] ^= 0x01
        await h.cache.redis.flush()
        assert redis.command(b"SET", h.redis_key(a), bytes(flipped)) == b"+OK"
        outputs, tier = await h.ask(a)
        assert tier == "" and h.runs == 3
        assert_correct(outputs, a)
        assert h.rejected("signature") == 2
        await h.cache.close()

    run(go())


def test_signed_values_that_do_not_match_the_model_outputs_are_misses(
    redis: RedisServer,
) -> None:
    """Someone holding the key (or a bug) writes a well-signed wrong answer: the output
    signature still keeps it out."""

    async def go() -> None:
        h = Harness(redis)
        req = request(3.0, rows=2)
        good = answer(req)
        y, n = good
        wrong = {
            "names": [Tensor("z", "FP32", y.shape, y.data), n],
            "order": [n, y],
            "missing output": [y],
            "datatype": [Tensor("y", "FP64", y.shape, y.data.astype(np.float64)), n],
            "rows": [Tensor("y", "FP32", (3, 4), np.zeros((3, 4), np.float32)), n],
            "row shape": [Tensor("y", "FP32", (2, 5), np.zeros((2, 5), np.float32)), n],
            "rank": [Tensor("y", "FP32", (2, 4, 1), np.zeros((2, 4, 1), np.float32)), n],
        }
        key = h.redis_key(req)
        for i, (what, tensors) in enumerate(wrong.items()):
            assert h.cache.redis is not None
            await h.cache.redis.flush()
            signed = sign(KEY.encode(), key, encode(tensors))
            assert redis.command(b"SET", key, signed) == b"+OK", what
            outputs, tier = await h.ask(req)
            assert tier == "", what
            assert h.runs == i + 1, what
            assert_correct(outputs, req)
        assert h.rejected("outputs") == len(wrong)
        assert h.rejected("signature") == 0
        # The right answer, signed, is used.
        await h.cache.redis.flush()
        assert redis.command(b"SET", key, sign(KEY.encode(), key, encode(good))) == b"+OK"
        outputs, tier = await h.ask(req)
        assert tier == "redis" and h.runs == len(wrong)
        await h.cache.close()

    run(go())


def test_replicas_share_entries_only_with_the_same_key(redis: RedisServer) -> None:
    async def go() -> None:
        writer = Harness(redis)
        req = request(4.0)
        await writer.ask(req)
        assert writer.cache.redis is not None
        await writer.cache.redis.flush()
        same = Harness(redis)
        _, tier = await same.ask(req)
        assert tier == "redis" and same.runs == 0
        other = Harness(redis, key="o" * 32)
        _, tier = await other.ask(req)
        assert tier == "" and other.runs == 1 and other.rejected("signature") == 1
        for h in (writer, same, other):
            await h.cache.close()

    run(go())


def test_without_a_key_only_the_writing_process_trusts_its_values(
    redis: RedisServer, tmp_path: Path
) -> None:
    """No key configured: a per-process random key. This process hits its own entry; a
    second process (same config, same Redis) gets a counted miss."""

    async def go() -> None:
        h = Harness(redis, key=None)
        req = request(5.0)
        await h.ask(req)
        assert h.cache.redis is not None
        await h.cache.redis.flush()
        again = Harness(redis, key=None)
        _, tier = await again.ask(req)
        assert tier == "redis"
        await h.cache.close()
        await again.cache.close()

    run(go())
    script = tmp_path / "other_process.py"
    script.write_text(
        "import asyncio, sys\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from tests.test_cache_auth import Harness, request\n"
        "from tests.cache_fixtures import RedisServer\n"
        "async def go():\n"
        "    r = RedisServer(int(sys.argv[1]))\n"
        "    h = Harness(r, key=None)\n"
        "    _, tier = await h.ask(request(5.0))\n"
        "    print(tier or 'miss', h.rejected('signature'))\n"
        "    await h.cache.close()\n"
        "asyncio.run(go())\n"
    )
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=f"{root / 'src'}:{root}")
    out = subprocess.run(
        [sys.executable, str(script), str(redis.port), str(root)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    assert out.stdout.split() == ["miss", "1.0"], out.stderr[-2000:]


def test_hmac_key_config_errors_name_the_field_and_never_show_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def load(redis: dict[str, Any]) -> CacheConfig:
        return CacheConfig.from_dict({"redis": {"url": "redis://127.0.0.1:1/0", **redis}}, "f.yaml")

    monkeypatch.setenv("RTSERVE_TEST_CACHE_KEY", "secret-from-env-0123456789")
    cfg = load({"hmac_key_env": "RTSERVE_TEST_CACHE_KEY"})
    assert cfg.redis is not None and cfg.redis.hmac_key == b"secret-from-env-0123456789"
    assert "secret-from-env" not in repr(cfg)
    cases = [
        ({"hmac_key_env": "RTSERVE_TEST_UNSET_KEY"}, "hmac_key_env: environment variable"),
        ({"hmac_key": "short-secret"}, "at least 16 bytes"),
        ({"hmac_key": 12345}, "hmac_key: expected a string"),
        ({"hmac_key_env": "not a name"}, "expected an environment variable name"),
        ({"hmac_key": KEY, "hmac_key_env": "X"}, "not both"),
    ]
    for section, needle in cases:
        with pytest.raises(ConfigError) as info:
            load(section)
        assert "f.yaml: response_cache.redis" in str(info.value) and needle in str(info.value)
        assert "short-secret" not in str(info.value) and KEY not in str(info.value)


@pytest.fixture(scope="module")
def signed_server(
    tmp_path_factory: pytest.TempPathFactory,
    redis_server: RedisServer,
) -> Iterator[RunningServer]:
    if redis_server.proc is None or redis_server.proc.poll() is not None:
        redis_server.start()
    root = tmp_path_factory.mktemp("auth-repo")
    build_scale(root / "l2only" / "1" / "model.onnx", 2.0)
    (root / "l2only" / "config.yaml").write_text(
        "max_batch_size: 8\n"
        "response_cache:\n"
        f"  redis: {{url: '{redis_server.url}', ttl_s: 60, namespace: auth,"
        " hmac_key_env: RTSERVE_TEST_SERVER_CACHE_KEY}\n"
    )
    os.environ["RTSERVE_TEST_SERVER_CACHE_KEY"] = "server-side-key-0123456789abcdef"
    try:
        s = start_server(root, tmp_path_factory.mktemp("auth-server"))
    finally:
        del os.environ["RTSERVE_TEST_SERVER_CACHE_KEY"]
    yield s
    s.stop()


def test_poisoned_values_under_a_running_servers_keys_are_never_served(
    signed_server: RunningServer,
    redis_server: RedisServer,
) -> None:
    url = f"{signed_server.base}/v2/models/l2only/infer"
    values = [[float(i), 1.0, 2.0, 3.0] for i in range(5)]

    def post(v: list[float]) -> httpx.Response:
        body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": v}]}
        r = httpx.post(url, json=body, timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["outputs"][0]["data"] == [2 * e for e in v]
        return r

    for v in values:
        assert post(v).headers.get("x-rtserve-cache") == "miss"
    client = redis_py.Redis.from_url(redis_server.url)
    deadline = time.monotonic() + 5
    keys: list[bytes] = []
    while len(keys) < len(values) and time.monotonic() < deadline:
        keys = client.keys("rtserve:auth:l2only:*")
        time.sleep(0.05)
    assert len(keys) == len(values)
    for v in values:  # the honest entries are used
        assert post(v).headers.get("x-rtserve-cache") == "redis"
    real = {k: client.get(k) for k in keys}
    forged = encode([Tensor("y", "FP32", (1, 4), np.full((1, 4), 666, np.float32))])
    other = next(iter(real.values()))
    for i, k in enumerate(keys):
        v = real[k]
        assert v is not None
        poison = [
            forged,  # unsigned, well-formed, arbitrary numbers
            forged + v[-TAG_BYTES:],  # a stolen tag
            other if k != keys[0] else forged,  # another key's signed value
            v[: -TAG_BYTES - 1] + bytes([v[-TAG_BYTES - 1] ^ 1]) + v[-TAG_BYTES:],  # tampered
            v[:-TAG_BYTES],  # tag stripped
        ][i % 5]
        client.set(k, poison)
    for v in values:
        assert post(v).headers.get("x-rtserve-cache") == "miss"
    metrics = httpx.get(f"{signed_server.base}/metrics", timeout=10).text
    line = next(
        ln
        for ln in metrics.splitlines()
        if ln.startswith("rtserve_cache_rejected_values_total")
        and 'model="l2only"' in ln
        and 'reason="signature"' in ln
    )
    assert float(line.rsplit(" ", 1)[1]) == len(values)
    client.close()
