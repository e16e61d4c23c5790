"""One-row requests to tree models: LightGBM's single-row C API answers exactly as
``Booster.predict``; through a real server, JSON and binary one-row requests are answered
right, and with direct runs on a cheap model runs them on arrival."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

lgb = pytest.importorskip("lightgbm")
xgb = pytest.importorskip("xgboost")

from sklearn.datasets import make_classification, make_regression  # noqa: E402

from rtserve.config import parse_model_config  # noqa: E402
from rtserve.runtime import trees  # noqa: E402
from tests.conftest import post_json, start_server  # noqa: E402


def config(backend: str, **options: Any) -> Any:
    return parse_model_config({"backend": backend, backend: options}, "m", "m/config.yaml")


def rows(n: int = 60, features: int = 8, classes: int = 2) -> tuple[np.ndarray, np.ndarray]:
    x, y = make_classification(n * 5, features, n_informative=5, n_classes=classes, random_state=1)
    x[::5, 1] = np.nan
    return x, y


@pytest.mark.parametrize("kind", ["binary", "multiclass", "regression"])
def test_lightgbm_one_row_equals_booster_predict_exactly(tmp_path: Path, kind: str) -> None:
    x, y = rows(classes=3 if kind == "multiclass" else 2)
    if kind == "regression":
        xr, yr = make_regression(300, 8, random_state=1)
        xr[::5, 1] = np.nan
        model = lgb.LGBMRegressor(n_estimators=30, verbose=-1).fit(xr, yr)
        x = xr
    else:
        model = lgb.LGBMClassifier(n_estimators=30, verbose=-1).fit(x, y)
    booster = model.booster_
    booster.save_model(tmp_path / "model.txt")
    outputs = ["predict", "margin"] if kind == "regression" else ["predict_proba", "margin"]
    m = trees.load(config("lightgbm", execution="native", outputs=outputs), tmp_path)
    # The single-row path is the one in use (not Booster.predict's Python per call).
    assert "_lightgbm_one_row" in m.adapter.value.__qualname__
    assert "_lightgbm_one_row" in m.adapter.margin.__qualname__
    for r in x[:40]:
        one = r[None, :]
        got = m.run(0, {"features": one})
        want = booster.predict(one, num_threads=1)
        raw = booster.predict(one, raw_score=True, num_threads=1)
        if kind == "regression":
            assert np.array_equal(got["predict"], want)
        elif kind == "binary":
            assert np.array_equal(got["predict_proba"][:, 1], want)
            assert np.array_equal(got["predict_proba"][:, 0], 1 - want)
        else:
            assert np.array_equal(got["predict_proba"], want)
        assert np.array_equal(got["margin"], raw)
    many = m.run(0, {"features": x[:50]})  # several rows: Booster.predict as before
    name = "predict" if kind == "regression" else "predict_proba"
    want = booster.predict(x[:50], num_threads=1)
    assert np.array_equal(many[name] if kind != "binary" else many[name][:, 1], want)


def _repo(root: Path) -> tuple[Any, Any, np.ndarray]:
    x, y = rows()
    x32 = x.astype(np.float32)
    clf = xgb.XGBClassifier(n_estimators=20, max_depth=4).fit(x32, y)
    (root / "fraud" / "1").mkdir(parents=True)
    clf.save_model(root / "fraud" / "1" / "model.json")
    (root / "fraud" / "config.yaml").write_text(
        "backend: xgboost\nxgboost: {execution: native, outputs: [predict_proba]}\n"
    )
    lg = lgb.LGBMClassifier(n_estimators=20, verbose=-1).fit(x, y)
    (root / "risk" / "1").mkdir(parents=True)
    lg.booster_.save_model(root / "risk" / "1" / "model.txt")
    (root / "risk" / "config.yaml").write_text(
        "backend: lightgbm\nlightgbm: {execution: native, outputs: [predict_proba]}\n"
    )
    return clf, lg.booster_, x


def _one(base: str, model: str, row: np.ndarray) -> np.ndarray:
    body = {"inputs": [{"name": "features", "datatype": "FP32" if model == "fraud" else "FP64",
                        "shape": [1, row.size], "data": row.tolist()}]}  # fmt: skip
    status, doc = post_json(f"{base}/v2/models/{model}/infer", body)
    assert status == 200, doc
    return np.array(doc["outputs"][0]["data"]).reshape(1, 2)


def _stats(base: str, model: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{base}/v2/models/{model}/stats", timeout=10) as r:
        doc: dict[str, Any] = json.loads(r.read())["model_stats"][0]
    return doc


def test_one_row_requests_through_the_server_json_binary_and_concurrent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clf, booster, x = _repo(tmp_path / "repo")
    x = np.nan_to_num(x)  # (JSON has no NaN)
    monkeypatch.setenv("RTSERVE_DIRECT_MAX_US", "200")  # direct runs on (off by default)
    s = start_server(tmp_path / "repo", tmp_path / "s")
    try:
        for i in range(30):  # sequential one-row requests (a closed loop of one client)
            row = x[i]
            np.testing.assert_allclose(
                _one(s.base, "fraud", row.astype(np.float32)),
                clf.predict_proba(row[None, :].astype(np.float32)), atol=1e-6,
            )  # fmt: skip
            got = _one(s.base, "risk", row)
            assert np.array_equal(got[:, 1], booster.predict(row[None, :], num_threads=1))
        # Cheap models on an idle batcher run the request on arrival (the log says so).
        assert "model risk:1: one-row batches take" in s.log(), s.log()
        assert "now run directly on arrival" in s.log()

        import tritonclient.http as thttp

        client = thttp.InferenceServerClient(s.http)
        for i in range(5):  # binary tensors, one row
            inp = thttp.InferInput("features", [1, x.shape[1]], "FP64")
            inp.set_data_from_numpy(x[i : i + 1], binary_data=True)
            res = client.infer("risk", [inp])
            assert np.array_equal(
                res.as_numpy("predict_proba")[:, 1], booster.predict(x[i : i + 1], num_threads=1)
            )

        # Many clients at once: every answer right, every request counted once (that
        # concurrent requests still batch is shown without timing in test_batcher_direct).
        before = _stats(s.base, "risk")

        def ask(i: int) -> bool:
            got = _one(s.base, "risk", x[i % len(x)])
            return bool(np.array_equal(got[:, 1], booster.predict(x[i % len(x)][None, :],
                                                                  num_threads=1)))  # fmt: skip

        with ThreadPoolExecutor(16) as pool:
            assert all(pool.map(ask, range(400)))
        after = _stats(s.base, "risk")
        requests = after["inference_count"] - before["inference_count"]
        assert requests == 400
    finally:
        s.stop()
