"""Requests to models with a latency objective, from a user's side, over HTTP and gRPC: the
``priority`` and ``timeout`` parameters (bad types, non-finite, huge, shorter than a batch),
binary tensors, a model without batching, and unloading while requests are in flight.

A gRPC ``timeout`` sent as an infinite double was a 500; a finite but huge one (``1e308``
microseconds) passed the parameter check and then overflowed while the objective's batcher
turned it into a deadline (500 / INTERNAL, where a model without ``slo`` served it); any
``priority`` was accepted by a model without priority levels.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.http as triton_http

from rtserve.protocol import grpc_service_pb2 as pb
from rtserve.protocol import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import RunningServer, start_server
from tests.models import XY_ROWS, double_py, write_double_chain, write_python_model
from tests.v2 import http_infer, infer_body

WHOLE = "inputs: [{name: x, datatype: FP32, shape: [-1, 1]}]\noutputs: [{name: y, datatype: FP32, shape: [-1, 1]}]\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("slo_requests_repo")
    models = {
        "double": (f"max_batch_size: 8\n{XY_ROWS}slo: {{p99_ms: 500}}\n", 0.0),
        "fixed": (f"max_batch_size: 8\n{XY_ROWS}", 0.0),
        "ranked": (f"max_batch_size: 8\n{XY_ROWS}slo: {{p99_ms: 500}}\npriority_levels: 2\n", 0.0),
        "unbatched": (f"max_batch_size: 0\n{WHOLE}slo: {{p99_ms: 500}}\n", 0.0),
        "sleepy": (f"max_batch_size: 4\n{XY_ROWS}slo: {{p99_ms: 3000}}\n", 0.05),
    }
    for name, (config, sleep) in models.items():
        write_python_model(root, name, f"backend: python\n{config}", double_py(sleep))
    write_double_chain(root)
    running = start_server(
        root,
        tmp_path_factory.mktemp("slo_requests_logs"),
        "--model-control-mode",
        "explicit",
        "--load-model",
        "*",
    )
    try:
        yield running
    finally:
        running.stop()


def _body(model: str = "", rows: int = 1, **params: object) -> dict[str, object]:
    name = "X" if model == "chain" else "x"
    return infer_body(name, [1.5] * rows, [rows, 1], **params)


def _http(server: RunningServer, model: str, rows: int = 1, **params: object) -> httpx.Response:
    return http_infer(server, model, _body(model, rows, **params))


def _grpc(
    server: RunningServer,
    model: str,
    key: str = "",
    kind: str = "",
    value: object = None,
    raw: bool = False,
) -> pb.ModelInferResponse:
    """One row (1.5) to ``model``, ``parameters[key]`` set as ``kind`` to ``value``;
    ``raw``: the tensor in ``raw_input_contents`` rather than typed contents."""
    request = pb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="X" if model == "chain" else "x", datatype="FP32")
    tensor.shape.extend([1, 1])
    if raw:
        request.raw_input_contents.append(np.float32(1.5).tobytes())
    else:
        tensor.contents.fp32_contents.append(1.5)
    if key:
        setattr(request.parameters[key], kind, value)
    with grpc.insecure_channel(server.grpc) as channel:
        return pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=10)


def _value(answer: pb.ModelInferResponse) -> float:
    if answer.raw_output_contents:
        return float(np.frombuffer(answer.raw_output_contents[0], dtype=np.float32)[0])
    return float(answer.outputs[0].contents.fp32_contents[0])


# ---------------------------------------------------------------------------- timeout
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_a_non_finite_grpc_timeout_is_invalid_argument(server: RunningServer, value: float) -> None:
    for model in ("double", "fixed"):
        with pytest.raises(grpc.RpcError) as info:
            _grpc(server, model, "timeout", "double_param", value)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert "parameters.timeout: expected microseconds" in info.value.details()
    answer = _grpc(server, "double", "timeout", "double_param", 5e6)
    assert _value(answer) == 3.0


@pytest.mark.parametrize("model", ["double", "fixed", "unbatched"])
@pytest.mark.parametrize("value", [1e308, 1e30, 2.0**64])
def test_a_huge_http_timeout_is_a_400_naming_the_parameter(
    server: RunningServer, model: str, value: float
) -> None:
    r = _http(server, model, timeout=value)
    assert r.status_code == 400, r.text
    assert "parameters.timeout: expected microseconds" in r.json()["error"]
    r = _http(server, model, timeout=1e18)  # ~31,700 years: no deadline in practice
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [3.0]


@pytest.mark.parametrize("model", ["double", "fixed"])
def test_a_huge_grpc_timeout_is_invalid_argument_and_uint64_max_is_served(
    server: RunningServer, model: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _grpc(server, model, "timeout", "double_param", 1e308, raw=True)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert "parameters.timeout: expected microseconds" in info.value.details()
    answer = _grpc(server, model, "timeout", "uint64_param", 2**64 - 1, raw=True)
    assert np.frombuffer(answer.raw_output_contents[0], np.float32).tolist() == [3.0]


def test_a_timeout_shorter_than_the_batch_alone_is_deadline_exceeded_not_retry_later(
    server: RunningServer,
) -> None:
    """A ``timeout`` (µs) that even the request's own batch cannot meet on an idle model:
    HTTP 504 / gRPC DEADLINE_EXCEEDED saying so, without a ``Retry-After`` (a retry would
    fare no better); the model keeps serving."""
    r = _http(server, "double", timeout=1)
    assert r.status_code == 504, r.text
    assert "timeout (0.001 ms) is shorter than its batch alone" in r.json()["error"]
    assert "retry-after" not in r.headers
    with pytest.raises(grpc.RpcError) as info:
        _grpc(server, "double", "timeout", "int64_param", 1)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "shorter than its batch alone" in (info.value.details() or "")
    assert _http(server, "double", timeout=5_000_000).json()["outputs"][0]["data"] == [3.0]


# ---------------------------------------------------------------------------- priority
@pytest.mark.parametrize("value", ["1", 1.0, -1, True, {"level": 1}])
def test_a_bad_priority_is_a_400_on_every_kind_of_model(
    server: RunningServer, value: object
) -> None:
    for model in ("double", "fixed", "ranked", "chain"):
        r = _http(server, model, priority=value)
        assert r.status_code == 400, (model, r.text)
        assert "parameters.priority: expected an integer" in r.json()["error"]
    for model in ("double", "fixed", "chain"):
        r = _http(server, model, priority=7)  # a model without levels ignores a valid one
        assert r.status_code == 200, (model, r.text)
    assert _http(server, "ranked", priority=2).status_code == 200


@pytest.mark.parametrize(
    ("kind", "value"),
    [("string_param", "1"), ("double_param", 1.0), ("int64_param", -1), ("bool_param", True)],
)
def test_a_bad_grpc_priority_is_invalid_argument(
    server: RunningServer, kind: str, value: object
) -> None:
    for model in ("double", "fixed", "chain"):
        with pytest.raises(grpc.RpcError) as info:
            _grpc(server, model, "priority", kind, value)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert "parameters.priority" in info.value.details()
    answer = _grpc(server, "double", "priority", "uint64_param", 3)
    assert _value(answer) == 3.0


# ---------------------------------------------------------------------------- other requests
def test_binary_tensors_and_a_bad_inference_header_length_on_an_slo_model(
    server: RunningServer,
) -> None:
    client = triton_http.InferenceServerClient(server.http)
    x = np.array([[1.5], [2.5]], np.float32)
    tensor = triton_http.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    wanted = [triton_http.InferRequestedOutput("y", binary_data=True)]
    answer = client.infer("double", [tensor], outputs=wanted, timeout=5_000_000)
    assert answer.as_numpy("y").tolist() == [[3.0], [5.0]]

    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": [1, 1],
                    "parameters": {"binary_data_size": 4},
                }
            ]
        }  # fmt: skip
    ).encode()
    body = header + np.float32(1.5).tobytes()
    for length in (b"-1", str(len(body) + 1).encode(), b"abc", b"99999999999999999999"):
        head = (
            b"POST /v2/models/double/infer HTTP/1.1\r\nHost: t\r\n"
            b"Content-Type: application/octet-stream\r\n"
            b"Content-Length: %d\r\nInference-Header-Content-Length: %s\r\n\r\n"
        ) % (len(body), length)
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=5) as sock:
            sock.sendall(head + body)
            reply = sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 400 "), reply[:200]
        assert b"Inference-Header-Content-Length" in reply, reply[:300]
    assert _http(server, "double").status_code == 200


def test_an_unbatched_model_with_an_objective_serves_whole_tensors(server: RunningServer) -> None:
    for rows in (1, 3):
        r = _http(server, "unbatched", rows=rows)
        assert r.status_code == 200, r.text
        assert r.json()["outputs"][0]["shape"] == [rows, 1]
        assert r.json()["outputs"][0]["data"] == [3.0] * rows
    r = _http(server, "unbatched", priority="high")
    assert r.status_code == 400, r.text
    assert "parameters.priority" in r.json()["error"]


def test_unloading_an_slo_model_answers_the_requests_in_flight(server: RunningServer) -> None:
    base = f"http://{server.http}"

    async def run() -> tuple[list[int], int, list[int]]:
        async with httpx.AsyncClient(timeout=30) as client:
            url = f"{base}/v2/models/sleepy/infer"
            inflight = [asyncio.create_task(client.post(url, json=_body())) for _ in range(10)]
            await asyncio.sleep(0.1)
            unloaded = await client.post(f"{base}/v2/repository/models/sleepy/unload")
            after = await client.post(url, json=_body())
            answers = await asyncio.gather(*inflight)
            return [a.status_code for a in answers], unloaded.status_code, [after.status_code]

    try:
        inflight, unloaded, after = asyncio.run(run())
        assert unloaded == 200
        assert inflight == [200] * 10
        assert after == [404]
    finally:
        loaded = httpx.post(f"{base}/v2/repository/models/sleepy/load", timeout=60)
        assert loaded.status_code == 200, loaded.text
    assert _http(server, "sleepy").json()["outputs"][0]["data"] == [3.0]
