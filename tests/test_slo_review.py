"""Latency objectives from a user's side: bad ``slo`` configs, and the ``priority`` and
``timeout`` request parameters over HTTP and gRPC, against a real server.

A model whose objective is not a finite number (YAML ``.inf`` / ``.nan``) used to pass the
config check and then fail while loading, taking the server's start down with it; a gRPC
``timeout`` sent as an infinite double was a 500; any ``priority`` was accepted by a model
without priority levels, and ``priority_levels`` without ``slo`` was accepted and ignored.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import yaml

from rtserve.config import parse_model_config
from rtserve.errors import ConfigError
from rtserve.protocol import grpc_service_pb2 as pb
from rtserve.protocol import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import RELAXED, RunningServer, start_server

MODEL_PY = """
import numpy as np

class Model:
    def load(self, context):
        pass

    def infer(self, inputs):
        return {"y": (inputs["x"] * 2).astype(np.float32)}
"""

PICKY = """    def infer(self, inputs):
        if len(inputs["x"]) > 2:
            raise ValueError("at most 2 rows")
"""

SIGNATURE = (
    "max_batch_size: 8\n"
    "inputs: [{name: x, datatype: FP32, shape: [1]}]\n"
    "outputs: [{name: y, datatype: FP32, shape: [1]}]\n"
)


def _python_model(root: Path, name: str, extra: str) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").write_text(MODEL_PY)
    (root / name / "config.yaml").write_text(f"backend: python\n{SIGNATURE}{extra}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("slo_review_repo")
    _python_model(root, "double", "slo: {p99_ms: 500}\n")
    _python_model(root, "fixed", "")
    _python_model(root, "ranked", "slo: {p99_ms: 500}\npriority_levels: 2\n")
    (root / "chain" / "1").mkdir(parents=True)
    (root / "chain" / "config.yaml").write_text(
        f"backend: ensemble\n{SIGNATURE.replace('x,', 'X,').replace('y,', 'Y,')}"
        "steps:\n  - {model: double, inputs: {x: X}, outputs: {y: Y}}\n"
    )
    _python_model(root, "precise", "slo: {p99_ms: 1234567.5, p50_ms: 0.125}\n")
    # Broken configs: the server must start anyway and say what is wrong with each.
    _python_model(root, "infinite", "slo: {p99_ms: .inf}\n")
    _python_model(root, "levels_alone", "priority_levels: 3\n")
    # Serves 2 rows, fails on more: warmup (1 row) passes, timing a full batch does not.
    _python_model(root, "picky", "slo: {p99_ms: 500}\n")
    picky = root / "picky" / "1" / "model.py"
    picky.write_text(MODEL_PY.replace("    def infer(self, inputs):\n", PICKY))
    # One row takes 30 ms, more than a 10 ms objective leaves: served, with a warning.
    _python_model(root, "too_slow", "slo: {p99_ms: 10}\n")
    slow = root / "too_slow" / "1" / "model.py"
    slow.write_text(
        MODEL_PY.replace("        return {", "        time.sleep(0.03)\n        return {")
    )
    slow.write_text("import time\n" + slow.read_text())
    running = start_server(root, tmp_path_factory.mktemp("slo_review_logs"), *RELAXED)
    try:
        yield running
    finally:
        running.stop()


def _http(server: RunningServer, model: str, **params: object) -> httpx.Response:
    name = "X" if model == "chain" else "x"
    body = {"inputs": [{"name": name, "datatype": "FP32", "shape": [1, 1], "data": [1.5]}]}
    if params:
        body["parameters"] = params
    return httpx.post(f"http://{server.http}/v2/models/{model}/infer", content=json.dumps(body))


def _grpc(
    server: RunningServer, model: str, key: str = "", kind: str = "", value: object = None
) -> pb.ModelInferResponse:
    request = pb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="X" if model == "chain" else "x", datatype="FP32")
    tensor.shape.extend([1, 1])
    tensor.contents.fp32_contents.append(1.5)
    if key:
        setattr(request.parameters[key], kind, value)
    with grpc.insecure_channel(server.grpc) as channel:
        return pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=10)


def _value(answer: pb.ModelInferResponse) -> float:
    if answer.raw_output_contents:
        return float(np.frombuffer(answer.raw_output_contents[0], dtype=np.float32)[0])
    return float(answer.outputs[0].contents.fp32_contents[0])


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("slo: {p99_ms: .inf}", "slo.p99_ms"),
        ("slo: {p99_ms: .nan}", "slo.p99_ms"),
        ("slo: {p99_ms: 50, p50_ms: .nan}", "slo.p50_ms"),
        ("slo: {p99_ms: 50}\npriority_levels: 2000000000", "priority_levels"),
        ("priority_levels: 3", "priority_levels"),
        ("priority_levels: 3\ndefault_priority: 1", "priority_levels"),
    ],
)
def test_bad_objectives_and_levels_are_config_errors_naming_the_field(
    text: str, field: str
) -> None:
    data = yaml.safe_load(f"max_batch_size: 8\n{text}\n")
    with pytest.raises(ConfigError, match=rf"m/config.yaml: {field}: expected"):
        parse_model_config(data, "m", "m/config.yaml")


def test_a_model_with_a_bad_objective_is_reported_and_the_others_serve(
    server: RunningServer,
) -> None:
    index = httpx.post(f"http://{server.http}/v2/repository/index", content="{}").json()
    state = {row["name"]: (row["state"], row["reason"]) for row in index}
    assert state["infinite"][0] == "UNAVAILABLE"
    assert "slo.p99_ms: expected a number >= 0.0, got inf" in state["infinite"][1]
    assert state["levels_alone"][0] == "UNAVAILABLE"
    reason = state["levels_alone"][1]
    assert "priority_levels: expected no priority_levels unless slo is set" in reason
    assert state["picky"][0] == "UNAVAILABLE"
    assert "slo: timing batches for the latency objective failed" in state["picky"][1]
    assert "at most 2 rows" in state["picky"][1]
    for model in ("double", "fixed", "ranked", "chain"):
        assert state[model][0] == "READY", state[model]
        r = _http(server, model)
        assert r.status_code == 200, r.text
        assert r.json()["outputs"][0]["data"] == [3.0]


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_a_non_finite_grpc_timeout_is_invalid_argument(server: RunningServer, value: float) -> None:
    for model in ("double", "fixed"):
        with pytest.raises(grpc.RpcError) as info:
            _grpc(server, model, "timeout", "double_param", value)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert "parameters.timeout: expected microseconds" in info.value.details()
    answer = _grpc(server, "double", "timeout", "double_param", 5e6)
    assert _value(answer) == 3.0


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


def test_the_objective_in_the_model_config_is_the_configured_value(server: RunningServer) -> None:
    expected = {"slo_p99_ms": "1234567.5", "slo_p50_ms": "0.125"}
    config = httpx.get(f"http://{server.http}/v2/models/precise/config").json()
    assert {k: v["string_value"] for k, v in config["parameters"].items()} == expected
    with grpc.insecure_channel(server.grpc) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        answer = stub.ModelConfig(pb.ModelConfigRequest(name="precise"), timeout=10)
    assert {k: v.string_value for k, v in answer.config.parameters.items()} == expected


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


def test_an_objective_shorter_than_one_rows_batch_is_warned_about_at_load(
    server: RunningServer,
) -> None:
    """A model whose one-row batch alone takes longer than the objective's budget is served
    (a request with nothing ahead is admitted), and the load says its requests will miss."""
    log = server.log_path.read_text()
    assert "model too_slow: a batch of one row took" in log, log[-3000:]
    assert "its requests will miss the objective" in log
    assert "model double: a batch of one row" not in log
    r = _http(server, "too_slow")
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [3.0]
