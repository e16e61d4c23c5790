"""Edge formats: ``rtserve export-edge`` writes .tflite (LiteRT) and .ort (ONNX Runtime) files
that answer like the FP32 model on their own runtimes, and ``backend: litert`` serves a
.tflite over HTTP and gRPC exactly as the interpreter called directly.

The INT8 budget on the digits classifier: top-1 agreement with FP32 >= 0.95 and task
accuracy within 2 points. Converting to LiteRT needs litert-torch (here, or in the
converter venv ``make edge-converter`` builds); without it those tests skip with the reason.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from rtserve.errors import ConfigError
from rtserve.optimize.edge import EdgeRequest, EdgeResult, export_edge
from tests.conftest import ROOT, RunningServer, start_server
from tests.models import config_of

pytest.importorskip("ai_edge_litert", reason="the LiteRT interpreter (ai-edge-litert) is absent")
torch = pytest.importorskip("torch", reason="edge export needs torch")
pytest.importorskip("sklearn", reason="the digits data set ships with scikit-learn")

thttp = pytest.importorskip("tritonclient.http")
tgrpc = pytest.importorskip("tritonclient.grpc")

CONVERTER = ROOT / "bench" / ".peers" / "litert" / "bin" / "python"
INT8_AGREEMENT = 0.95
INT8_ACCURACY_POINTS = 0.02


def converter_python() -> str | None:
    """A python with litert-torch: this one, $RTSERVE_LITERT_PYTHON or the converter venv."""
    if importlib.util.find_spec("litert_torch") is not None:
        return None
    found = os.environ.get("RTSERVE_LITERT_PYTHON") or (
        str(CONVERTER) if CONVERTER.exists() else ""
    )
    if not found:
        pytest.skip(
            "litert-torch is not installed here nor in bench/.peers/litert (make edge-converter)"
        )
    return found


@pytest.fixture(scope="module")
def digits() -> dict[str, Any]:
    """A small MLP trained on sklearn's digits (1 s), with calibration and test rows."""
    from sklearn.datasets import load_digits

    torch.manual_seed(0)
    torch.set_num_threads(2)
    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    xt, yt = torch.from_numpy(x[:1200]), torch.from_numpy(y[:1200])
    for _ in range(150):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xt), yt).backward()
        opt.step()
    return {"model": model.eval(), "calib": x[:300], "x": x[1200:], "y": y[1200:]}


def request(digits: dict[str, Any], fmt: str, out: Path, python: str | None = None) -> EdgeRequest:
    return EdgeRequest(
        fmt=fmt,
        out=out,
        example={"x": digits["x"][:1]},
        output_names=["logits"],
        eval_data={"x": digits["x"]},
        labels=digits["y"],
        calibration={"x": digits["calib"]},
        converter_python=python,
        threads=(1, 2),
        iterations=30,
    )


@pytest.fixture(scope="module")
def litert_export(
    digits: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, EdgeResult]]:
    python = converter_python()
    out = tmp_path_factory.mktemp("litert")
    results = export_edge(digits["model"], request(digits, "litert", out, python))
    return out, {r.name: r for r in results}


@pytest.fixture(scope="module")
def ort_export(
    digits: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, EdgeResult]]:
    out = tmp_path_factory.mktemp("ort")
    results = export_edge(digits["model"], request(digits, "ort", out))
    return out, {r.name: r for r in results}


def reference_accuracy(digits: dict[str, Any]) -> float:
    with torch.no_grad():
        logits = digits["model"](torch.from_numpy(digits["x"])).numpy()
    return float(np.mean(logits.argmax(1) == digits["y"]))


def check_results(results: dict[str, EdgeResult], fp32: str, int8: str, ref_acc: float) -> None:
    assert results[fp32].max_abs_diff < 1e-4
    assert results[fp32].metrics["top1_agreement"] == 1.0
    assert results[int8].metrics["top1_agreement"] >= INT8_AGREEMENT
    assert ref_acc - results[int8].score <= INT8_ACCURACY_POINTS
    assert results[int8].size_bytes < 0.6 * results[fp32].size_bytes
    for r in results.values():
        assert r.load_ms > 0
        assert set(r.latency_ms) == {1, 2}
        assert all(0 < p50 <= p99 for p50, p99 in r.latency_ms.values())


def test_tflite_files_answer_within_tolerance_of_torch(
    litert_export: tuple[Path, dict[str, EdgeResult]], digits: dict[str, Any]
) -> None:
    out, results = litert_export
    assert set(results) == {"litert-fp32", "litert-int8"}
    check_results(results, "litert-fp32", "litert-int8", reference_accuracy(digits))
    assert (out / "report.json").is_file() and "model-int8.tflite" in (
        out / "report.md"
    ).read_text()


def test_ort_files_answer_within_tolerance_and_list_their_operators(
    ort_export: tuple[Path, dict[str, EdgeResult]], digits: dict[str, Any]
) -> None:
    out, results = ort_export
    assert set(results) == {"onnx-fp32", "ort-fp32", "ort-int8"}
    check_results(results, "ort-fp32", "ort-int8", reference_accuracy(digits))
    ops = (out / "required_operators.config").read_text()
    assert "Gemm" in ops and "QuantizeLinear" in ops  # the minimal build's operator list


def test_export_edge_cli_refuses_int8_without_calibration(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "rtserve.cli", "export-edge", "x.onnx", "--format", "ort",
         "--int8", "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "--int8 needs --calibration" in proc.stderr


def _tiny_onnx(path: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _bad_npz(path: Path, kind: str) -> Path:
    if kind == "pickled":  # an object array: np.load must not unpickle it
        np.savez(path, x=np.array([{"a": 1}, None], dtype=object))
    elif kind == "not-a-zip":
        path.write_bytes(b"\x80\x04 not a zip file at all")
    elif kind == "strings":
        np.savez(path, x=np.array([["a", "b", "c", "d"]]))
    elif kind == "one-row":
        np.savez(path, x=np.ones((1, 4), np.float32))
    return path


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--batch", "0"], "--batch: expected an integer >= 1"),
        (["--threads", "abc"], "--threads: expected thread counts >= 1"),
        (["--threads", "0,2"], "--threads: expected thread counts >= 1"),
        (["--iterations", "0"], "--iterations: expected an integer >= 1"),
        (["--converter-python", "/no/such/python"], "--converter-python /no/such/python"),
        (["--out-under-a-file"], "cannot make the folder"),
        (["--int8", "--calibration", "pickled"], "not a readable .npz"),
        (["--int8", "--calibration", "not-a-zip"], "not a readable .npz"),
        (["--int8", "--calibration", "strings"], "input x holds <U1 values; expected numbers"),
        (["--batch", "2", "--eval", "one-row"], "has 1 row(s), fewer than the exported batch of 2"),
    ],
)
def test_export_edge_cli_bad_arguments_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], needle: str
) -> None:
    from rtserve.cli import main

    model = _tiny_onnx(tmp_path / "m.onnx")
    out = tmp_path / "out"
    args = []
    for a in extra:
        if a == "--out-under-a-file":
            (tmp_path / "file").write_text("")
            out = tmp_path / "file" / "out"
        elif a in ("pickled", "not-a-zip", "strings", "one-row"):
            args.append(str(_bad_npz(tmp_path / f"{a}.npz", a)))
        else:
            args.append(a)
    code = main(["export-edge", str(model), "--format", "ort", "--out", str(out), *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and needle in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("x:-1x64", "every dim must be at least 1"),
        ("x:1x64:floaty", "DTYPE 'floaty' is not a numeric numpy type"),
        ("x:100000x100000x100000", "more than an example input needs"),
    ],
)
def test_export_edge_cli_bad_input_specs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, spec: str, needle: str
) -> None:
    from rtserve.cli import main

    code = main(
        ["export-edge", "torch.nn:Identity", "--format", "litert", "--input", spec,
         "--out", str(tmp_path / "out")]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and needle in err, err


def write_model(repo: Path, name: str, file: Path, config: dict[str, Any]) -> None:
    version = repo / name / "1"
    version.mkdir(parents=True)
    shutil.copyfile(file, version / config.pop("_as", file.name))
    (repo / name / "config.yaml").write_text(yaml.safe_dump({"name": name, **config}))


@pytest.fixture(scope="module")
def edge_server(
    litert_export: tuple[Path, dict[str, EdgeResult]],
    ort_export: tuple[Path, dict[str, EdgeResult]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("edge-repo")
    tfl, ort_dir = litert_export[0], ort_export[0]
    write_model(
        repo, "digits-tflite", tfl / "model.tflite", {"backend": "litert", "max_batch_size": 8}
    )
    write_model(
        repo, "digits-tflite-int8", tfl / "model-int8.tflite",
        {"backend": "litert", "max_batch_size": 8, "litert": {"file": "model-int8.tflite"}},
    )  # fmt: skip
    write_model(repo, "digits-ort", ort_dir / "model-int8.ort", {"_as": "model.ort"})
    server = start_server(repo, tmp_path_factory.mktemp("edge-server"))
    yield server
    server.stop()


def interpreter_answer(path: Path, x: np.ndarray) -> np.ndarray:
    """The LiteRT interpreter called directly, quantizing by hand as an app on a phone does."""
    from ai_edge_litert.interpreter import Interpreter

    interp = Interpreter(model_path=str(path))
    runner = interp.get_signature_runner()
    inp, out = runner.get_input_details()["x"], runner.get_output_details()["logits"]
    feed = x
    if inp["dtype"] == np.int8:
        scale, zero = inp["quantization"]
        feed = np.clip(np.rint(x / scale) + zero, -128, 127).astype(np.int8)
    got = runner(x=feed)["logits"]
    if out["dtype"] == np.int8:
        scale, zero = out["quantization"]
        got = (got.astype(np.float32) - zero) * np.float32(scale)
    return np.asarray(got, dtype=np.float32)


@pytest.mark.parametrize(
    ("model", "file"),
    [("digits-tflite", "model.tflite"), ("digits-tflite-int8", "model-int8.tflite")],
)
def test_litert_served_over_http_and_grpc_equals_the_interpreter(
    edge_server: RunningServer,
    litert_export: tuple[Path, dict[str, EdgeResult]],
    digits: dict[str, Any],
    model: str,
    file: str,
) -> None:
    x = digits["x"][:5]
    want = interpreter_answer(litert_export[0] / file, x)
    hclient = thttp.InferenceServerClient(edge_server.http)
    hin = thttp.InferInput("x", [5, 64], "FP32")
    hin.set_data_from_numpy(x, binary_data=True)
    got_http = hclient.infer(model, [hin]).as_numpy("logits")
    gclient = tgrpc.InferenceServerClient(edge_server.grpc)
    gin = tgrpc.InferInput("x", [5, 64], "FP32")
    gin.set_data_from_numpy(x)
    got_grpc = gclient.infer(model, [gin]).as_numpy("logits")
    np.testing.assert_allclose(got_http, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got_grpc, got_http)
    meta = hclient.get_model_metadata(model)
    assert meta["platform"] == "litert_tflite"
    assert meta["inputs"][0] == {"name": "x", "datatype": "FP32", "shape": [-1, 64]}
    with urllib.request.urlopen(f"{edge_server.base}/metrics", timeout=5) as r:
        assert f'model="{model}"' in r.read().decode()


def test_onnxruntime_backend_serves_a_dot_ort_file(
    edge_server: RunningServer,
    ort_export: tuple[Path, dict[str, EdgeResult]],
    digits: dict[str, Any],
) -> None:
    import onnxruntime as ort

    x = digits["x"][:3]
    want = ort.InferenceSession(str(ort_export[0] / "model-int8.ort")).run(None, {"x": x})[0]
    client = thttp.InferenceServerClient(edge_server.http)
    inp = thttp.InferInput("x", [3, 64], "FP32")
    inp.set_data_from_numpy(x)
    np.testing.assert_allclose(
        client.infer("digits-ort", [inp]).as_numpy("logits"), want, atol=1e-6
    )


@pytest.mark.parametrize(
    ("shape", "datatype", "expected"),
    [([2, 7], "FP32", "x"), ([2, 64], "INT64", "FP32")],
)
def test_litert_bad_input_is_a_400_and_the_server_keeps_serving(
    edge_server: RunningServer, shape: list[int], datatype: str, expected: str
) -> None:
    from tritonclient.utils import InferenceServerException

    client = thttp.InferenceServerClient(edge_server.http)
    bad = thttp.InferInput("x", shape, datatype)
    bad.set_data_from_numpy(np.zeros(shape, np.float32 if datatype == "FP32" else np.int64))
    with pytest.raises(InferenceServerException) as info:
        client.infer("digits-tflite", [bad])
    assert info.value.status() == "400" and expected in str(info.value)
    gclient = tgrpc.InferenceServerClient(edge_server.grpc)
    gbad = tgrpc.InferInput("x", shape, datatype)
    gbad.set_data_from_numpy(np.zeros(shape, np.float32 if datatype == "FP32" else np.int64))
    with pytest.raises(InferenceServerException) as ginfo:
        gclient.infer("digits-tflite", [gbad])
    assert "INVALID_ARGUMENT" in str(ginfo.value.status())
    good = thttp.InferInput("x", [1, 64], "FP32")
    good.set_data_from_numpy(np.zeros((1, 64), np.float32))
    assert client.infer("digits-tflite", [good]).as_numpy("logits").shape == (1, 10)


def test_litert_config_errors_name_the_field(
    tmp_path: Path, litert_export: tuple[Path, dict[str, EdgeResult]]
) -> None:
    from rtserve.runtime.litert import load

    write_model(
        tmp_path,
        "m",
        litert_export[0] / "model.tflite",
        {"backend": "litert", "litert": {"threads": 2}},
    )
    with pytest.raises(ConfigError, match="litert.threads"):
        load(config_of(tmp_path / "m"), tmp_path / "m" / "1")
    write_model(
        tmp_path,
        "n",
        litert_export[0] / "model.tflite",
        {"backend": "litert", "litert": {"file": "other.tflite"}},
    )
    with pytest.raises(ConfigError, match="other.tflite not found"):
        load(config_of(tmp_path / "n"), tmp_path / "n" / "1")


class _Embedding(torch.nn.Module):
    """Token ids (int64 in torch; the .tflite takes int32) -> 4 numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.e = torch.nn.Embedding(100, 8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.e(ids).sum(1))


def test_litert_int64_ids_export_and_an_index_out_of_range_is_refused(tmp_path: Path) -> None:
    from rtserve.errors import InvalidInput
    from rtserve.runtime.litert import load

    python = converter_python()
    torch.manual_seed(0)
    model = _Embedding().eval()
    ids = np.random.default_rng(0).integers(0, 100, (16, 5)).astype(np.int64)
    results = export_edge(
        model,
        EdgeRequest(
            fmt="litert", out=tmp_path / "out", example={"ids": ids[:1]}, output_names=["out"],
            eval_data={"ids": ids}, converter_python=python, threads=(1,), iterations=5,
            rounds=1,
        ),
    )  # fmt: skip
    assert [r.name for r in results] == ["litert-fp32"]  # measured with int64 ids, cast
    write_model(tmp_path, "emb", tmp_path / "out" / "model.tflite", {"backend": "litert"})
    served = load(config_of(tmp_path / "emb"), tmp_path / "emb" / "1")
    try:
        with torch.no_grad():
            want = model(torch.from_numpy(ids[:1])).numpy()
        got = served.run(0, {"ids": ids[:1].astype(np.int32)})["out"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        with pytest.raises(InvalidInput, match="LiteRT could not run this input: .*index"):
            served.run(0, {"ids": np.array([[1, 2, 1000, 3, 4]], np.int32)})
        got = served.run(0, {"ids": ids[:1].astype(np.int32)})["out"]  # still runs
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    finally:
        served.close()


def test_nan_into_a_quantized_litert_input_is_a_400(edge_server: RunningServer) -> None:
    client = thttp.InferenceServerClient(edge_server.http)
    from tritonclient.utils import InferenceServerException

    x = np.zeros((2, 64), np.float32)
    x[1, 3] = np.nan
    bad = thttp.InferInput("x", [2, 64], "FP32")
    bad.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException) as info:
        client.infer("digits-tflite-int8", [bad])
    assert info.value.status() == "400" and "NaN" in str(info.value)
