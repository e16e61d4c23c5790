"""An ensemble checks what only run time shows: a step model reloaded with other batching,
and tensors whose -1 dimensions came out other than the next step declares."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

from tests.conftest import start_server
from tests.models import build_scale, write_config, write_python_model

WIDE_PY = """
import numpy as np

class Model:
    def infer(self, inputs):
        x = inputs["X"]
        return {"W": np.concatenate([x, x[:, :3]], axis=1)}  # 7 columns, declared [-1]
"""

SUM_PY = """
import numpy as np

class Model:
    def infer(self, inputs):
        return {"S": inputs["W"].sum(axis=1, keepdims=True)}
"""


def _rows(n: int) -> list[thttp.InferInput]:
    x = thttp.InferInput("x", [n, 4], "FP32")
    x.set_data_from_numpy(np.ones((n, 4), np.float32))
    return [x]


def test_a_step_reloaded_with_smaller_batches_is_refused_not_wedged(tmp_path: Path) -> None:
    """The step's max_batch_size drops below the ensemble's: the ensemble answers 503 naming
    the step (a 4-row batch waited for ever, and every request to the step behind it)."""
    repo = tmp_path / "repo"
    build_scale(repo / "scale" / "1" / "model.onnx", 2.0)
    write_config(repo, "scale", {"max_batch_size": 4})
    write_config(repo, "chain", {
        "backend": "ensemble", "max_batch_size": 4,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [4]}],
        "steps": [{"model": "scale", "inputs": {"x": "x"}, "outputs": {"y": "y"}}],
    })  # fmt: skip
    s = start_server(repo, tmp_path / "s", "--model-control-mode", "explicit", "--load-model", "*")
    try:
        client = thttp.InferenceServerClient(s.http, network_timeout=20)
        assert client.infer("chain", _rows(4)).as_numpy("y").tolist() == [[2.0] * 4] * 4
        client.load_model("scale", config=json.dumps({"max_batch_size": 2}))
        started = time.monotonic()
        with pytest.raises(InferenceServerException) as info:
            client.infer("chain", _rows(4))
        assert info.value.status() == "503"
        message = info.value.message()
        assert "steps[0] (model 'scale') no longer fits the ensemble: max_batch_size: 4 " in message
        assert "exceeds the max_batch_size 2" in message and str(tmp_path) not in message
        assert client.infer("scale", _rows(2)).as_numpy("y").shape == (2, 4)
        assert time.monotonic() - started < 10
    finally:
        s.stop()


def test_a_tensor_of_another_width_than_its_consumer_declares_is_a_500(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    py = {"backend": "python", "max_batch_size": 4}
    write_python_model(repo, "wide", {
        **py, "inputs": [{"name": "X", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "W", "datatype": "FP32", "shape": [-1]}],
    }, WIDE_PY)  # fmt: skip
    write_python_model(repo, "sum4", {
        **py, "inputs": [{"name": "W", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "S", "datatype": "FP32", "shape": [1]}],
    }, SUM_PY)  # fmt: skip
    write_config(repo, "pipe", {
        "backend": "ensemble", "max_batch_size": 4,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "s", "datatype": "FP32", "shape": [1]}],
        "steps": [
            {"model": "wide", "inputs": {"X": "x"}, "outputs": {"W": "w"}},
            {"model": "sum4", "inputs": {"W": "w"}, "outputs": {"S": "s"}},
        ],
    })  # fmt: skip
    s = start_server(repo, tmp_path / "s")
    try:
        client = thttp.InferenceServerClient(s.http)
        with pytest.raises(InferenceServerException) as info:
            client.infer("pipe", _rows(1))
        assert info.value.status() == "500"
        assert "tensor 'w' has shape [1, 7], where [-1, 4] is declared" in info.value.message()
    finally:
        s.stop()


def test_a_cached_ensemble_answers_from_its_steps_live_versions(tmp_path: Path) -> None:
    """A step reloaded with a new version: the ensemble's cached answers of the old one are
    not served (they were, from memory and from Redis, until their TTL)."""
    repo = tmp_path / "repo"
    build_scale(repo / "scale" / "1" / "model.onnx", 2.0)
    write_config(repo, "scale", {"max_batch_size": 4, "version_policy": "latest"})
    write_config(repo, "chain", {
        "backend": "ensemble", "max_batch_size": 4,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [4]}],
        "steps": [{"model": "scale", "inputs": {"x": "x"}, "outputs": {"y": "y"}}],
        "response_cache": {"memory": {"max_bytes": 1_000_000, "ttl_s": 600}},
    })  # fmt: skip
    s = start_server(repo, tmp_path / "s", "--model-control-mode", "explicit", "--load-model", "*")
    try:
        client = thttp.InferenceServerClient(s.http)
        for _ in range(2):  # the second from the cache
            assert client.infer("chain", _rows(1)).as_numpy("y").tolist() == [[2.0] * 4]
        build_scale(repo / "scale" / "2" / "model.onnx", 100.0)
        client.load_model("scale")
        for _ in range(2):
            assert client.infer("chain", _rows(1)).as_numpy("y").tolist() == [[100.0] * 4]
        hits = [line for line in client.get_inference_statistics("chain")["model_stats"][0:1]]
        assert hits[0]["inference_stats"]["cache_hit"]["count"] == 2
    finally:
        s.stop()


def test_statistics_count_compute_per_request_and_batches_per_batch(tmp_path: Path) -> None:
    """As Triton's: success, queue and compute_* count requests (each reports its batch's
    compute time; perf_analyzer divides by the request count); batch_stats and
    execution_count count batches."""
    from concurrent.futures import ThreadPoolExecutor

    repo = tmp_path / "repo"
    build_scale(repo / "scale" / "1" / "model.onnx", 2.0)
    write_config(
        repo,
        "scale",
        {
            "max_batch_size": 8,
            "dynamic_batching": {"max_queue_delay_us": 100_000, "adaptive_delay": False},
        },
    )
    s = start_server(repo, tmp_path / "s")
    try:

        def one(_: int) -> None:
            thttp.InferenceServerClient(s.http).infer("scale", _rows(1))

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(one, range(8)))
        stats = thttp.InferenceServerClient(s.http).get_inference_statistics("scale")
        model = stats["model_stats"][0]
        inference = model["inference_stats"]
        assert inference["success"]["count"] == 8
        for key in ("queue", "compute_input", "compute_infer", "compute_output"):
            assert inference[key]["count"] == 8, key
        batches = sum(int(b["compute_infer"]["count"]) for b in model["batch_stats"])
        assert batches == int(model["execution_count"]) < 8
    finally:
        s.stop()


INPLACE_PY = """
import time

class Model:
    def infer(self, inputs):
        x = inputs["X"]
        x *= 10  # in place: its own copy, not its sibling's input
        return {"Y": x}
"""

LATER_COPY_PY = """
import time

class Model:
    def infer(self, inputs):
        time.sleep(0.05)  # reads its input after the sibling wrote to its own
        return {"Y": inputs["X"].copy()}
"""


def test_a_step_writing_its_input_in_place_does_not_change_its_siblings(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    signature = {
        "backend": "python", "max_batch_size": 4,
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "Y", "datatype": "FP32", "shape": [4]}],
    }  # fmt: skip
    write_python_model(repo, "inplace", signature, INPLACE_PY)
    write_python_model(repo, "later", signature, LATER_COPY_PY)
    write_config(repo, "fan", {
        "backend": "ensemble", "max_batch_size": 4,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "a", "datatype": "FP32", "shape": [4]},
                    {"name": "b", "datatype": "FP32", "shape": [4]},
                    {"name": "x_out", "datatype": "FP32", "shape": [4]}],
        "steps": [
            {"model": "inplace", "inputs": {"X": "x"}, "outputs": {"Y": "a"}},
            {"model": "later", "inputs": {"X": "x"}, "outputs": {"Y": "b"}},
            {"model": "later", "inputs": {"X": "a"}, "outputs": {"Y": "x_out"}},
        ],
    })  # fmt: skip
    s = start_server(repo, tmp_path / "s")
    try:
        x = thttp.InferInput("x", [1, 4], "FP32")
        x.set_data_from_numpy(np.array([[1, 2, 3, 4]], np.float32))
        result = thttp.InferenceServerClient(s.http).infer("fan", [x])
        assert result.as_numpy("a").tolist() == [[10.0, 20.0, 30.0, 40.0]]
        assert result.as_numpy("b").tolist() == [[1.0, 2.0, 3.0, 4.0]]
    finally:
        s.stop()
