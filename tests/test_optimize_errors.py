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


@pytest.fixture
def mlp_files(tmp_path: pathlib.Path) -> dict[str, pathlib.Path]:
    """A tiny MLP (16 features, 4 classes) with 8 rows of eval data; bad files beside it."""
    model = mlp_onnx(tmp_path / "mlp.onnx")
    np.savez(tmp_path / "eval.npz", x=np.random.default_rng(0).random((8, 16), np.float32))
    np.savez(tmp_path / "nan.npz", x=np.full((8, 16), np.nan, np.float32))
    np.save(tmp_path / "float-labels.npy", np.linspace(0, 1, 8))
    np.save(tmp_path / "str-labels.npy", np.array(["a"] * 8))
    np.save(tmp_path / "labels99.npy", np.full(8, 99))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    (tmp_path / "afile").write_text("")
    return {"model": model, "eval": tmp_path / "eval.npz", "dir": tmp_path}


OPTIMIZE_USAGE = [
    (["--max-accuracy-drop", "-1"], "--max-accuracy-drop: expected a number >= 0"),
    (["--max-accuracy-drop", "nan"], "--max-accuracy-drop: expected a number >= 0"),
    (["--noise-band", "-0.5"], "--noise-band: expected a number >= 0"),
    (["--iterations", "0"], "--iterations: expected an integer >= 1"),
    (["--threads", "0"], "--threads: expected an integer >= 1"),
    (["--max-batch-size", "-4"], "--max-batch-size: expected an integer >= 0"),
    (["--seq-len", "-5"], "--seq-len: expected an integer >= 1"),
    (["--temperature", "0"], "--temperature: expected a number > 0"),
    (["--alpha", "5"], "--alpha: expected a number >= 0 and <= 1"),
    (["--qat-epochs", "0"], "--qat-epochs: expected an integer >= 1"),
    (["--qat-lr", "nan"], "--qat-lr: expected a number > 0"),
    (["--fine-tune-epochs", "-3"], "--fine-tune-epochs: expected an integer >= 0"),
    (["--variants", ",fp16,"], "--variants: expected a comma list"),
    (["--calibration-methods", "bogus"], "--calibration-methods: unknown 'bogus'"),
    (["--prune", "bogus:0.3"], "--prune works on the torch model behind MODEL"),
    (["--qat"], "--qat works on the torch model"),
    (["--train", "eval.npz"], "--train works on the torch model"),
    (["--out", "afile/m"], "--out {dir}/afile/m: is under {dir}/afile, a file"),
    (["--work", "afile"], "--work {dir}/afile: is a file; expected a folder"),
    (["--eval", "nan.npz"], "input x holds NaN or infinite values"),
    (["--labels", "float-labels.npy"], "labels must be integer class indices, got float64"),
    (["--labels", "str-labels.npy"], "labels must be integer class indices"),
    (["--labels", "labels99.npy"], "--labels: label 99 is not a class of the model's 4 outputs"),
    (["--labels", "latin1.txt"], "expected one integer per line"),
    (["--eval", "."], "is a folder, not a file"),
]


@pytest.mark.parametrize(
    ("extra", "needle"), OPTIMIZE_USAGE, ids=[c[1][:40] for c in OPTIMIZE_USAGE]
)
def test_optimize_usage_errors_come_before_the_run(
    mlp_files: dict[str, pathlib.Path],
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    needle: str,
) -> None:
    from rtserve.cli import main

    d = mlp_files["dir"]
    args = ["optimize", str(mlp_files["model"]), "--eval", str(mlp_files["eval"]),
            "--out", str(d / "repo" / "m"), "--work", str(d / "work"), "--no-progress",
            "--variants", "int8-dynamic", "--iterations", "2"]  # fmt: skip
    for i, a in enumerate(extra):  # file names are in the fixture's folder
        if i and extra[i - 1] in ("--eval", "--labels", "--train", "--out", "--work"):
            a = str(d / a)
        args.append(a)
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert needle.format(dir=d) in err and "Traceback" not in err
    assert not (d / "work" / "int8-dynamic.onnx").exists()  # refused before any variant


def test_optimize_refuses_its_own_baseline_copy_as_the_model(
    mlp_files: dict[str, pathlib.Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from rtserve.cli import main

    d = mlp_files["dir"]
    (d / "w").mkdir()
    (d / "w" / "fp32.onnx").write_bytes(mlp_files["model"].read_bytes())
    code = main(["optimize", str(d / "w" / "fp32.onnx"), "--eval", str(mlp_files["eval"]),
                 "--out", str(d / "repo" / "m"), "--work", str(d / "w")])  # fmt: skip
    assert code == 2 and "the work folder's own baseline copy" in capsys.readouterr().err


def test_a_torch_factory_that_raises_is_a_one_line_error(tmp_path: pathlib.Path) -> None:
    from rtserve.optimize.export import load_module

    with pytest.raises(OptimizeError, match="calling it raised ZeroDivisionError"):
        load_module("tests.test_optimize_errors:_raising_factory")


def _raising_factory() -> None:
    raise ZeroDivisionError("a broken factory")


def test_non_utf8_text_data_is_named(tmp_path: pathlib.Path) -> None:
    from rtserve.optimize.data import read_sentences

    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(OptimizeError, match="not UTF-8 text"):
        read_sentences(path)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--given-rows", "0"], "--given-rows: expected an integer >= 1"),
        (["--tolerance", "nan"], "--tolerance: expected a number >= 0"),
        (["--input", "x:2x16"], "input 'x' is given more than once"),
        (["--out-under-a-file"], "its folder cannot be made (a file is in the way)"),
    ],
)
def test_export_usage_errors(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], extra: list[str], needle: str
) -> None:
    from rtserve.cli import main

    out = tmp_path / "m.onnx"
    if extra == ["--out-under-a-file"]:
        (tmp_path / "afile").write_text("")
        out, extra = tmp_path / "afile" / "m.onnx", []
    code = main(["export", "tests.test_optimize_helpers:tiny_mlp", "--input", "x:2x16",
                 "--out", str(out), *extra])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err, err


def test_optimize_fails_when_no_asked_variant_could_be_built(
    mlp_files: dict[str, pathlib.Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`--variants int8-static` without calibration data builds nothing the user asked for:
    exit 1 with the reason, not a published FP32 copy and exit 0."""
    from rtserve.cli import main

    d = mlp_files["dir"]
    code = main(["optimize", str(mlp_files["model"]), "--eval", str(mlp_files["eval"]),
                 "--out", str(d / "repo" / "m"), "--work", str(d / "work"), "--no-progress",
                 "--variants", "int8-static", "--iterations", "2"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 1, captured.err
    assert "none of --variants int8-static could be built (int8-static:" in captured.err
    assert not (d / "repo" / "m").exists()
    assert "`int8-static` not built:" in (d / "work" / "report.md").read_text()
    # one of two asked is enough to publish
    code = main(["optimize", str(mlp_files["model"]), "--eval", str(mlp_files["eval"]),
                 "--out", str(d / "repo" / "m"), "--work", str(d / "work"), "--no-progress",
                 "--variants", "int8-static,int8-dynamic", "--iterations", "2"])  # fmt: skip
    assert code == 0 and (d / "repo" / "m" / "config.yaml").exists()
