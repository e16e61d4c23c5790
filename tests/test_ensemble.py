"""Ensembles: config errors name the step and field; served end to end with Triton's clients,
results equal the steps run by hand, steps batch across ensemble calls, failures name the step."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from rtserve.core.model import BuildContext
from rtserve.core.registry import ModelRegistry
from rtserve.errors import ModelNotReady
from rtserve.observability.metrics import Metrics
from rtserve.repository import read_model, scan
from tests.conftest import RunningServer, start_server
from tests.models import build_scale, write_config


def _save(graph: onnx.GraphProto, path: Path) -> None:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def build_add(path: Path) -> None:
    """s = a + b, FP32 [batch, 4]."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["s"])],
        "add",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 4]) for n in ("a", "b")],
        [helper.make_tensor_value_info("s", TensorProto.FLOAT, ["batch", 4])],
    )
    _save(graph, path)


def build_int_scale(path: Path) -> None:
    """y = x * 2 with x INT64 [batch, 4]: a step whose input datatype differs."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["y"])],
        "int_scale",
        [helper.make_tensor_value_info("x", TensorProto.INT64, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, ["batch", 4])],
        [helper.make_tensor("k", TensorProto.INT64, [], [2])],
    )
    _save(graph, path)


# A Python step: BYTES text -> 4 features; b"boom" raises.
FEATURES_PY = """
import time
import numpy as np

class Model:
    def infer(self, inputs):
        texts = inputs["text"][:, 0]
        if any(t == b"slow" for t in texts):
            time.sleep(0.5)
        if any(t == b"boom" for t in texts):
            raise ValueError("cannot featurize 'boom'")
        feats = np.array([[len(t), t.count(b" "), sum(t) % 97, 1.0] for t in texts],
                         dtype=np.float32)
        return {"features": feats}
"""

FEATURES_CONFIG = {
    "backend": "python",
    "max_batch_size": 16,
    "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1]}],
    "outputs": [{"name": "features", "datatype": "FP32", "shape": [4]}],
    "dynamic_batching": {"max_queue_delay_us": 2000},
}

X4 = {"name": "X", "datatype": "FP32", "shape": [4]}

# A Python step that takes 0.3 s: two of them in one level show whether levels run
# their steps concurrently.
SLEEPY_PY = """
import time

class Model:
    def infer(self, inputs):
        time.sleep(0.3)
        return {"y": inputs["x"] + 1}
"""
SLEEPY_CONFIG = {
    "backend": "python",
    "max_batch_size": 4,
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [4]}],
    "warmup": {"batch_sizes": [1], "iterations": 0},
}


def _ensemble(inputs: list[dict], outputs: list[dict], steps: list[dict], **extra: Any) -> dict:
    return {"backend": "ensemble", "inputs": inputs, "outputs": outputs, "steps": steps, **extra}


CHAIN = _ensemble(
    [X4],
    [{"name": "Y", "datatype": "FP32", "shape": [4]}],
    [
        {"model": "double", "inputs": {"x": "X"}, "outputs": {"y": "X2"}},
        {"model": "triple", "inputs": {"x": "X2"}, "outputs": {"y": "Y"}},
    ],
    max_batch_size=8,
)
# Two independent steps, then one that joins them; steps listed out of order on purpose.
DIAMOND = _ensemble(
    [X4],
    [
        {"name": "SUM", "datatype": "FP32", "shape": [4]},
        {"name": "A", "datatype": "FP32", "shape": [4]},
    ],
    [
        {"model": "add", "inputs": {"a": "A", "b": "B"}, "outputs": {"s": "SUM"}},
        {"model": "double", "inputs": {"x": "X"}, "outputs": {"y": "A"}},
        {"model": "triple", "version": 1, "inputs": {"x": "X"}, "outputs": {"y": "B"}},
    ],
)
TEXT = _ensemble(
    [{"name": "TEXT", "datatype": "BYTES", "shape": [1]}],
    [{"name": "SCORE", "datatype": "FP32", "shape": [4]}],
    [
        {"model": "features", "inputs": {"text": "TEXT"}, "outputs": {"features": "F"}},
        {"model": "double", "inputs": {"x": "F"}, "outputs": {"y": "SCORE"}},
    ],
)


def build_ensemble_repository(root: Path) -> Path:
    # A fixed gathering window: the adaptive delay would skip it for models this fast.
    batching = (
        "max_batch_size: 16\ndynamic_batching: {max_queue_delay_us: 3000, adaptive_delay: false}\n"
    )
    build_scale(root / "double" / "1" / "model.onnx", 2.0)
    (root / "double" / "config.yaml").write_text(batching)
    build_scale(root / "triple" / "1" / "model.onnx", 3.0)
    (root / "triple" / "config.yaml").write_text(batching)
    build_add(root / "add" / "1" / "model.onnx")
    (root / "add" / "config.yaml").write_text(batching)
    build_int_scale(root / "int_scale" / "1" / "model.onnx")
    (root / "int_scale" / "config.yaml").write_text(batching)
    write_config(root, "features", FEATURES_CONFIG)
    (root / "features" / "1" / "model.py").write_text(FEATURES_PY)
    write_config(root, "chain", CHAIN)
    write_config(root, "diamond", DIAMOND)
    write_config(root, "text", TEXT)
    for name in ("sleepy_a", "sleepy_b"):
        write_config(root, name, SLEEPY_CONFIG)
        (root / name / "1" / "model.py").write_text(SLEEPY_PY)
    write_config(
        root,
        "parallel",
        _ensemble(
            [X4],
            [
                {"name": "A", "datatype": "FP32", "shape": [4]},
                {"name": "B", "datatype": "FP32", "shape": [4]},
            ],
            [
                {"model": "sleepy_a", "inputs": {"x": "X"}, "outputs": {"y": "A"}},
                {"model": "sleepy_b", "inputs": {"x": "X"}, "outputs": {"y": "B"}},
            ],
        ),
    )
    # A step model with a latency objective and two priority levels, behind a fixed-window
    # step (which ignores priority): the ensemble's priority must reach it.
    build_scale(root / "ranked_double" / "1" / "model.onnx", 2.0)
    (root / "ranked_double" / "config.yaml").write_text(
        "max_batch_size: 16\nslo: {p99_ms: 1000}\npriority_levels: 2\n"
    )
    write_config(
        root,
        "ranked_chain",
        _ensemble(
            [X4],
            [{"name": "Y", "datatype": "FP32", "shape": [4]}],
            [
                {"model": "double", "inputs": {"x": "X"}, "outputs": {"y": "X2"}},
                {"model": "ranked_double", "inputs": {"x": "X2"}, "outputs": {"y": "Y"}},
            ],
        ),
    )
    write_config(
        root,
        "cached_chain",
        {**CHAIN, "response_cache": {"memory": {"max_bytes": 1_000_000, "ttl_s": 60}}},
    )
    return root


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_ensemble_repository(tmp_path_factory.mktemp("ensemble-repo"))


# ---------------------------------------------------------------------- config errors
async def _load_error(repo: Path, tmp: Path, config: dict) -> str:
    """Load the repository's plain models, then one ensemble; its load error."""
    registry = ModelRegistry(BuildContext(metrics=Metrics(), more_expected=lambda: False))
    try:
        await registry.load_all(
            [s for s in scan(repo) if s.name in ("double", "triple", "add", "int_scale")]
        )
        write_config(tmp, "bad", config)
        entry = await registry.load(read_model(tmp / "bad"))
        return entry.error
    finally:
        await registry.stop()


def _step(model: str, inputs: dict, outputs: dict, **extra: Any) -> dict:
    return {"model": model, "inputs": inputs, "outputs": outputs, **extra}


Y4 = {"name": "Y", "datatype": "FP32", "shape": [4]}
CONFIG_ERRORS = {
    "cycle": (
        _ensemble(
            [X4],
            [Y4],
            [
                _step("add", {"a": "X", "b": "C"}, {"s": "A"}),
                _step("double", {"x": "A"}, {"y": "B"}),
                _step("triple", {"x": "B"}, {"y": "C"}),
                _step("double", {"x": "X"}, {"y": "Y"}),
            ],
        ),
        ["cycle", "steps[0].inputs.b", "'C'", "steps[2]"],
    ),
    "unproduced tensor": (
        _ensemble([X4], [Y4], [_step("double", {"x": "NOPE"}, {"y": "Y"})]),
        ["steps[0].inputs.x", "'NOPE'", "produced by no step"],
    ),
    "unproduced output": (
        _ensemble([X4], [Y4], [_step("double", {"x": "X"}, {"y": "Z"})]),
        ["outputs[0].name", "'Y'", "produced by no step"],
    ),
    "two producers": (
        _ensemble(
            [X4],
            [Y4],
            [_step("double", {"x": "X"}, {"y": "Y"}), _step("triple", {"x": "X"}, {"y": "Y"})],
        ),
        ["steps[1].outputs.y", "already produced by steps[0]"],
    ),
    "missing model": (
        _ensemble([X4], [Y4], [_step("nosuchmodel", {"x": "X"}, {"y": "Y"})]),
        ["steps[0].model", "nosuchmodel"],
    ),
    "missing version": (
        _ensemble([X4], [Y4], [_step("double", {"x": "X"}, {"y": "Y"}, version=7)]),
        ["steps[0].version", "'7'"],
    ),
    "unknown step input": (
        _ensemble([X4], [Y4], [_step("double", {"x": "X", "w": "X"}, {"y": "Y"})]),
        ["steps[0].inputs.w", "model 'double' has no input 'w'"],
    ),
    "unknown step output": (
        _ensemble([X4], [Y4], [_step("double", {"x": "X"}, {"out": "Y"})]),
        ["steps[0].outputs.out", "model 'double' has no output 'out'"],
    ),
    "unfed step input": (
        _ensemble([X4], [Y4], [_step("add", {"a": "X"}, {"s": "Y"})]),
        ["steps[0].inputs", "input 'b' is not mapped"],
    ),
    "mismatched datatypes": (
        _ensemble(
            [X4],
            [{"name": "Y", "datatype": "INT64", "shape": [4]}],
            [_step("int_scale", {"x": "X"}, {"y": "Y"})],
        ),
        ["steps[0].inputs.x", "'X' is FP32", "expects INT64"],
    ),
    "mismatched output datatype": (
        _ensemble(
            [X4],
            [{"name": "Y", "datatype": "FP16", "shape": [4]}],
            [_step("double", {"x": "X"}, {"y": "Y"})],
        ),
        ["outputs[0].datatype", "FP16", "is FP32"],
    ),
    "mismatched shapes": (
        _ensemble(
            [{"name": "X", "datatype": "FP32", "shape": [5]}],
            [Y4],
            [_step("double", {"x": "X"}, {"y": "Y"})],
        ),
        ["steps[0].inputs.x", "[5]", "expects [4]"],
    ),
    "unknown step field": (
        _ensemble([X4], [Y4], [_step("double", {"x": "X"}, {"y": "Y"}, model_name="x")]),
        ["steps[0].model_name", "unknown field"],
    ),
    "step inputs not a mapping": (
        _ensemble([X4], [Y4], [_step("double", ["X"], {"y": "Y"})]),
        ["steps[0].inputs", "mapping"],
    ),
    "batch larger than a step's": (
        _ensemble([X4], [Y4], [_step("double", {"x": "X"}, {"y": "Y"})], max_batch_size=64),
        ["max_batch_size", "64", "16", "steps[0] (model 'double')"],
    ),
    "no declared outputs": (
        {"backend": "ensemble", "inputs": [X4], "steps": [_step("double", {"x": "X"}, {"y": "Y"})]},
        ["outputs: required for backend ensemble"],
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_ERRORS))
def test_config_errors_name_the_step_and_field(repo: Path, tmp_path: Path, case: str) -> None:
    config, fragments = CONFIG_ERRORS[case]
    error = asyncio.run(_load_error(repo, tmp_path, config))
    assert error, f"{case}: the ensemble loaded"
    assert "bad/config.yaml" in error
    for fragment in fragments:
        assert fragment in error, f"{case}: {fragment!r} not in {error!r}"


def test_ensemble_is_ready_only_while_its_steps_are(repo: Path) -> None:
    async def scenario() -> None:
        registry = ModelRegistry(BuildContext(metrics=Metrics(), more_expected=lambda: False))
        sources = {s.name: s for s in scan(repo)}
        try:
            await registry.load_all([sources[n] for n in ("double", "triple", "chain")])
            assert registry.get("chain").ready
            await registry.unload("triple")
            assert not registry.get_loaded("chain").ready
            with pytest.raises(ModelNotReady):
                registry.get("chain")
            await registry.load(sources["triple"])  # a new live version, looked up per call
            chain = registry.get("chain")
            x = np.arange(8, dtype=np.float32).reshape(2, 4)
            from rtserve.protocol.types import Timings

            out = await chain.scheduler.submit({"X": x}, 2, Timings())
            np.testing.assert_allclose(out["Y"], x * 6)
        finally:
            await registry.stop()

    asyncio.run(scenario())


# ---------------------------------------------------------------------- served
@pytest.fixture(scope="module")
def served(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    s = start_server(repo, tmp_path_factory.mktemp("ensemble-server"))
    yield s
    s.stop()


def _session(repo: Path, model: str) -> ort.InferenceSession:
    return ort.InferenceSession(str(repo / model / "1" / "model.onnx"))


def _features_model(repo: Path) -> Any:
    spec = importlib.util.spec_from_file_location(
        "features_model", repo / "features" / "1" / "model.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Model()


def _http_infer(client: thttp.InferenceServerClient, model: str, inputs: dict[str, np.ndarray],
                binary: bool = True, **kw: Any) -> thttp.InferResult:  # fmt: skip
    tensors = []
    for name, arr in inputs.items():
        t = thttp.InferInput(name, list(arr.shape), "BYTES" if arr.dtype == object else "FP32")
        t.set_data_from_numpy(arr, binary_data=binary)
        tensors.append(t)
    return client.infer(model, tensors, **kw)


def _grpc_infer(client: tgrpc.InferenceServerClient, model: str, inputs: dict[str, np.ndarray],
                **kw: Any) -> tgrpc.InferResult:  # fmt: skip
    tensors = []
    for name, arr in inputs.items():
        t = tgrpc.InferInput(name, list(arr.shape), "BYTES" if arr.dtype == object else "FP32")
        t.set_data_from_numpy(arr)
        tensors.append(t)
    return client.infer(model, tensors, **kw)


@pytest.mark.parametrize("protocol", ["http-json", "http-binary", "grpc"])
def test_ensemble_results_equal_the_steps_run_by_hand(
    served: RunningServer, repo: Path, protocol: str
) -> None:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(3, 4)).astype(np.float32)
    texts = np.array([[b"hello world"], [b"an ensemble of two models"], [b"x"]], dtype=object)
    double, triple, add = (_session(repo, m) for m in ("double", "triple", "add"))
    a = double.run(None, {"x": x})[0]
    b = triple.run(None, {"x": x})[0]
    want = {
        "chain": {"Y": triple.run(None, {"x": a})[0]},
        "diamond": {"SUM": add.run(None, {"a": a, "b": b})[0], "A": a},
        "text": {
            "SCORE": double.run(
                None, {"x": _features_model(repo).infer({"text": texts})["features"]}
            )[0]
        },
    }
    for model, expected in want.items():
        inputs = {"TEXT": texts} if model == "text" else {"X": x}
        if protocol == "grpc":
            with tgrpc.InferenceServerClient(served.grpc) as gc:
                result: Any = _grpc_infer(gc, model, inputs)
                assert gc.get_model_metadata(model).platform == "ensemble"
        else:
            with thttp.InferenceServerClient(served.http) as hc:
                result = _http_infer(hc, model, inputs, binary=protocol == "http-binary")
                assert hc.get_model_metadata(model)["platform"] == "ensemble"
        for name, value in expected.items():
            np.testing.assert_allclose(result.as_numpy(name), value, rtol=1e-6, err_msg=model)


def test_200_concurrent_ensemble_requests_batch_inside(served: RunningServer) -> None:
    import queue

    rng = np.random.default_rng(5)
    xs = rng.normal(size=(200, 1, 4)).astype(np.float32)
    with thttp.InferenceServerClient(served.http) as hc:
        before = _batch_counts(hc, "triple")
    done: queue.Queue[tuple[int, Any, Any]] = queue.Queue()
    with tgrpc.InferenceServerClient(served.grpc) as gc:
        for i, x in enumerate(xs):
            t = tgrpc.InferInput("X", [1, 4], "FP32")
            t.set_data_from_numpy(x)
            gc.async_infer("chain", [t], partial(_put, done, i), request_id=str(i))
        results = [done.get(timeout=60) for _ in xs]
    for i, result, error in results:
        assert error is None, error
        np.testing.assert_allclose(result.as_numpy("Y"), xs[i] * 6, rtol=1e-6)
    with thttp.InferenceServerClient(served.http) as hc:
        after = _batch_counts(hc, "triple")
        stats = hc.get_inference_statistics("triple")["model_stats"][0]
    grew = {size: n - before.get(size, 0) for size, n in after.items() if n > before.get(size, 0)}
    assert sum(size * n for size, n in grew.items()) == 200, grew
    assert max(grew) > 1, f"the inner model ran only batches of 1: {grew}"
    assert int(stats["inference_count"]) >= 200  # step requests count as the model's own


def _put(done: Any, i: int, result: Any, error: Any) -> None:
    done.put((i, result, error))


def _batch_counts(client: thttp.InferenceServerClient, model: str) -> dict[int, int]:
    stats = client.get_inference_statistics(model)["model_stats"][0]
    return {
        int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats.get("batch_stats", [])
    }


def test_a_failing_step_is_named_and_the_server_keeps_serving(served: RunningServer) -> None:
    boom = np.array([[b"boom"]], dtype=object)
    with thttp.InferenceServerClient(served.http) as hc:
        with pytest.raises(InferenceServerException) as info:
            _http_infer(hc, "text", {"TEXT": boom})
        message = str(info.value)
        assert "ensemble 'text' steps[0] (model 'features')" in message
        assert "ValueError" in message and "Traceback" not in message
        assert info.value.status() == "500"
        ok = _http_infer(hc, "text", {"TEXT": np.array([[b"fine"]], dtype=object)})
        assert ok.as_numpy("SCORE").shape == (1, 4)
    with tgrpc.InferenceServerClient(served.grpc) as gc:
        with pytest.raises(InferenceServerException) as ginfo:
            _grpc_infer(gc, "text", {"TEXT": boom})
        assert "steps[0] (model 'features')" in str(ginfo.value)
        assert ginfo.value.status() == "StatusCode.INTERNAL"


def test_a_timeout_passes_through_the_steps(served: RunningServer) -> None:
    slow = np.array([[b"slow"]], dtype=object)
    with thttp.InferenceServerClient(served.http) as hc:
        with pytest.raises(InferenceServerException) as info:
            _http_infer(hc, "text", {"TEXT": slow}, timeout=100_000)  # microseconds
        assert info.value.status() == "504"
        assert "steps[0] (model 'features')" in str(info.value)
        assert "timed out after 100 ms" in str(info.value)


def test_client_errors_keep_their_status(served: RunningServer) -> None:
    with thttp.InferenceServerClient(served.http) as hc:
        with pytest.raises(InferenceServerException) as info:
            _http_infer(hc, "chain", {"X": np.zeros((1, 5), np.float32)})
        assert info.value.status() == "400"
        assert "input 'X'" in str(info.value)
        with pytest.raises(InferenceServerException) as big:
            _http_infer(hc, "chain", {"X": np.zeros((9, 4), np.float32)})
        assert big.value.status() == "400" and "max_batch_size 8" in str(big.value)


def test_priority_passes_through_to_the_steps(served: RunningServer) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    with thttp.InferenceServerClient(served.http) as hc:
        with pytest.raises(InferenceServerException) as info:
            _http_infer(hc, "ranked_chain", {"X": x}, priority=7)
        assert info.value.status() == "400"
        message = str(info.value)
        assert "steps[1] (model 'ranked_double')" in message
        assert "parameters.priority: expected an integer from 0 (default) to 2" in message
        high = _http_infer(hc, "ranked_chain", {"X": x}, priority=1)
        np.testing.assert_allclose(high.as_numpy("Y"), x * 4)
    with tgrpc.InferenceServerClient(served.grpc) as gc:
        with pytest.raises(InferenceServerException) as ginfo:
            _grpc_infer(gc, "ranked_chain", {"X": x}, priority=3)
        assert ginfo.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "parameters.priority" in str(ginfo.value)
        low = _grpc_infer(gc, "ranked_chain", {"X": x}, priority=2)
        np.testing.assert_allclose(low.as_numpy("Y"), x * 4)


def test_ensemble_config_and_metrics(served: RunningServer) -> None:
    with thttp.InferenceServerClient(served.http) as hc:
        config = hc.get_model_config("diamond")
        assert config["platform"] == "ensemble"
        assert config["max_batch_size"] == 16  # the smallest of its steps'
        assert hc.is_model_ready("diamond")
        _http_infer(hc, "diamond", {"X": np.ones((2, 4), np.float32)})
        stats = hc.get_inference_statistics("diamond")["model_stats"][0]
        assert int(stats["inference_count"]) >= 2
    import urllib.request

    with urllib.request.urlopen(f"{served.base}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'rtserve_requests_total{model="diamond",outcome="success",version="1"}' in text


def test_a_cached_ensemble_answers_a_repeat_without_running_its_steps(
    served: RunningServer,
) -> None:
    x = np.full((1, 4), 0.25, np.float32)
    with thttp.InferenceServerClient(served.http) as hc:
        first = _http_infer(hc, "cached_chain", {"X": x}).as_numpy("Y")
        runs = sum(_batch_counts(hc, "triple").values())
        again = _http_infer(hc, "cached_chain", {"X": x}).as_numpy("Y")
        assert sum(_batch_counts(hc, "triple").values()) == runs  # no step ran
        stats = hc.get_inference_statistics("cached_chain")["model_stats"][0]
    np.testing.assert_array_equal(first, again)
    np.testing.assert_allclose(first, x * 6)
    assert int(stats["inference_stats"]["cache_hit"]["count"]) >= 1


def test_independent_steps_run_concurrently(served: RunningServer) -> None:
    import time

    x = np.ones((1, 4), np.float32)
    with thttp.InferenceServerClient(served.http) as hc:
        start = time.perf_counter()
        result = _http_infer(hc, "parallel", {"X": x})
        elapsed = time.perf_counter() - start
    np.testing.assert_allclose(result.as_numpy("A"), x + 1)
    np.testing.assert_allclose(result.as_numpy("B"), x + 1)
    assert elapsed < 0.55, f"two 0.3 s steps of one level took {elapsed:.2f} s"
