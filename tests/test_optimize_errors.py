"""Bad inputs give clear errors that name the file, input or node; the CLI exits 2."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from rtserve.optimize.check import check_operators
from rtserve.optimize.data import load_data, model_inputs
from rtserve.optimize.errors import OptimizeError
from rtserve.optimize.evaluate import open_session
from tests.test_optimize_helpers import cnn_onnx, mlp_onnx


def _custom_op_model(path: pathlib.Path) -> pathlib.Path:
    node = helper.make_node("FancyNorm", ["x"], ["y"], name="fancy_norm_1", domain="com.example")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)]
    )
    onnx.save(model, str(path))
    return path


def test_missing_model_file_names_the_path(tmp_path: pathlib.Path) -> None:
    with pytest.raises(OptimizeError, match=r"missing\.onnx does not exist"):
        open_session(tmp_path / "missing.onnx")


def test_unsupported_operator_names_the_node(tmp_path: pathlib.Path) -> None:
    path = _custom_op_model(tmp_path / "custom.onnx")
    with pytest.raises(
        OptimizeError, match=r"node fancy_norm_1 uses operator com\.example::FancyNorm"
    ):
        check_operators(path)


def test_unknown_standard_operator_names_the_node(tmp_path: pathlib.Path) -> None:
    path = _custom_op_model(tmp_path / "m.onnx")
    model = onnx.load(str(path))
    model.graph.node[0].domain = ""
    model.graph.node[0].op_type = "NoSuchOp"
    onnx.save(model, str(path))
    with pytest.raises(OptimizeError, match="node fancy_norm_1 uses operator NoSuchOp"):
        check_operators(path)


def test_wrong_calibration_shape_names_input_and_expected_shape(tmp_path: pathlib.Path) -> None:
    model = cnn_onnx(tmp_path / "cnn.onnx")
    bad = tmp_path / "calib.npz"
    np.savez(bad, image=np.zeros((4, 3, 32, 32), np.float32))
    with pytest.raises(
        OptimizeError, match=r"input image has shape \(4, 3, 32, 32\) but the model expects"
    ):
        load_data(bad, model_inputs(model))


def test_calibration_missing_an_input_is_named(tmp_path: pathlib.Path) -> None:
    model = mlp_onnx(tmp_path / "mlp.onnx")
    bad = tmp_path / "calib.npz"
    np.savez(bad, y=np.zeros((4, 16), np.float32))
    with pytest.raises(OptimizeError, match="no array for model input.* x"):
        load_data(bad, model_inputs(model))


def test_wrong_rank_and_dtype_are_named(tmp_path: pathlib.Path) -> None:
    model = mlp_onnx(tmp_path / "mlp.onnx")
    specs = model_inputs(model)
    flat = tmp_path / "flat.npy"
    np.save(flat, np.zeros(16, np.float32))
    with pytest.raises(OptimizeError, match="rank 1"):
        load_data(flat, specs)


def test_labels_count_must_match_rows(tmp_path: pathlib.Path) -> None:
    model = mlp_onnx(tmp_path / "mlp.onnx")
    data = tmp_path / "d.npz"
    np.savez(data, x=np.zeros((5, 16), np.float32), labels=np.zeros(3, np.int64))
    with pytest.raises(OptimizeError, match="3 labels for 5 rows"):
        load_data(data, model_inputs(model))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rtserve.optimize.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_reports_a_missing_model_without_traceback(tmp_path: pathlib.Path) -> None:
    proc = _cli(
        "optimize", str(tmp_path / "nope.onnx"), "--eval", str(tmp_path / "e.npz"),
        "--out", str(tmp_path / "repo" / "m"),
    )  # fmt: skip
    assert proc.returncode == 2
    assert "nope.onnx does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_reports_an_unsupported_operator_without_traceback(tmp_path: pathlib.Path) -> None:
    model = _custom_op_model(tmp_path / "custom.onnx")
    np.savez(tmp_path / "e.npz", x=np.zeros((4, 4), np.float32))
    proc = _cli(
        "optimize", str(model), "--eval", str(tmp_path / "e.npz"), "--out", str(tmp_path / "r" / "m"),
    )  # fmt: skip
    assert proc.returncode == 2
    assert "fancy_norm_1" in proc.stderr and "Traceback" not in proc.stderr
