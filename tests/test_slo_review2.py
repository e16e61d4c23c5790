"""Latency objectives from a user's side, second review: edge values of the ``timeout``
request parameter, the binary tensor extension, a model without batching, and model
control while requests are in flight, on models with an ``slo`` section, against a real
server.

A ``timeout`` that is finite but huge (``1e308`` microseconds) passed the parameter check
and then overflowed while the latency objective's batcher turned it into a deadline: a 500
over HTTP and INTERNAL over gRPC, where a model without ``slo`` served it.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.http as triton_http

from rtserve.protocol import grpc_service_pb2 as pb
from rtserve.protocol import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import RunningServer, start_server

MODEL_PY = """
import time

import numpy as np

class Model:
    def load(self, context):
        pass

    def infer(self, inputs):
        time.sleep(SLEEP)
        return {"y": (inputs["x"] * 2).astype(np.float32)}
"""


def _python_model(root: Path, name: str, config: str, sleep: float = 0.0) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").write_text(MODEL_PY.replace("SLEEP", repr(sleep)))
    (root / name / "config.yaml").write_text(f"backend: python\n{config}")


ROWS = "inputs: [{name: x, datatype: FP32, shape: [1]}]\noutputs: [{name: y, datatype: FP32, shape: [1]}]\n"
WHOLE = "inputs: [{name: x, datatype: FP32, shape: [-1, 1]}]\noutputs: [{name: y, datatype: FP32, shape: [-1, 1]}]\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("slo_review2_repo")
    _python_model(root, "double", f"max_batch_size: 8\n{ROWS}slo: {{p99_ms: 500}}\n")
    _python_model(root, "fixed", f"max_batch_size: 8\n{ROWS}")
    _python_model(root, "unbatched", f"max_batch_size: 0\n{WHOLE}slo: {{p99_ms: 500}}\n")
    _python_model(root, "sleepy", f"max_batch_size: 4\n{ROWS}slo: {{p99_ms: 3000}}\n", 0.05)
    running = start_server(
        root,
        tmp_path_factory.mktemp("slo_review2_logs"),
        "--model-control-mode",
        "explicit",
        "--load-model",
        "*",
    )
    try:
        yield running
    finally:
        running.stop()


def _body(rows: int = 1, **params: object) -> dict[str, object]:
    body: dict[str, object] = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [rows, 1], "data": [1.5] * rows}]
    }
    if params:
        body["parameters"] = params
    return body


def _http(server: RunningServer, model: str, rows: int = 1, **params: object) -> httpx.Response:
    url = f"http://{server.http}/v2/models/{model}/infer"
    return httpx.post(url, content=json.dumps(_body(rows, **params)), timeout=10)


def _grpc(server: RunningServer, model: str, kind: str, value: object) -> pb.ModelInferResponse:
    request = pb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="x", datatype="FP32")
    tensor.shape.extend([1, 1])
    request.raw_input_contents.append(np.float32(1.5).tobytes())
    setattr(request.parameters["timeout"], kind, value)
    with grpc.insecure_channel(server.grpc) as channel:
        return pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=10)


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
        _grpc(server, model, "double_param", 1e308)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert "parameters.timeout: expected microseconds" in info.value.details()
    answer = _grpc(server, model, "uint64_param", 2**64 - 1)
    assert np.frombuffer(answer.raw_output_contents[0], np.float32).tolist() == [3.0]


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
