"""Tree and scikit-learn models from their own files (backend: xgboost, lightgbm, catboost,
sklearn): answers and contributions equal the framework's own, every execution choice, the
refusals (pickles, damaged files, untrusted skops types), and a real server on 127.0.0.1."""

from __future__ import annotations

import json
import pickle
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

xgb = pytest.importorskip("xgboost")
lgb = pytest.importorskip("lightgbm")
cb = pytest.importorskip("catboost")
sio = pytest.importorskip("skops.io")

from sklearn.compose import ColumnTransformer  # noqa: E402
from sklearn.datasets import load_breast_cancer, make_classification, make_regression  # noqa: E402
from sklearn.impute import SimpleImputer  # noqa: E402
from sklearn.pipeline import make_pipeline  # noqa: E402
from sklearn.preprocessing import OneHotEncoder, StandardScaler  # noqa: E402

from rtserve.config import parse_model_config  # noqa: E402
from rtserve.errors import ConfigError, InvalidInput  # noqa: E402
from rtserve.runtime import trees  # noqa: E402
from tests.conftest import post_json, start_server  # noqa: E402

TOL = 1e-6


def config(backend: str, **options: Any) -> Any:
    data: dict[str, Any] = {"backend": backend}
    if options:
        data[backend] = options
    return parse_model_config(data, "m", "m/config.yaml")


def classification(
    classes: int = 2, n: int = 400, features: int = 8
) -> tuple[np.ndarray, np.ndarray]:
    x, y = make_classification(n, features, n_informative=5, n_classes=classes, random_state=0)
    x = x.astype(np.float32)
    x[::7, 2] = np.nan  # missing values, routed as the framework routes them
    return x, y


def run(model: Any, x: np.ndarray, contributions: bool = True) -> dict[str, np.ndarray]:
    feeds = {"features": x.astype(model.dtype)}
    if contributions:
        feeds["contributions"] = np.ones(len(x), np.float32)
    return model.run(0, feeds)


@pytest.mark.parametrize("execution", ["native", "treelite", "onnx", "auto"])
def test_xgboost_binary_every_execution(tmp_path: Path, execution: str) -> None:
    x, y = classification()
    clf = xgb.XGBClassifier(n_estimators=30, max_depth=4).fit(x, y)
    clf.save_model(tmp_path / "model.json")
    model = trees.load(config("xgboost", execution=execution), tmp_path)
    if execution != "auto":
        assert model.execution == execution and model.platform == f"xgboost_{execution}"
    for rows in (x[:1], x[:3], x[:100]):  # one row and a batch take different engines
        out = run(model, rows)
        np.testing.assert_allclose(out["predict_proba"], clf.predict_proba(rows), atol=TOL)
        np.testing.assert_array_equal(out["predict"], clf.predict(rows))
    contribs = clf.get_booster().predict(xgb.DMatrix(x[:100]), pred_contribs=True)
    np.testing.assert_allclose(out["contributions"], contribs, atol=TOL)
    top = np.argsort(-np.abs(contribs[0, :-1]), kind="stable")[:5]
    assert [r.decode().split(":")[0] for r in out["reasons"][0]] == [f"f{i}" for i in top]


def test_xgboost_ubj_multiclass_and_margin(tmp_path: Path) -> None:
    x, y = classification(classes=3)
    clf = xgb.XGBClassifier(n_estimators=20, max_depth=3).fit(x, y)
    clf.save_model(tmp_path / "model.ubj")
    model = trees.load(config("xgboost", outputs=["predict", "predict_proba", "margin"]), tmp_path)
    out = run(model, x)
    np.testing.assert_allclose(out["predict_proba"], clf.predict_proba(x), atol=TOL)
    np.testing.assert_array_equal(out["predict"], clf.predict(x))
    np.testing.assert_allclose(out["margin"], clf.predict(x, output_margin=True), atol=TOL)
    contribs = clf.get_booster().predict(xgb.DMatrix(x), pred_contribs=True)
    assert out["contributions"].shape == (len(x), 3, 9)
    np.testing.assert_allclose(out["contributions"], contribs, atol=TOL)
    assert model.labels["contributions"][-1] == "bias"


def test_xgboost_regression_breast_cancer_feature_names(tmp_path: Path) -> None:
    data = load_breast_cancer()
    x = data.data.astype(np.float32)
    names = [n.replace(" ", "_") for n in data.feature_names]
    booster = xgb.train(
        {"objective": "reg:squarederror", "max_depth": 4},
        xgb.DMatrix(x, data.target, feature_names=names),
        25,
    )
    booster.save_model(tmp_path / "model.json")
    model = trees.load(config("xgboost"), tmp_path)
    assert [s.name for s in model.outputs] == ["predict", "contributions", "reasons"]
    assert model.inputs[0].shape == (30,)
    out = run(model, x[:40])
    want = booster.predict(xgb.DMatrix(x[:40], feature_names=names))
    np.testing.assert_allclose(out["predict"], want, atol=TOL)
    assert out["reasons"][0][0].decode().split(":")[0] in names


def test_lightgbm_multiclass_with_a_categorical_feature(tmp_path: Path) -> None:
    x, y = classification(classes=3, n=600)
    x = x.astype(np.float64)
    x[:, 0] = np.abs(np.round(x[:, 0] * 2)) % 5  # a categorical column: codes 0..4
    clf = lgb.LGBMClassifier(n_estimators=30, num_leaves=15, verbose=-1)
    clf.fit(x, y, categorical_feature=[0])
    clf.booster_.save_model(tmp_path / "model.txt")
    for execution in ("auto", "native"):
        model = trees.load(config("lightgbm", execution=execution), tmp_path)
        out = run(model, x)
        np.testing.assert_allclose(out["predict_proba"], clf.predict_proba(x), atol=TOL)
        np.testing.assert_array_equal(out["predict"], clf.predict(x))
    # Compiled, a categorical split routes values outside the codes (negative, fractional)
    # unlike LightGBM: checked at load, such an execution is refused rather than served.
    with pytest.raises(ConfigError, match="treelite gives answers that differ from lightgbm"):
        trees.load(config("lightgbm", execution="treelite"), tmp_path)
    contribs = clf.predict(x, pred_contrib=True).reshape(len(x), 3, -1)
    np.testing.assert_allclose(out["contributions"], contribs, atol=TOL)


def test_lightgbm_regression(tmp_path: Path) -> None:
    x, y = make_regression(400, 6, random_state=1)
    x[::5, 1] = np.nan
    reg = lgb.LGBMRegressor(n_estimators=25, verbose=-1).fit(x, y)
    reg.booster_.save_model(tmp_path / "model.txt")
    model = trees.load(config("lightgbm"), tmp_path)
    out = run(model, x)
    np.testing.assert_allclose(out["predict"], reg.predict(x), rtol=TOL, atol=TOL)
    np.testing.assert_allclose(out["contributions"], reg.predict(x, pred_contrib=True), atol=TOL)


def test_catboost_binary_with_a_categorical_feature(tmp_path: Path) -> None:
    x, y = classification(n=300)
    x = x.astype(np.float64)
    x = np.nan_to_num(x)
    x[:, 1] = np.abs(np.round(x[:, 1])) % 4
    import pandas as pd

    frame = pd.DataFrame(x, columns=[f"c{i}" for i in range(8)])
    frame["c1"] = frame["c1"].astype(int)
    clf = cb.CatBoostClassifier(
        iterations=30, depth=4, verbose=0, cat_features=[1], allow_writing_files=False
    )
    clf.fit(frame, y)
    clf.save_model(str(tmp_path / "model.cbm"))
    model = trees.load(config("catboost"), tmp_path)
    out = run(model, x)
    np.testing.assert_allclose(out["predict_proba"], clf.predict_proba(frame), atol=TOL)
    np.testing.assert_array_equal(out["predict"], clf.predict(frame).ravel())
    shap = clf.get_feature_importance(cb.Pool(frame, cat_features=[1]), type="ShapValues")
    np.testing.assert_allclose(out["contributions"], shap, atol=TOL)
    assert model.labels["contributions"][:2] == ("c0", "c1")
    bad = x[:1].copy()
    bad[0, 1] = np.nan
    with pytest.raises(InvalidInput, match="categorical"):
        run(model, bad)


def test_catboost_regression_with_nan(tmp_path: Path) -> None:
    x, y = make_regression(300, 5, random_state=2)
    x[::4, 0] = np.nan
    reg = cb.CatBoostRegressor(iterations=30, depth=4, verbose=0, allow_writing_files=False).fit(
        x, y
    )
    reg.save_model(str(tmp_path / "model.cbm"))
    model = trees.load(config("catboost"), tmp_path)
    np.testing.assert_allclose(run(model, x, False)["predict"], reg.predict(x), rtol=TOL, atol=TOL)


def _pipeline() -> tuple[Any, np.ndarray, np.ndarray]:
    """Imputation and scaling of numeric columns, one-hot of a coded one, then XGBoost."""
    x, y = classification(n=300)
    x = x.astype(np.float64)
    x[:, 7] = np.abs(np.round(x[:, 7])) % 3
    prep = ColumnTransformer(
        [
            ("num", make_pipeline(SimpleImputer(), StandardScaler()), list(range(7))),
            ("cat", OneHotEncoder(handle_unknown="ignore"), [7]),
        ]
    )
    pipe = make_pipeline(prep, xgb.XGBClassifier(n_estimators=20, max_depth=3)).fit(x, y)
    return pipe, x, y


def test_sklearn_pipeline_from_skops_with_contributions(tmp_path: Path) -> None:
    pipe, x, _ = _pipeline()
    sio.dump(pipe, tmp_path / "model.skops")
    untrusted = sio.get_untrusted_types(file=str(tmp_path / "model.skops"))
    with pytest.raises(ConfigError, match="xgboost.sklearn.XGBClassifier.*trusted_types"):
        trees.load(config("sklearn"), tmp_path)
    model = trees.load(config("sklearn", trusted_types=untrusted), tmp_path)
    out = run(model, x)
    np.testing.assert_allclose(out["predict_proba"], pipe.predict_proba(x), atol=TOL)
    np.testing.assert_array_equal(out["predict"], pipe.predict(x))
    inner = pipe[-1].get_booster().predict(xgb.DMatrix(pipe[:-1].transform(x)), pred_contribs=True)
    np.testing.assert_allclose(out["contributions"], inner, atol=TOL)
    assert "num__x0" in model.labels["contributions"]


def test_pickle_refused_without_the_flag(tmp_path: Path) -> None:
    x, y = classification()
    clf = xgb.XGBClassifier(n_estimators=5, max_depth=2).fit(x, y)
    (tmp_path / "model.pkl").write_bytes(pickle.dumps(clf))
    with pytest.raises(ConfigError, match=r"model\.pkl: a pickle runs code.*allow_pickle"):
        trees.load(config("xgboost"), tmp_path)
    model = trees.load(config("xgboost", allow_pickle=True), tmp_path)
    np.testing.assert_allclose(run(model, x)["predict_proba"], clf.predict_proba(x), atol=TOL)


@pytest.mark.parametrize(
    ("backend", "name"),
    [("xgboost", "model.json"), ("xgboost", "model.ubj"), ("lightgbm", "model.txt"),
     ("catboost", "model.cbm"), ("sklearn", "model.skops")],
)  # fmt: skip
def test_damaged_model_file_refused_naming_it(tmp_path: Path, backend: str, name: str) -> None:
    x, y = classification()
    src = tmp_path / "src"
    src.mkdir()
    if backend == "xgboost":
        xgb.XGBClassifier(n_estimators=5).fit(x, y).save_model(src / name)
    elif backend == "lightgbm":
        lgb.LGBMClassifier(n_estimators=5, verbose=-1).fit(x, y).booster_.save_model(src / name)
    elif backend == "catboost":
        cb.CatBoostClassifier(iterations=5, verbose=0, allow_writing_files=False).fit(
            x, y
        ).save_model(str(src / name))
    else:
        sio.dump(make_pipeline(SimpleImputer(), StandardScaler()).fit(x), src / name)
    data = (src / name).read_bytes()
    for i, broken in enumerate((data[: len(data) // 2], b"\x00garbage" * 10)):
        d = tmp_path / f"v{i}"
        d.mkdir()
        (d / name).write_bytes(broken)
        with pytest.raises(ConfigError, match=str(d / name).replace(".", r"\.")):
            trees.load(config(backend), d)


def test_missing_file_names_what_the_backend_reads(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"")
    with pytest.raises(ConfigError, match="backend lightgbm reads model.txt.*model.onnx"):
        trees.load(config("lightgbm"), tmp_path)


def test_options_checked() -> None:
    with pytest.raises(ConfigError, match="xgboost.execution: expected one of auto"):
        trees.parse_options(config("xgboost", execution="fast"))
    with pytest.raises(ConfigError, match="xgboost.allow_pickle: expected true or false"):
        trees.parse_options(config("xgboost", allow_pickle="yes"))
    with pytest.raises(ConfigError, match="xgboost.outputs: expected a list"):
        trees.parse_options(config("xgboost", outputs=["probability"]))


# -- through a real server ------------------------------------------------------------------


def _repo(root: Path) -> tuple[Any, Any, np.ndarray]:
    x, y = classification(n=300)
    clf = xgb.XGBClassifier(n_estimators=20, max_depth=4).fit(x, y)
    (root / "fraud" / "1").mkdir(parents=True)
    clf.save_model(root / "fraud" / "1" / "model.json")
    (root / "fraud" / "config.yaml").write_text("backend: xgboost\n")
    reg = lgb.LGBMRegressor(n_estimators=10, verbose=-1).fit(x, y)
    (root / "risk" / "1").mkdir(parents=True)
    reg.booster_.save_model(root / "risk" / "1" / "model.txt")
    (root / "risk" / "config.yaml").write_text("backend: lightgbm\n")
    return clf, reg, x


def _infer(base: str, model: str, x: np.ndarray, **extra: Any) -> tuple[int, Any]:
    body = {
        "inputs": [
            {
                "name": "features",
                "datatype": "FP32" if model == "fraud" else "FP64",
                "shape": list(x.shape),
                "data": np.where(np.isnan(x), None, x).ravel().tolist(),
            }
        ],
        **extra,
    }
    return post_json(f"{base}/v2/models/{model}/infer", body)


def test_served_over_http_and_tritonclient(tmp_path: Path) -> None:
    clf, reg, x = _repo(tmp_path / "repo")
    s = start_server(tmp_path / "repo", tmp_path / "s", "--model-control-mode", "explicit",
                     "--load-model", "fraud", "--load-model", "risk")  # fmt: skip
    try:
        x3 = np.nan_to_num(x[:3])  # (JSON has no NaN)
        status, doc = _infer(s.base, "fraud", x3)
        assert status == 200, doc
        got = {o["name"]: o for o in doc["outputs"]}
        assert set(got) == {"predict", "predict_proba"}  # contributions only on request
        np.testing.assert_allclose(
            np.array(got["predict_proba"]["data"]).reshape(3, 2), clf.predict_proba(x3), atol=TOL
        )
        status, doc = _infer(s.base, "fraud", x3, parameters={"contributions": True})
        got = {o["name"]: o for o in doc["outputs"]}
        assert got["reasons"]["shape"] == [3, 5]
        contribs = clf.get_booster().predict(xgb.DMatrix(x3), pred_contribs=True)
        np.testing.assert_allclose(
            np.array(got["contributions"]["data"]).reshape(3, 9), contribs, atol=TOL
        )
        status, doc = _infer(s.base, "fraud", x3, outputs=[{"name": "reasons"}])
        assert [o["name"] for o in doc["outputs"]] == ["reasons"] and status == 200
        status, doc = _infer(s.base, "fraud", x3[:, :5])
        assert status == 400
        assert "input 'features'" in doc["error"] and "[-1, 8]" in doc["error"], doc
        with urllib.request.urlopen(f"{s.base}/v2/models/fraud", timeout=10) as r:
            meta = json.loads(r.read())
        assert meta["platform"].startswith("xgboost_")
        assert meta["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [-1, 8]}]

        import tritonclient.http as thttp

        client = thttp.InferenceServerClient(s.http)
        xin = x[:64].astype(np.float64)  # NaNs travel in binary tensors
        inp = thttp.InferInput("features", list(xin.shape), "FP64")
        inp.set_data_from_numpy(xin)
        res = client.infer("risk", [inp])
        np.testing.assert_allclose(res.as_numpy("predict"), reg.predict(xin), rtol=TOL, atol=TOL)

        # The load body cannot allow a pickle (nor set any tree backend option).
        status, doc = post_json(
            f"{s.base}/v2/repository/models/fraud/load",
            {"parameters": {"config": {"xgboost": {"allow_pickle": True}}}},
        )
        assert status == 400 and "xgboost: not settable over the network" in doc["error"], doc
    finally:
        s.stop()


def test_treelite_library_cached_beside_the_model_by_its_hash(tmp_path: Path) -> None:
    x, y = classification()
    xgb.XGBClassifier(n_estimators=5, max_depth=3).fit(x, y).save_model(tmp_path / "model.json")
    trees.load(config("xgboost", execution="treelite"), tmp_path)
    (lib,) = (tmp_path / ".rtserve-compiled").glob("*.so")
    built = lib.stat().st_mtime_ns
    trees.load(config("xgboost", execution="treelite"), tmp_path)  # reused, not rebuilt
    assert lib.stat().st_mtime_ns == built
    xgb.XGBClassifier(n_estimators=6, max_depth=3).fit(x, y).save_model(tmp_path / "model.json")
    model = trees.load(config("xgboost", execution="treelite"), tmp_path)
    assert len(list((tmp_path / ".rtserve-compiled").glob("*.so"))) == 2  # a new model: rebuilt
    assert model.execution == "treelite"


def test_scaler_then_xgboost_runs_fused_with_the_same_answers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    x, y = classification(classes=3, n=300)
    x = np.nan_to_num(x).astype(np.float64) * 50 + 7
    pipe = make_pipeline(StandardScaler(), xgb.XGBClassifier(n_estimators=15, max_depth=3))
    pipe.fit(x, y)
    sio.dump(pipe, tmp_path / "model.skops")
    trusted = sio.get_untrusted_types(file=str(tmp_path / "model.skops"))
    with caplog.at_level("INFO", logger="rtserve.runtime.trees"):
        model = trees.load(config("sklearn", trusted_types=trusted), tmp_path)
    assert "run fused" in caplog.text
    for rows in (x[:1], x):
        out = run(model, rows)
        np.testing.assert_array_equal(out["predict_proba"], pipe.predict_proba(rows))
        np.testing.assert_array_equal(out["predict"], pipe.predict(rows))
    inner = pipe[-1].get_booster().predict(xgb.DMatrix(pipe[:-1].transform(x)), pred_contribs=True)
    np.testing.assert_allclose(out["contributions"], inner, atol=TOL)
