"""A model's ``slo`` section from a user's side: bad values are config errors naming the
field, a model with one is reported while the others serve, the objective shows in the
model's configuration, and an objective shorter than a one-row batch is warned about.

A model whose objective is not a finite number (YAML ``.inf`` / ``.nan``) used to pass the
config check and then fail while loading, taking the server's start down with it;
``priority_levels`` without ``slo`` was accepted and ignored.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import httpx
import pytest
import yaml

from rtserve.config import parse_model_config
from rtserve.errors import ConfigError
from rtserve.protocol import grpc_service_pb2 as pb
from rtserve.protocol import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import RELAXED, RunningServer, start_server
from tests.models import XY_ROWS, double_py, write_double_chain, write_python_model
from tests.v2 import http_infer, infer_body

PICKY = """    def infer(self, inputs):
        if len(inputs["x"]) > 2:
            raise ValueError("at most 2 rows")
"""

SIGNATURE = f"max_batch_size: 8\n{XY_ROWS}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("slo_config_repo")
    models = {
        "double": "slo: {p99_ms: 500}\n",
        "fixed": "",
        "ranked": "slo: {p99_ms: 500}\npriority_levels: 2\n",
        "precise": "slo: {p99_ms: 1234567.5, p50_ms: 0.125}\n",
        # Broken configs: the server must start anyway and say what is wrong with each.
        "infinite": "slo: {p99_ms: .inf}\n",
        "levels_alone": "priority_levels: 3\n",
    }
    for name, extra in models.items():
        write_python_model(root, name, f"backend: python\n{SIGNATURE}{extra}", double_py())
    write_double_chain(root)
    # Serves 2 rows, fails on more: warmup (1 row) passes, timing a full batch does not.
    picky = double_py().replace("    def infer(self, inputs):\n", PICKY)
    write_python_model(root, "picky", f"backend: python\n{SIGNATURE}slo: {{p99_ms: 500}}\n", picky)
    # One row takes 30 ms, more than a 10 ms objective leaves: served, with a warning.
    config = f"backend: python\n{SIGNATURE}slo: {{p99_ms: 10}}\n"
    write_python_model(root, "too_slow", config, double_py(0.03))
    running = start_server(root, tmp_path_factory.mktemp("slo_config_logs"), *RELAXED)
    try:
        yield running
    finally:
        running.stop()


def _infer(server: RunningServer, model: str) -> httpx.Response:
    name = "X" if model == "chain" else "x"
    return http_infer(server, model, infer_body(name, [1.5], [1, 1]))


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
        r = _infer(server, model)
        assert r.status_code == 200, r.text
        assert r.json()["outputs"][0]["data"] == [3.0]


def test_the_objective_in_the_model_config_is_the_configured_value(server: RunningServer) -> None:
    expected = {"slo_p99_ms": "1234567.5", "slo_p50_ms": "0.125"}
    config = httpx.get(f"http://{server.http}/v2/models/precise/config").json()
    assert {k: v["string_value"] for k, v in config["parameters"].items()} == expected
    with grpc.insecure_channel(server.grpc) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        answer = stub.ModelConfig(pb.ModelConfigRequest(name="precise"), timeout=10)
    assert {k: v.string_value for k, v in answer.config.parameters.items()} == expected


def test_an_objective_shorter_than_one_rows_batch_is_warned_about_at_load(
    server: RunningServer,
) -> None:
    """A model whose one-row batch alone takes longer than the objective's budget is served
    (a request with nothing ahead is admitted), and the load says its requests will miss."""
    log = server.log_path.read_text()
    assert "model too_slow: a batch of one row took" in log, log[-3000:]
    assert "its requests will miss the objective" in log
    assert "model double: a batch of one row" not in log
    r = _infer(server, "too_slow")
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [3.0]
