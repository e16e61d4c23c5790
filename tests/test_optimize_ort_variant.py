"""``rtserve optimize --variants ...,ort``: the ORT format of the baseline and of the INT8
variants within the budget, measured like the others, published as ``model.ort`` and served."""

from __future__ import annotations

import json
import pathlib
import urllib.request

import numpy as np
import pytest
import yaml

from rtserve.optimize.distill import train_supervised
from rtserve.optimize.evaluate import open_session
from rtserve.optimize.pipeline import DEFAULT_VARIANTS, OptimizeOptions, run_optimize
from rtserve.optimize.publish import publish
from tests.conftest import start_server
from tests.test_optimize_helpers import mlp_onnx, tiny_mlp
from tests.test_optimize_pipeline import FAST, _data


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    x, y = _data(300, 0)
    model = tiny_mlp(hidden=64)
    train_supervised(model, x, y, epochs=15, lr=3e-3)
    return mlp_onnx(tmp_path_factory.mktemp("m") / "model.onnx", model)


def test_ort_is_asked_for_by_name() -> None:
    assert "ort" not in DEFAULT_VARIANTS and "ort" not in OptimizeOptions().variants


def test_ort_variants_are_measured_published_and_served(
    model_path: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    x_cal, _ = _data(64, 1)
    x_eval, y_eval = _data(128, 2)
    options = OptimizeOptions(
        max_accuracy_drop=0.05, variants=("int8-static", "ort"),
        calibration_methods=("minmax",), **FAST,  # type: ignore[arg-type]
    )  # fmt: skip
    result = run_optimize(
        model_path, tmp_path / "work", {"x": x_cal}, {"x": x_eval}, y_eval, options
    )
    by_name = {m.name: m for m in result.measurements}
    assert {"ort-fp32", "ort-int8-static-minmax"} <= set(by_name)
    for name in ("fp32", "int8-static-minmax"):
        ort_m, onnx_m = by_name[f"ort-{name}"], by_name[name]
        assert ort_m.path.endswith(".ort") and pathlib.Path(ort_m.path).is_file()
        assert abs(ort_m.score - onnx_m.score) <= 0.01
        assert ort_m.p50_ms > 0 and set(ort_m.throughput) == {1, 8}
    assert (tmp_path / "work" / "ort" / "required_operators.config").is_file()

    # Published as model.ort with its signature read from a session, then served.
    repo = tmp_path / "repo"
    dst = publish(repo / "tiny", by_name["ort-fp32"], result.measurements, 0.05, max_batch_size=8)
    assert dst == repo / "tiny" / "1" / "model.ort"
    config = yaml.safe_load((repo / "tiny" / "config.yaml").read_text())
    assert config["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [16]}]
    expected = open_session(model_path, threads=1).run(None, {"x": x_eval[:3]})[0]
    server = start_server(repo, tmp_path / "s")
    try:
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [3, 16],
                            "data": x_eval[:3].ravel().tolist()}]}  # fmt: skip
        req = urllib.request.Request(
            f"{server.base}/v2/models/tiny/infer", json.dumps(body).encode(),
            {"content-type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=30) as resp:
            out = json.loads(resp.read())["outputs"][0]
        got = np.array(out["data"], np.float32).reshape(out["shape"])
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    finally:
        server.stop()
