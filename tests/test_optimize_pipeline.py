"""End to end on a tiny labelled classifier: variants, choice, model repository, CLI."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
import yaml

from rtserve.optimize.distill import train_supervised
from rtserve.optimize.pipeline import OptimizeOptions, PruneSpec, TorchSources, run_optimize
from rtserve.optimize.publish import publish
from rtserve.optimize.report import speedup
from tests.test_optimize_helpers import mlp_onnx, tiny_mlp

FAST = {"iterations": 6, "max_seconds": 0.2, "rounds": 2, "progress": False, "batch_sizes": (1, 8)}


def _data(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 16)).astype(np.float32)
    y = (x[:, :4].argmax(1)).astype(np.int64)
    return x, y


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, object]:
    x, y = _data(300, 0)
    model = tiny_mlp(hidden=64)
    train_supervised(model, x, y, epochs=15, lr=3e-3)
    path = mlp_onnx(tmp_path_factory.mktemp("m") / "model.onnx", model)
    return path, model


def test_run_optimize_measures_every_variant_and_chooses_within_budget(
    trained: tuple[pathlib.Path, object], tmp_path: pathlib.Path
) -> None:
    import torch

    path, model = trained
    assert isinstance(model, torch.nn.Module)
    x_train, y_train = _data(300, 0)
    x_cal, _ = _data(64, 1)
    x_eval, y_eval = _data(128, 2)
    student = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    sources = TorchSources(
        model=model, student=student, train_inputs={"x": x_train}, train_labels=y_train,
        prune=[PruneSpec("structured", 0.5, 3)], distill_epochs=10,
    )  # fmt: skip
    options = OptimizeOptions(max_accuracy_drop=0.05, calibration_methods=("minmax",), **FAST)  # type: ignore[arg-type]
    result = run_optimize(
        path, tmp_path / "work", {"x": x_cal}, {"x": x_eval}, y_eval, options, sources
    )
    names = {m.name for m in result.measurements}
    assert names == {
        "fp32", "fp32-opt", "fp16", "int8-dynamic", "int8-weight", "int8-static-minmax",
        "pruned-structured-50", "distilled",
    }  # fmt: skip
    for m in result.measurements:
        assert m.size_bytes > 0 and m.p50_ms > 0 and m.p99_ms >= m.p50_ms
        assert set(m.throughput) == {1, 8}
        assert m.score_name == "accuracy" and 0 <= m.score <= 1
    assert result.chosen is not None
    assert result.reference_score - result.chosen.score <= 0.05
    ok = [m for m in result.measurements if result.reference_score - m.score <= 0.05]
    base = result.get("fp32")
    assert result.noise_band >= 0.2 and base is not None
    fastest = max(ok, key=lambda m: (speedup(base, m), m.score))
    if fastest is base:
        assert result.chosen is base
    elif speedup(base, fastest) <= 1 + result.noise_band:
        assert result.chosen is base and "within noise" in result.choice_note
    else:
        assert result.chosen is fastest

    repo = tmp_path / "repo" / "tiny"
    first = publish(repo, result.chosen, result.measurements, 0.05, max_batch_size=16)
    second = publish(repo, result.chosen, result.measurements, 0.05, max_batch_size=16)
    assert first == repo / "1" / "model.onnx" and second == repo / "2" / "model.onnx"
    config = yaml.safe_load((repo / "config.yaml").read_text())
    assert config["max_batch_size"] == 16
    assert config["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [16]}]
    assert config["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [4]}]
    assert config["onnxruntime"]["execution_providers"] == ["CPU"]
    from rtserve.config import load_yaml, parse_model_config

    parsed = parse_model_config(load_yaml(repo / "config.yaml"), "tiny", str(repo / "config.yaml"))
    assert parsed.max_batch_size == 16
    record = json.loads((repo / "optimization.json").read_text())
    assert record["chosen"] == result.chosen.name and record["version"] == 2
    ort.InferenceSession(str(second)).run(None, {"x": x_eval[:3]})


def test_unknown_variant_is_rejected(
    trained: tuple[pathlib.Path, object], tmp_path: pathlib.Path
) -> None:
    from rtserve.optimize.errors import OptimizeError

    path, _ = trained
    x, _ = _data(8, 3)
    with pytest.raises(OptimizeError, match="unknown variant.*int4"):
        run_optimize(path, tmp_path, None, {"x": x}, None, OptimizeOptions(variants=("int4",)))


def test_cli_optimize_writes_the_model_repository(
    trained: tuple[pathlib.Path, object], tmp_path: pathlib.Path
) -> None:
    path, _ = trained
    x_eval, y_eval = _data(64, 2)
    np.savez(tmp_path / "eval.npz", x=x_eval, labels=y_eval)
    np.save(tmp_path / "calib.npy", _data(32, 1)[0])
    out = tmp_path / "repo" / "tiny"
    proc = subprocess.run(
        [
            sys.executable, "-m", "rtserve.optimize.cli", "optimize", str(path),
            "--calibration", str(tmp_path / "calib.npy"), "--eval", str(tmp_path / "eval.npz"),
            "--max-accuracy-drop", "0.05", "--out", str(out), "--work", str(tmp_path / "work"),
            "--variants", "int8-dynamic,int8-static", "--calibration-methods", "minmax",
            "--iterations", "5", "--no-progress",
        ],
        capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "chose" in proc.stdout
    assert (out / "1" / "model.onnx").is_file() and (out / "config.yaml").is_file()
    assert (tmp_path / "work" / "report.png").is_file()


def test_cli_export_verifies_and_reports_the_difference(tmp_path: pathlib.Path) -> None:
    proc = subprocess.run(
        [
            sys.executable, "-m", "rtserve.optimize.cli", "export",
            "tests.test_optimize_helpers:tiny_mlp", "--out", str(tmp_path / "m.onnx"),
            "--input", "x:2x16:float32", "--output-name", "logits",
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "output logits: max abs diff vs torch" in proc.stdout
