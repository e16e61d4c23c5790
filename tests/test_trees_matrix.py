"""Tree models beyond the basic ones, checked against the framework's own predict: an
early-stopped XGBoost model (its best iteration, every execution), string class labels
(CatBoost, a pickled LGBMClassifier), CatBoost one-vs-all, XGBoost multi-target regression,
LightGBM linear trees (no contributions), a model without batching (``max_batch_size: 0``),
through one real server (JSON, binary, gRPC)."""

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

from sklearn.datasets import make_classification, make_regression  # noqa: E402
from sklearn.pipeline import make_pipeline  # noqa: E402
from sklearn.preprocessing import StandardScaler  # noqa: E402

from rtserve.errors import ConfigError, InvalidInput  # noqa: E402
from rtserve.runtime import trees  # noqa: E402
from tests.conftest import post_json, start_server  # noqa: E402
from tests.test_trees import TOL, config  # noqa: E402


def data(classes: int = 2, n: int = 300, features: int = 6) -> tuple[np.ndarray, np.ndarray]:
    x, y = make_classification(n, features, n_informative=4, n_classes=classes, random_state=0)
    x[::7, 1] = np.nan
    return x, y


def early_stopped(classes: int = 2) -> tuple[Any, np.ndarray]:
    x, y = data(classes)
    x = x.astype(np.float32)
    clf = xgb.XGBClassifier(n_estimators=200, max_depth=3, learning_rate=0.5,
                            early_stopping_rounds=3)  # fmt: skip
    clf.fit(x[:200], y[:200], eval_set=[(x[200:], y[200:])], verbose=False)
    assert clf.best_iteration + 1 < clf.get_booster().num_boosted_rounds()
    return clf, x


@pytest.mark.parametrize(("classes", "execution"), [(2, "native"), (2, "treelite"),
                                                    (3, "onnx"), (3, "auto")])  # fmt: skip
def test_xgboost_early_stopped_uses_its_best_iteration(
    tmp_path: Path, classes: int, execution: str
) -> None:
    clf, x = early_stopped(classes)
    clf.save_model(tmp_path / "model.json")
    model = trees.load(
        config("xgboost", execution=execution, outputs=["predict", "predict_proba", "margin"]),
        tmp_path,
    )
    best = (0, clf.best_iteration + 1)
    for rows in (x[:1], x[:7], x):
        out = model.run(0, {"features": rows, "contributions": np.ones(len(rows), np.float32)})
        np.testing.assert_allclose(out["predict_proba"], clf.predict_proba(rows), atol=TOL)
        np.testing.assert_array_equal(out["predict"], clf.predict(rows))
        np.testing.assert_allclose(out["margin"], clf.predict(rows, output_margin=True), atol=TOL)
        want = clf.get_booster().predict(
            xgb.DMatrix(rows), pred_contribs=True, iteration_range=best
        )
        np.testing.assert_allclose(out["contributions"], want, atol=TOL)


def test_sklearn_pipeline_with_an_early_stopped_xgboost(tmp_path: Path) -> None:
    clf, x = early_stopped(3)
    pipe = make_pipeline(StandardScaler(), clf)  # (fitted: the scaler on the same rows)
    pipe[0].fit(np.nan_to_num(x))
    sio.dump(pipe, tmp_path / "model.skops")
    trusted = sio.get_untrusted_types(file=str(tmp_path / "model.skops"))
    model = trees.load(config("sklearn", trusted_types=trusted), tmp_path)
    rows = np.nan_to_num(x[:20]).astype(np.float64)
    out = model.run(0, {"features": rows, "contributions": np.ones(len(rows), np.float32)})
    np.testing.assert_allclose(out["predict_proba"], pipe.predict_proba(rows), atol=TOL)
    np.testing.assert_array_equal(out["predict"], pipe.predict(rows))
    want = clf.get_booster().predict(xgb.DMatrix(pipe[0].transform(rows)), pred_contribs=True,
                                     iteration_range=(0, clf.best_iteration + 1))  # fmt: skip
    np.testing.assert_allclose(out["contributions"], want, atol=TOL)


def test_xgboost_gblinear_served(tmp_path: Path) -> None:
    x, y = data(3)
    x = np.nan_to_num(x).astype(np.float32)
    clf = xgb.XGBClassifier(n_estimators=10, booster="gblinear").fit(x, y)
    clf.save_model(tmp_path / "model.json")
    model = trees.load(config("xgboost", outputs=["predict", "predict_proba", "margin"]), tmp_path)
    assert model.execution == "native"  # (no trees to compile or convert)
    out = model.run(0, {"features": x[:7], "contributions": np.ones(7, np.float32)})
    np.testing.assert_allclose(out["predict_proba"], clf.predict_proba(x[:7]), atol=TOL)
    np.testing.assert_array_equal(out["predict"], clf.predict(x[:7]))
    np.testing.assert_allclose(out["margin"], clf.predict(x[:7], output_margin=True), atol=TOL)
    want = clf.get_booster().predict(xgb.DMatrix(x[:7]), pred_contribs=True)
    np.testing.assert_allclose(out["contributions"], want, atol=TOL)


@pytest.mark.parametrize("loss", ["MultiRMSE", "RMSEWithUncertainty"])
def test_catboost_several_values_per_row(tmp_path: Path, loss: str) -> None:
    x, y = make_regression(200, 5, n_targets=2, random_state=0)
    reg = cb.CatBoostRegressor(iterations=10, depth=3, verbose=0, loss_function=loss,
                               allow_writing_files=False)  # fmt: skip
    reg.fit(x, y if loss == "MultiRMSE" else y[:, 0])
    reg.save_model(str(tmp_path / "model.cbm"))
    model = trees.load(config("catboost", outputs=["predict", "margin"]), tmp_path)
    out = model.run(0, {"features": x[:7], "contributions": np.ones(7, np.float32)})
    for spec in model.outputs:  # (the metadata's shapes are the answers')
        assert out[spec.name].shape == (7, *spec.shape), spec
    assert out["predict"].shape == (7, 2)
    np.testing.assert_allclose(out["predict"], reg.predict(x[:7]), rtol=TOL, atol=TOL)


def test_sklearn_classifier_without_predict_proba(tmp_path: Path) -> None:
    from sklearn.linear_model import RidgeClassifier

    x, y = data(3)
    x = np.nan_to_num(x)
    clf = RidgeClassifier().fit(x, np.array(["a", "b", "c"])[y])
    sio.dump(clf, tmp_path / "model.skops")
    model = trees.load(config("sklearn"), tmp_path)  # (no made-up probabilities)
    assert [(o.name, o.datatype) for o in model.outputs] == [("predict", "BYTES")]
    np.testing.assert_array_equal(model.run(0, {"features": x[:7]})["predict"], clf.predict(x[:7]))
    with pytest.raises(ConfigError, match="predict_proba: the model has no predict_proba"):
        trees.load(config("sklearn", outputs=["predict", "predict_proba"]), tmp_path)


def test_a_row_of_the_wrong_width_is_refused_not_run(tmp_path: Path) -> None:
    clf, x = early_stopped()
    clf.save_model(tmp_path / "model.json")
    model = trees.load(config("xgboost", execution="native"), tmp_path)
    wide = np.zeros(
        (1, x.shape[1] * 3), np.float32
    )  # (XGBoost's contributions would corrupt memory)
    with pytest.raises(InvalidInput, match=r"input 'features': shape \[1, 18\].*\[-1, 6\]"):
        model.run(0, {"features": wide, "contributions": np.ones(1, np.float32)})


def test_truncated_ubj_refused_before_xgboost_reads_it(tmp_path: Path) -> None:
    x, y = data()
    xgb.XGBClassifier(n_estimators=10, max_depth=3).fit(x, y).save_model(tmp_path / "model.ubj")
    whole = (tmp_path / "model.ubj").read_bytes()
    assert trees._ubjson_problem(whole) == ""
    # (XGBoost reads lengths from wherever a cut leaves it: a huge allocation, or a crash)
    for cut in range(1, len(whole), len(whole) // 60):
        d = tmp_path / f"cut{cut}"
        d.mkdir()
        (d / "model.ubj").write_bytes(whole[:cut])
        with pytest.raises(ConfigError, match=rf"cut{cut}/model\.ubj: .*truncated"):
            trees.load(config("xgboost"), d)


def test_refusals_name_the_file_and_the_reason(tmp_path: Path) -> None:
    x, y = data()
    clf = xgb.XGBClassifier(n_estimators=5, max_depth=2).fit(x, y)
    (tmp_path / "model.pkl").write_bytes(pickle.dumps(clf)[:40])  # a damaged pickle
    with pytest.raises(ConfigError, match=r"model\.pkl: xgboost could not load the model: Unp"):
        trees.load(config("xgboost", allow_pickle=True), tmp_path)
    (tmp_path / "model.pkl").write_bytes(pickle.dumps(clf))
    with pytest.raises(
        ConfigError, match=r"treelite compiles the framework's own file.*model\.pkl"
    ):
        trees.load(config("xgboost", allow_pickle=True, execution="treelite"), tmp_path)
    (tmp_path / "model.pkl").unlink()
    clf.save_model(tmp_path / "model.json")
    with pytest.raises(ConfigError, match=r"execution: lleaves is for LightGBM models"):
        trees.load(config("xgboost", execution="lleaves"), tmp_path)
    with pytest.raises(ConfigError, match=r"datatype: BYTES is for CatBoost and scikit-learn"):
        trees.load(config("xgboost", datatype="BYTES"), tmp_path)
    text = lgb.LGBMClassifier(n_estimators=3, verbose=-1).fit(x, y).booster_.model_to_string()
    (tmp_path / "model.txt").write_bytes(text.replace("\n", "\r\n").encode())  # (aborts LightGBM)
    with pytest.raises(ConfigError, match=r"model\.txt: lightgbm could not .* CRLF"):
        trees.load(config("lightgbm"), tmp_path)


# -- through a real server ------------------------------------------------------------------


def _model(root: Path, name: str, file: str, config_yaml: str) -> Path:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.yaml").write_text(config_yaml)
    return root / name / "1" / file


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("matrix")
    repo = root / "repo"
    x, y = data(3)
    names = np.array(["no", "yes", "maybe"])[y]
    refs: dict[str, Any] = {"x": x}

    kw = {"iterations": 20, "depth": 3, "verbose": 0, "allow_writing_files": False}
    clf = cb.CatBoostClassifier(**kw).fit(x, names)
    clf.save_model(str(_model(repo, "cb_labels", "model.cbm", "backend: catboost\n")))
    refs["cb_labels"] = clf
    ova = cb.CatBoostClassifier(loss_function="MultiClassOneVsAll", **kw).fit(x, y)
    ova.save_model(str(_model(repo, "cb_ova", "model.cbm", "backend: catboost\n")))
    refs["cb_ova"] = ova

    import pandas as pd

    rng = np.random.default_rng(0)
    frame = pd.DataFrame({"colour": rng.choice(["red", "green", "blue"], 300),
                          "size": rng.normal(size=300)})  # fmt: skip
    frame.loc[::5, "size"] = np.nan
    text = cb.CatBoostClassifier(cat_features=["colour"], **kw)
    text.fit(frame, (frame["colour"] == "red").astype(int))
    text.save_model(str(_model(repo, "cb_text", "model.cbm",
                               "backend: catboost\ncatboost: {datatype: BYTES}\n")))  # fmt: skip
    refs["cb_text"], refs["frame"] = text, frame

    from sklearn.compose import ColumnTransformer
    from sklearn.impute import SimpleImputer
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import OneHotEncoder

    prep = ColumnTransformer([("c", OneHotEncoder(handle_unknown="ignore"), ["colour"]),
                              ("n", make_pipeline(SimpleImputer(), StandardScaler()), ["size"])])  # fmt: skip
    pipe = make_pipeline(prep, LogisticRegression())
    pipe.fit(frame, np.where(frame["colour"] == "red", "hot", "cold"))
    path = _model(repo, "sk_text", "model.skops", "")
    sio.dump(pipe, path)
    trusted = json.dumps(sio.get_untrusted_types(file=str(path)))
    (repo / "sk_text" / "config.yaml").write_text(
        f"backend: sklearn\nsklearn: {{datatype: BYTES, trusted_types: {trusted}}}\n"
    )
    refs["sk_text"] = pipe

    lg = lgb.LGBMClassifier(n_estimators=15, num_leaves=8, verbose=-1).fit(x, names)
    _model(repo, "lgb_pickle", "model.pkl",
           "backend: lightgbm\nlightgbm: {allow_pickle: true, execution: native}\n"
           ).write_bytes(pickle.dumps(lg))  # fmt: skip
    refs["lgb_pickle"] = lg

    xr, yr = make_regression(300, 6, random_state=1)
    xr[::5, 2] = np.nan
    linear = lgb.LGBMRegressor(n_estimators=15, linear_tree=True, verbose=-1).fit(xr, yr)
    linear.booster_.save_model(_model(repo, "lgb_linear", "model.txt",
                                      "backend: lightgbm\nlightgbm: {execution: native}\n"))  # fmt: skip
    refs["lgb_linear"], refs["xr"] = linear, xr

    x2, y2 = make_regression(300, 5, n_targets=2, random_state=2)
    multi = xgb.XGBRegressor(n_estimators=10, max_depth=3).fit(x2.astype(np.float32), y2)
    multi.save_model(_model(repo, "xgb_targets", "model.json", "backend: xgboost\n"))
    refs["xgb_targets"], refs["x2"] = multi, x2.astype(np.float32)

    whole = xgb.XGBClassifier(n_estimators=10, max_depth=3).fit(x.astype(np.float32), y)
    whole.save_model(_model(repo, "xgb_unbatched", "model.json",
                            "backend: xgboost\nmax_batch_size: 0\nxgboost: {execution: native}\n"))  # fmt: skip
    refs["xgb_unbatched"] = whole

    server = start_server(repo, root / "s")
    try:
        yield server, refs
    finally:
        server.stop()


def _meta(base: str, model: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{base}/v2/models/{model}", timeout=10) as r:
        doc: dict[str, Any] = json.loads(r.read())
    return doc


def _infer(base: str, model: str, x: np.ndarray, dtype: str = "FP64", **extra: Any) -> Any:
    body = {"inputs": [{"name": "features", "datatype": dtype, "shape": list(x.shape),
                        "data": x.ravel().tolist()}], **extra}  # fmt: skip
    status, doc = post_json(f"{base}/v2/models/{model}/infer", body)
    assert status == 200, doc
    return {o["name"]: o for o in doc["outputs"]}


def _outputs(meta: dict[str, Any]) -> dict[str, tuple[str, list[int]]]:
    return {o["name"]: (o["datatype"], o["shape"]) for o in meta["outputs"]}


def test_string_class_labels_served_as_bytes(served: Any) -> None:
    s, refs = served
    x = np.nan_to_num(refs["x"][:7])
    for name in ("cb_labels", "lgb_pickle"):
        assert _outputs(_meta(s.base, name))["predict"] == ("BYTES", [-1]), name
        ref = refs[name]
        got = _infer(s.base, name, x)
        assert got["predict"]["data"] == [str(v) for v in np.ravel(ref.predict(x))], name
        np.testing.assert_allclose(np.reshape(got["predict_proba"]["data"], (7, 3)),
                                   ref.predict_proba(x), atol=TOL)  # fmt: skip
    import tritonclient.grpc as tgrpc

    client = tgrpc.InferenceServerClient(s.grpc)
    rows = refs["x"][:5]  # (NaNs travel in binary tensors)
    inp = tgrpc.InferInput("features", list(rows.shape), "FP64")
    inp.set_data_from_numpy(rows)
    res = client.infer("cb_labels", [inp])
    assert res.as_numpy("predict").tolist() == [v.encode() for v in np.ravel(
        refs["cb_labels"].predict(rows))]  # fmt: skip


def test_catboost_one_vs_all_is_a_classifier(served: Any) -> None:
    s, refs = served
    assert _outputs(_meta(s.base, "cb_ova"))["predict_proba"] == ("FP64", [-1, 3])
    x = np.nan_to_num(refs["x"][:7])
    got = _infer(s.base, "cb_ova", x)
    ref = refs["cb_ova"]
    assert got["predict"]["data"] == np.ravel(ref.predict(x)).tolist()
    np.testing.assert_allclose(np.reshape(got["predict_proba"]["data"], (7, 3)),
                               ref.predict_proba(x), atol=TOL)  # fmt: skip


def test_xgboost_multi_target_regression_shapes(served: Any) -> None:
    s, refs = served
    outputs = _outputs(_meta(s.base, "xgb_targets"))
    assert outputs["predict"] == ("FP32", [-1, 2])
    assert outputs["contributions"] == ("FP64", [-1, 2, 6])
    x = refs["x2"][:7]
    got = _infer(s.base, "xgb_targets", x, "FP32", parameters={"contributions": True})
    assert got["predict"]["shape"] == [7, 2]
    np.testing.assert_allclose(np.reshape(got["predict"]["data"], (7, 2)),
                               refs["xgb_targets"].predict(x), rtol=TOL, atol=1e-4)  # fmt: skip
    assert got["contributions"]["shape"] == [7, 2, 6]


def test_lightgbm_linear_trees_offer_no_contributions(served: Any) -> None:
    s, refs = served
    assert set(_outputs(_meta(s.base, "lgb_linear"))) == {"predict"}
    x = np.nan_to_num(refs["xr"][:7])
    got = _infer(s.base, "lgb_linear", x)
    np.testing.assert_allclose(got["predict"]["data"], refs["lgb_linear"].predict(x),
                               rtol=TOL, atol=TOL)  # fmt: skip


def test_unbatched_model_answers_every_row(served: Any) -> None:
    s, refs = served
    meta = _meta(s.base, "xgb_unbatched")
    assert meta["inputs"][0]["shape"] == [-1, 6]
    ref = refs["xgb_unbatched"]
    x = np.nan_to_num(refs["x"]).astype(np.float32)
    for rows in (x[:1], x[:3]):
        got = _infer(s.base, "xgb_unbatched", rows, "FP32", parameters={"contributions": True})
        assert got["predict"]["shape"] == [len(rows)]
        assert got["predict"]["data"] == ref.predict(rows).tolist()
        np.testing.assert_allclose(np.reshape(got["predict_proba"]["data"], (len(rows), 3)),
                                   ref.predict_proba(rows), atol=TOL)  # fmt: skip
        assert got["contributions"]["shape"] == [len(rows), 3, 7]


def test_catboost_string_categories_sent_as_bytes(served: Any) -> None:
    s, refs = served
    meta = _meta(s.base, "cb_text")
    assert meta["inputs"] == [{"name": "features", "datatype": "BYTES", "shape": [-1, 2]}]
    frame, ref = refs["frame"][:7], refs["cb_text"]
    want = ref.predict_proba(frame)
    assert want[:, 1].max() - want[:, 1].min() > 0.5  # (the colour decides)
    sizes = ["" if np.isnan(v) else str(float(v)) for v in frame["size"]]  # (empty: missing)
    rows = [[c, v] for c, v in zip(frame["colour"], sizes, strict=True)]
    got = _infer(s.base, "cb_text", np.array(rows, dtype=object), "BYTES")
    np.testing.assert_allclose(np.reshape(got["predict_proba"]["data"], (7, 2)), want, atol=TOL)
    status, doc = post_json(f"{s.base}/v2/models/cb_text/infer", {"inputs": [
        {"name": "features", "datatype": "BYTES", "shape": [1, 2], "data": ["red", "big"]}]})  # fmt: skip
    assert status == 400 and "feature 1 is numeric" in doc["error"], doc
    import tritonclient.http as thttp

    client = thttp.InferenceServerClient(s.http)
    inp = thttp.InferInput("features", [7, 2], "BYTES")
    inp.set_data_from_numpy(np.array(rows, dtype=object), binary_data=True)
    res = client.infer("cb_text", [inp])
    np.testing.assert_allclose(res.as_numpy("predict_proba"), want, atol=TOL)


def test_sklearn_string_columns_sent_as_bytes(served: Any) -> None:
    s, refs = served
    assert _meta(s.base, "sk_text")["inputs"][0]["datatype"] == "BYTES"
    frame, pipe = refs["frame"][:7], refs["sk_text"]
    sizes = ["" if np.isnan(v) else str(float(v)) for v in frame["size"]]
    rows = np.array([[c, v] for c, v in zip(frame["colour"], sizes, strict=True)], dtype=object)
    got = _infer(s.base, "sk_text", rows, "BYTES")
    assert got["predict"]["data"] == pipe.predict(frame).tolist()
    np.testing.assert_allclose(np.reshape(got["predict_proba"]["data"], (7, 2)),
                               pipe.predict_proba(frame), atol=TOL)  # fmt: skip
