"""ONNX models as users bring them, served and queried with tritonclient over HTTP and gRPC.

scikit-learn models converted the way users convert them (skl2onnx, defaults), and graphs
whose tensors are not plain tensors of known rank.

skl2onnx ends a classifier in a ZipMap: its probabilities are a sequence of maps, not a
tensor. The server serves ZipMap's input (the probability tensor, one column per class)
under the same output name and lists the classes in the model config."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp

from tests.conftest import RELAXED, RunningServer, start_server

skl2onnx = pytest.importorskip("skl2onnx")
datasets = pytest.importorskip("sklearn.datasets")

IRIS_NAMES = ["setosa", "versicolor", "virginica"]


@pytest.fixture(scope="module")
def fitted() -> dict[str, object]:
    from sklearn.ensemble import RandomForestClassifier, RandomForestRegressor
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from sklearn.tree import DecisionTreeClassifier

    x, y = datasets.load_iris(return_X_y=True)
    x = x.astype(np.float32)
    names = np.array(IRIS_NAMES)[y]
    return {
        "x": x,
        # int64 classes, a ZipMap of {int: prob}
        "iris-logreg": LogisticRegression(max_iter=1000).fit(x, y),
        # string classes through a pipeline, a ZipMap of {str: prob}
        "iris-tree": make_pipeline(StandardScaler(), DecisionTreeClassifier(max_depth=3)).fit(
            x, names
        ),
        # no ZipMap: one float per row
        "iris-forest-regressor": RandomForestRegressor(n_estimators=5, random_state=0).fit(
            x[:, :3], x[:, 3]
        ),
        # converted without ZipMap: its classes come from a labels file in the config
        "iris-forest": RandomForestClassifier(n_estimators=5, random_state=0).fit(x, y),
    }


def _data(fitted: dict[str, object], name: str) -> tuple[np.ndarray, Any]:
    """The iris features and the fitted scikit-learn model ``name``."""
    x = fitted["x"]
    assert isinstance(x, np.ndarray)
    return x, fitted[name]


@pytest.fixture(scope="module")
def served(
    fitted: dict[str, object], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("sklearn-repo")
    x = fitted["x"]
    assert isinstance(x, np.ndarray)
    for name, model in fitted.items():
        if name == "x":
            continue
        sample = x[:1, :3] if "regressor" in name else x[:1]
        options = {"zipmap": False} if name == "iris-forest" else None
        onx = skl2onnx.to_onnx(model, sample, options=options)  # default: ends in a ZipMap
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.onnx").write_bytes(onx.SerializeToString())
    (repo / "iris-forest" / "classes.txt").write_text("\n".join(IRIS_NAMES) + "\n")
    (repo / "iris-forest" / "config.yaml").write_text("labels: {probabilities: classes.txt}\n")
    s = start_server(repo, tmp_path_factory.mktemp("sklearn-server"))
    yield s
    s.stop()


def test_a_zipmap_classifier_loads_and_its_probabilities_are_a_tensor(
    served: RunningServer, fitted: dict[str, object]
) -> None:
    x, model = _data(fitted, "iris-logreg")
    rows = x[::7]
    with thttp.InferenceServerClient(served.http) as client:
        meta = client.get_model_metadata("iris-logreg")
        outputs = {o["name"]: o for o in meta["outputs"]}
        assert outputs["output_probability"]["datatype"] == "FP32"
        assert outputs["output_probability"]["shape"] == [-1, 3]
        config = client.get_model_config("iris-logreg")
        labels = config["parameters"]["labels:output_probability"]["string_value"]
        assert json.loads(labels) == ["0", "1", "2"]

        inp = thttp.InferInput("X", list(rows.shape), "FP32")
        inp.set_data_from_numpy(rows, binary_data=True)
        result = client.infer("iris-logreg", [inp])
    probs = result.as_numpy("output_probability")
    assert probs.shape == (len(rows), 3)
    np.testing.assert_allclose(probs, model.predict_proba(rows), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(result.as_numpy("output_label"), model.predict(rows))


def _grpc_labels_and_infer(
    served: RunningServer, model: str, output: str, rows: np.ndarray, class_count: int = 0
) -> tuple[list[str], tgrpc.InferResult]:
    """Over gRPC: the labels the model config lists for ``output``, and the answer to
    ``rows`` (with ``class_count``: that output's top classes only)."""
    with tgrpc.InferenceServerClient(served.grpc) as client:
        config = client.get_model_config(model, as_json=True)["config"]
        labels = json.loads(config["parameters"][f"labels:{output}"]["string_value"])
        inp = tgrpc.InferInput("X", list(rows.shape), "FP32")
        inp.set_data_from_numpy(rows)
        wanted = [tgrpc.InferRequestedOutput(output, class_count=class_count)]
        result = client.infer(model, [inp], outputs=wanted if class_count else None)
    return labels, result


def test_string_labels_come_back_as_bytes_with_their_classes_listed_over_grpc(
    served: RunningServer, fitted: dict[str, object]
) -> None:
    x, model = _data(fitted, "iris-tree")
    rows = x[::5]
    labels, result = _grpc_labels_and_infer(served, "iris-tree", "output_probability", rows)
    assert labels == IRIS_NAMES
    got = [v.decode() for v in result.as_numpy("output_label")]
    assert got == list(model.predict(rows))
    probs = result.as_numpy("output_probability")
    np.testing.assert_allclose(probs, model.predict_proba(rows), atol=1e-6)
    # The columns follow the listed classes: the most probable one is the label.
    assert [IRIS_NAMES[i] for i in probs.argmax(axis=1)] == got


def test_concurrent_one_row_requests_are_batched_and_each_gets_its_own_row(
    served: RunningServer, fitted: dict[str, object]
) -> None:
    x, model = _data(fitted, "iris-logreg")

    def one(i: int) -> tuple[int, np.ndarray, np.ndarray]:
        row = x[i : i + 1]
        with thttp.InferenceServerClient(served.http) as client:
            inp = thttp.InferInput("X", [1, 4], "FP32")
            inp.set_data_from_numpy(row, binary_data=False)
            r = client.infer("iris-logreg", [inp])
        return i, r.as_numpy("output_label"), r.as_numpy("output_probability")

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, range(0, 150, 3)))
    for i, label, probs in answers:
        assert probs.shape == (1, 3)
        np.testing.assert_allclose(probs, model.predict_proba(x[i : i + 1]), rtol=1e-4, atol=1e-5)
        assert label.tolist() == model.predict(x[i : i + 1]).tolist()


def test_a_regressor_without_zipmap_lists_no_labels(
    served: RunningServer, fitted: dict[str, object]
) -> None:
    x, model = _data(fitted, "iris-forest-regressor")
    rows = np.ascontiguousarray(x[:10, :3])
    with thttp.InferenceServerClient(served.http) as client:
        assert "parameters" not in client.get_model_config("iris-forest-regressor")
        inp = thttp.InferInput("X", list(rows.shape), "FP32")
        inp.set_data_from_numpy(rows)
        result = client.infer("iris-forest-regressor", [inp])
    (name,) = [o["name"] for o in result.get_response()["outputs"]]
    np.testing.assert_allclose(
        result.as_numpy(name).reshape(-1),
        model.predict(rows),
        rtol=1e-5,
    )


def _save(path: Path, graph: object) -> None:
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.mkdir(parents=True)
    onnx.save(model, path / "model.onnx")


def test_graphs_that_cannot_be_served_as_they_are_are_refused_by_name(tmp_path: Path) -> None:
    """A sequence output that no ZipMap made is refused; an input of unknown rank (which
    onnxruntime reports as a scalar's shape) is refused unless the config declares it, and
    then serves with the declared shape."""
    from onnx import TensorProto, helper

    repo = tmp_path / "repo"
    _save(
        repo / "seq" / "1",
        helper.make_graph(
            [helper.make_node("SequenceConstruct", ["X", "X"], ["S"])],
            "seq",
            [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 2])],
            [helper.make_tensor_sequence_value_info("S", TensorProto.FLOAT, None)],
        ),
    )
    any_rank = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "any-rank",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    _save(repo / "any-rank" / "1", any_rank)
    _save(repo / "any-rank-declared" / "1", any_rank)
    (repo / "any-rank-declared" / "config.yaml").write_text(
        "max_batch_size: 0\ninputs:\n  - {name: x, datatype: FP32, shape: [2, -1]}\n"
    )
    # labels files that cannot be used: a missing file, an output the model lacks
    _save(repo / "no-file" / "1", any_rank)
    (repo / "no-file" / "config.yaml").write_text(
        "max_batch_size: 0\ninputs: [{name: x, datatype: FP32, shape: [2]}]\n"
        "labels: {y: missing.txt}\n"
    )
    _save(repo / "no-output" / "1", any_rank)
    (repo / "no-output" / "labels.txt").write_text("a\nb\n")
    (repo / "no-output" / "config.yaml").write_text(
        "max_batch_size: 0\ninputs: [{name: x, datatype: FP32, shape: [2]}]\n"
        "labels: {z: labels.txt}\n"
    )
    s = start_server(repo, tmp_path / "work", *RELAXED)
    try:
        with thttp.InferenceServerClient(s.http) as client:
            assert not client.is_model_ready("seq")
            assert not client.is_model_ready("any-rank")
            assert not client.is_model_ready("no-file")
            assert not client.is_model_ready("no-output")
            x = np.array([[1.0, -2.0, 3.0], [-4.0, 5.0, -6.0]], dtype=np.float32)
            inp = thttp.InferInput("x", [2, 3], "FP32")
            inp.set_data_from_numpy(x)
            result = client.infer("any-rank-declared", [inp])
            np.testing.assert_array_equal(result.as_numpy("y"), np.maximum(x, 0))
        log = s.log()
        assert "'S' has type seq(tensor(float)), which the V2 protocol cannot carry" in log
        assert "input 'x' has no shape (any rank)" in log
        assert "labels.y: cannot read missing.txt" in log
        assert "labels.z: the model has no output 'z'" in log
    finally:
        s.stop()


def test_class_count_returns_the_top_classes_with_their_labels_over_both_protocols(
    served: RunningServer, fitted: dict[str, object]
) -> None:
    """tritonclient's ``class_count`` (the classification extension): each row's top N
    probabilities as ``value:index:label`` strings, in descending order."""
    x, model = _data(fitted, "iris-tree")
    rows = x[::25]
    expected = model.predict_proba(rows)
    for mod, url in ((thttp, served.http), (tgrpc, served.grpc)):
        with mod.InferenceServerClient(url) as client:
            inp = mod.InferInput("X", list(rows.shape), "FP32")
            inp.set_data_from_numpy(rows)
            wanted = mod.InferRequestedOutput("output_probability", class_count=2)
            result = client.infer("iris-tree", [inp], outputs=[wanted])
        top = result.as_numpy("output_probability")
        assert top.shape == (len(rows), 2)
        for r, row in enumerate(top):
            parts = [v.decode().split(":") for v in row]
            order = np.argsort(-expected[r], kind="stable")[:2]
            assert [int(p[1]) for p in parts] == order.tolist()
            assert [p[2] for p in parts] == [IRIS_NAMES[i] for i in order]
            np.testing.assert_allclose([float(p[0]) for p in parts], expected[r][order], atol=1e-6)
    with thttp.InferenceServerClient(served.http) as client:
        assert "classification" in client.get_server_metadata()["extensions"]


def test_a_bad_class_count_is_a_400_naming_the_parameter(served: RunningServer) -> None:
    import httpx

    row = {"name": "X", "shape": [1, 4], "datatype": "FP32", "data": [5.1, 3.5, 1.4, 0.2]}
    for output, count, says in (
        ("output_probability", -1, "expected a positive integer"),
        ("output_probability", "2", "expected a positive integer"),
        ("output_label", 1, "output 'output_label' is BYTES"),
    ):
        body = {
            "inputs": [row],
            "outputs": [{"name": output, "parameters": {"classification": count}}],
        }
        r = httpx.post(f"{served.base}/v2/models/iris-tree/infer", json=body)
        assert r.status_code == 400
        assert "outputs[0].parameters.classification" in r.json()["error"] and says in r.text


def test_top_classes_ranks_each_row_and_clamps_to_the_classes_there_are() -> None:
    from rtserve.core.dataplane import top_classes

    scores = np.array([[0.1, 0.7, 0.2], [0.5, 0.5, 0.0]], dtype=np.float32)
    got = top_classes(scores, 5, batched=True, labels=("a", "b", "c"))
    assert got.shape == (2, 3)  # 5 asked, 3 classes
    assert got[0].tolist() == [b"0.700000:1:b", b"0.200000:2:c", b"0.100000:0:a"]
    assert got[1].tolist()[:2] == [b"0.500000:0:a", b"0.500000:1:b"]  # a tie: lower index first
    ints = top_classes(np.array([3, 9, 4], dtype=np.int64), 2, batched=False)
    assert ints.tolist() == [b"9:1", b"4:2"]  # not batched: the whole tensor is one row


def test_labels_from_a_config_file_name_the_top_classes(
    served: RunningServer, fitted: dict[str, object]
) -> None:
    x, model = _data(fitted, "iris-forest")
    rows = x[::30]
    labels, result = _grpc_labels_and_infer(served, "iris-forest", "probabilities", rows, 1)
    assert labels == IRIS_NAMES
    got = [v.decode().split(":")[2] for v in result.as_numpy("probabilities").reshape(-1)]
    best = np.argmax(model.predict_proba(rows), axis=1)
    assert got == [IRIS_NAMES[i] for i in best]


def test_batching_is_chosen_only_along_a_real_batch_axis(tmp_path: Path) -> None:
    """Without max_batch_size in the config the server batches only where the first
    dimension is one batch axis: a time-major export ([seq, batch, ...]) and first
    dimensions named apart are served one request at a time, and each concurrent caller
    gets what ONNX Runtime gives for its request alone. A rank-0 tensor with batching
    configured is refused at load, naming it."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    repo = tmp_path / "repo"
    w = helper.make_tensor("w", TensorProto.FLOAT, [3, 3], np.eye(3, dtype=np.float32).ravel() * 2)
    time_major = helper.make_graph(  # y[t] = y[t-1] + 2 x[t]: rows of dim 0 depend on each other
        [helper.make_node("MatMul", ["x", "w"], ["h"]),
         helper.make_node("CumSum", ["h", "axis"], ["y"])],
        "time-major",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["seq", "batch", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["seq", "batch", 3])],
        [w, helper.make_tensor("axis", TensorProto.INT64, [], [0])],
    )  # fmt: skip
    _save(repo / "time-major" / "1", time_major)
    column_sums = helper.make_graph(
        [helper.make_node("ReduceSum", ["x", "axes"], ["m"], keepdims=0)],
        "column-sums",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("m", TensorProto.FLOAT, ["K"])],
        [helper.make_tensor("axes", TensorProto.INT64, [1], [0])],
    )
    _save(repo / "column-sums" / "1", column_sums)
    x_rows = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2])
    scalar_in = helper.make_graph(
        [helper.make_node("Div", ["x", "t"], ["y"])], "scalar-in",
        [x_rows, helper.make_tensor_value_info("t", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
    )  # fmt: skip
    scalar_out = helper.make_graph(
        [helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0)], "scalar-out",
        [x_rows], [helper.make_tensor_value_info("total", TensorProto.FLOAT, [])],
    )  # fmt: skip
    for name, graph in (("scalar-in", scalar_in), ("scalar-out", scalar_out)):
        _save(repo / name / "1", graph)
        (repo / name / "config.yaml").write_text("max_batch_size: 8\n")
    s = start_server(repo, tmp_path / "work", *RELAXED)
    try:
        with thttp.InferenceServerClient(s.http) as client:
            assert not client.is_model_ready("scalar-in")
            assert not client.is_model_ready("scalar-out")
            assert client.get_model_config("time-major")["max_batch_size"] == 0
            assert client.get_model_config("column-sums")["max_batch_size"] == 0
        log = s.log()
        assert "max_batch_size: 't' is a scalar (rank 0) in the model" in log
        assert "max_batch_size: 'total' is a scalar (rank 0) in the model" in log
        assert "'y' names its dimension 1 'batch'" in log or "'x' names its dimension 1" in log
        sessions = {
            n: ort.InferenceSession(str(repo / n / "1" / "model.onnx"))
            for n in ("time-major", "column-sums")
        }
        rng = np.random.default_rng(0)
        cases = [("time-major", rng.random((4, 1, 3), np.float32)) for _ in range(8)]
        cases += [("column-sums", rng.random((1, 2), np.float32)) for _ in range(8)]

        def call(case: tuple[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
            name, x = case
            with thttp.InferenceServerClient(s.http) as c:
                inp = thttp.InferInput("x", list(x.shape), "FP32")
                inp.set_data_from_numpy(x)
                got = c.infer(name, [inp]).as_numpy("y" if name == "time-major" else "m")
            return got, sessions[name].run(None, {"x": x})[0]

        with ThreadPoolExecutor(8) as pool:
            for got, want in pool.map(call, cases * 2):
                np.testing.assert_allclose(got, want, rtol=1e-6)
    finally:
        s.stop()


def test_open_dimensions_that_refuse_ones_still_load_and_serve(tmp_path: Path) -> None:
    """Warmup fills open dimensions with 1, then 32: a CNN with open height and width
    refuses a 1x1 image and loads with 32x32; a model that refuses both loads untimed with
    a warning naming the way out; `warmup: {iterations: 0}` skips warmup. Each serves
    requests of its real sizes as ONNX Runtime answers them."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    repo = tmp_path / "repo"
    k = helper.make_tensor("k", TensorProto.FLOAT, [1, 1, 3, 3], np.full(9, 0.1, np.float32))
    cnn = helper.make_graph(
        [helper.make_node("Conv", ["x", "k"], ["c1"]),
         helper.make_node("MaxPool", ["c1"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
         helper.make_node("Conv", ["p", "k"], ["y"])],
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1, "oh", "ow"])],
        [k],
    )  # fmt: skip
    _save(repo / "cnn" / "1", cnn)
    sevens = helper.make_graph(  # rows of 49 values only: neither 1 nor 32 fits
        [helper.make_node("Reshape", ["x", "s"], ["y"])],
        "sevens",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 7, 7])],
        [helper.make_tensor("s", TensorProto.INT64, [3], [-1, 7, 7])],
    )
    _save(repo / "sevens" / "1", sevens)
    _save(repo / "sevens-off" / "1", sevens)
    (repo / "sevens-off" / "config.yaml").write_text("warmup: {iterations: 0}\n")
    from tests.models import build_scale

    build_scale(repo / "loose" / "1" / "model.onnx", 2.0)  # x [batch, 4], declared [-1]
    (repo / "loose" / "config.yaml").write_text(
        "max_batch_size: 4\ninputs: [{name: x, datatype: FP32, shape: [-1]}]\n"
    )
    s = start_server(repo, tmp_path / "work", *RELAXED)
    try:
        from tritonclient.utils import InferenceServerException

        with thttp.InferenceServerClient(s.http) as client:  # ORT's reason, indices and all
            inp = thttp.InferInput("x", [1, 5], "FP32")
            inp.set_data_from_numpy(np.ones((1, 5), np.float32))
            with pytest.raises(InferenceServerException) as info:
                client.infer("loose", [inp])
            assert info.value.status() == "400"
            assert "for the following indices; index: 1 Got: 5 Expected: 4" in str(info.value)
        rng = np.random.default_rng(1)
        cases = {
            "cnn": rng.random((2, 1, 20, 24), np.float32),
            "sevens": rng.random((3, 49), np.float32),
            "sevens-off": rng.random((1, 49), np.float32),
        }
        with thttp.InferenceServerClient(s.http) as client:
            for name, x in cases.items():
                assert client.is_model_ready(name), name
                inp = thttp.InferInput("x", list(x.shape), "FP32")
                inp.set_data_from_numpy(x)
                got = client.infer(name, [inp]).as_numpy("y")
                session = ort.InferenceSession(str(repo / name / "1" / "model.onnx"))
                np.testing.assert_allclose(got, session.run(None, {"x": x})[0], rtol=1e-6)
        log = s.log()
        assert "model sevens: warmup skipped: the model refused zeros" in log
        assert "Set warmup: {iterations: 0}" in log
        assert "model cnn: warmup skipped" not in log
        assert "model sevens-off: warmup skipped" not in log
    finally:
        s.stop()


def test_inputs_that_share_a_named_dimension_must_agree_there(tmp_path: Path) -> None:
    """ids [N, S] and mask [N, S]: lengths 3 and 5 are the client's 400 naming both
    inputs and the dimension (ONNX Runtime failed deep in the graph: a 500)."""
    from onnx import TensorProto, helper
    from tritonclient.utils import InferenceServerException

    repo = tmp_path / "repo"
    graph = helper.make_graph(
        [helper.make_node("Mul", ["ids", "mask"], ["y"])],
        "seq",
        [helper.make_tensor_value_info("ids", TensorProto.FLOAT, ["N", "S"]),
         helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["N", "S"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "S"])],
    )  # fmt: skip
    _save(repo / "seq" / "1", graph)
    s = start_server(repo, tmp_path / "work", *RELAXED)
    try:
        with thttp.InferenceServerClient(s.http) as client:
            inputs = [
                thttp.InferInput("ids", [1, 3], "FP32"),
                thttp.InferInput("mask", [1, 5], "FP32"),
            ]
            inputs[0].set_data_from_numpy(np.ones((1, 3), np.float32))
            inputs[1].set_data_from_numpy(np.ones((1, 5), np.float32))
            with pytest.raises(InferenceServerException) as info:
                client.infer("seq", inputs)
            assert info.value.status() == "400"
            assert "inputs 'ids' and 'mask' share the model's dimension 'S'" in str(info.value)
            assert "got 3 and 5" in str(info.value)
            inputs[1] = thttp.InferInput("mask", [1, 3], "FP32")
            inputs[1].set_data_from_numpy(np.full((1, 3), 2, np.float32))
            assert client.infer("seq", inputs).as_numpy("y").tolist() == [[2.0, 2.0, 2.0]]
    finally:
        s.stop()
