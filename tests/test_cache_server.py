"""The response cache end to end: a real server, a real redis-server, real clients."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc

from tests.cache_fixtures import RedisServer
from tests.conftest import RELAXED, RunningServer, start_server
from tests.models import build_scale
from tests.v2 import http_infer, infer_body


@pytest.fixture(scope="module")
def cached_server(
    tmp_path_factory: pytest.TempPathFactory,
    redis_server: RedisServer,
) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("cache-repo")
    build_scale(root / "both" / "1" / "model.onnx", 2.0)
    (root / "both" / "config.yaml").write_text(
        "max_batch_size: 8\n"
        "response_cache:\n"
        "  memory: {max_bytes: 1000000, ttl_s: 60}\n"
        f"  redis: {{url: '{redis_server.url}', ttl_s: 60, namespace: e2e}}\n"
    )
    build_scale(root / "inherits" / "1" / "model.onnx", 3.0)
    (root / "inherits" / "config.yaml").write_text("max_batch_size: 8\n")
    build_scale(root / "off" / "1" / "model.onnx", 4.0)
    (root / "off" / "config.yaml").write_text("max_batch_size: 8\nresponse_cache: false\n")
    server_yaml = root / "server.yaml"
    server_yaml.write_text("response_cache: {memory: {max_bytes: 1000000, ttl_s: 60}}\n")
    s = start_server(root, tmp_path_factory.mktemp("cache-server"), "--config", str(server_yaml))
    yield s
    s.stop()


def _post(
    server: RunningServer, model: str, values: list[float], **params: object
) -> httpx.Response:
    return http_infer(server, model, infer_body("x", values, [1, 4], **params), timeout=5)


def test_http_header_reports_miss_then_memory_hit(cached_server: RunningServer) -> None:
    first = _post(cached_server, "both", [1, 2, 3, 4])
    second = _post(cached_server, "both", [1, 2, 3, 4])
    assert first.headers["x-rtserve-cache"] == "miss"
    assert second.headers["x-rtserve-cache"] == "memory"
    assert first.json()["outputs"] == second.json()["outputs"]
    assert second.json()["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]
    assert "cache;desc=memory" in second.headers["server-timing"]
    other = _post(cached_server, "both", [1, 2, 3, 5])
    assert other.headers["x-rtserve-cache"] == "miss"
    assert other.json()["outputs"][0]["data"] == [2.0, 4.0, 6.0, 10.0]


def test_opt_out_parameter_bypasses_the_cache(cached_server: RunningServer) -> None:
    _post(cached_server, "both", [7, 7, 7, 7])
    r = _post(cached_server, "both", [7, 7, 7, 7], cache=False)
    assert r.headers["x-rtserve-cache"] == "bypass"
    assert r.json()["outputs"][0]["data"] == [14.0] * 4
    bad = _post(cached_server, "both", [7, 7, 7, 7], cache="sometimes")
    assert bad.status_code == 400 and "parameters.cache" in bad.json()["error"]


def test_server_default_applies_and_false_turns_it_off(cached_server: RunningServer) -> None:
    _post(cached_server, "inherits", [1, 1, 1, 1])
    assert _post(cached_server, "inherits", [1, 1, 1, 1]).headers["x-rtserve-cache"] == "memory"
    _post(cached_server, "off", [1, 1, 1, 1])
    r = _post(cached_server, "off", [1, 1, 1, 1])
    assert "x-rtserve-cache" not in r.headers and r.json()["outputs"][0]["data"] == [4.0] * 4


def test_answers_are_written_to_redis(
    cached_server: RunningServer, redis_server: RedisServer
) -> None:
    import time

    import redis

    _post(cached_server, "both", [9, 8, 7, 6])
    client = redis.Redis.from_url(redis_server.url)
    deadline = time.monotonic() + 5
    keys: list = []
    while not keys and time.monotonic() < deadline:  # written in the background
        keys = client.keys("*e2e*")
        time.sleep(0.05)
    client.close()
    assert keys, "no cache entry written to redis"


def test_grpc_trailing_metadata_reports_the_tier(cached_server: RunningServer) -> None:
    client = tgrpc.InferenceServerClient(cached_server.grpc)
    x = tgrpc.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.array([[3, 1, 4, 1]], np.float32))
    first = client.infer("both", [x], headers={})
    second = client.infer("both", [x])
    np.testing.assert_array_equal(first.as_numpy("y"), second.as_numpy("y"))
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    with grpc.insecure_channel(cached_server.grpc) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelInferRequest(model_name="both")
        request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
        request.raw_input_contents.append(np.array([3, 1, 4, 1], np.float32).tobytes())
        _, call = stub.ModelInfer.with_call(request)
    assert dict(call.trailing_metadata())["x-rtserve-cache"] == "memory"


def test_cache_metrics_are_exported(cached_server: RunningServer) -> None:
    _post(cached_server, "both", [5, 5, 5, 5])
    _post(cached_server, "both", [5, 5, 5, 5])
    metrics = httpx.get(f"{cached_server.base}/metrics").text
    assert "rtserve_cache_requests_total" in metrics
    assert 'tier="memory"' in metrics


def test_bad_cache_config_stops_only_that_model(tmp_path: Path) -> None:
    build_scale(tmp_path / "repo" / "good" / "1" / "model.onnx", 1.0)
    build_scale(tmp_path / "repo" / "bad" / "1" / "model.onnx", 1.0)
    (tmp_path / "repo" / "bad" / "config.yaml").write_text(
        "response_cache: {memory: {max_bytes: -5, ttl_s: 1}}\n"
    )
    s = start_server(tmp_path / "repo", tmp_path / "server", *RELAXED)
    try:
        r = httpx.post(
            f"{s.base}/v2/models/bad/infer",
            json={"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1] * 4}]},
        )
        assert r.status_code == 503
        assert (
            "bad/config.yaml" in r.json()["error"]
            and "response_cache.memory.max_bytes" in r.json()["error"]
        )
        ok = httpx.post(
            f"{s.base}/v2/models/good/infer",
            json={"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1] * 4}]},
        )
        assert ok.status_code == 200
    finally:
        s.stop()
