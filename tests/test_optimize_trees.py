"""``rtserve optimize-trees`` and lleaves at load: real XGBoost / LightGBM models trained on
data scikit-learn ships, every execution choice measured against the framework's predict,
float32 features caught where LightGBM compares in float64, and the written variant served
as written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

xgb = pytest.importorskip("xgboost")
lgb = pytest.importorskip("lightgbm")
pytest.importorskip("treelite")
pytest.importorskip("onnxmltools")

from sklearn.datasets import load_breast_cancer, load_diabetes, load_iris  # noqa: E402

from rtserve.config import parse_model_config  # noqa: E402
from rtserve.optimize.cli import main as cli_main  # noqa: E402
from rtserve.runtime import trees  # noqa: E402

FAST = ["--rounds", "2", "--iterations", "20", "--batch", "64"]


def _lleaves() -> bool:
    try:
        import lleaves  # noqa: F401
        from llvmlite import binding

        return hasattr(binding, "PassManagerBuilder")
    except ImportError:
        return False


needs_lleaves = pytest.mark.skipif(not _lleaves(), reason="lleaves with a usable llvmlite")


def _config(backend: str, **options: Any) -> Any:
    return parse_model_config({"backend": backend, backend: options}, "m", "m/config.yaml")


def _cancer_lightgbm(folder: Path) -> tuple[Any, np.ndarray]:
    x, y = load_breast_cancer(return_X_y=True)
    x = x.copy()
    x[::9, 3] = np.nan
    clf = lgb.LGBMClassifier(n_estimators=40, num_leaves=15, verbose=-1).fit(x, y)
    folder.mkdir(parents=True, exist_ok=True)
    clf.booster_.save_model(folder / "model.txt")
    return clf, x


@needs_lleaves
def test_lleaves_execution_equals_lightgbm_binary_multiclass_regression(tmp_path: Path) -> None:
    cancer, xc = _cancer_lightgbm(tmp_path / "binary")
    xi, yi = load_iris(return_X_y=True)
    iris = lgb.LGBMClassifier(n_estimators=20, num_leaves=7, verbose=-1).fit(xi, yi)
    iris.booster_.save_model(tmp_path / "multi.txt")
    (tmp_path / "multi").mkdir()
    (tmp_path / "multi.txt").rename(tmp_path / "multi" / "model.txt")
    xd, yd = load_diabetes(return_X_y=True)
    xd = xd.copy()
    xd[::5, 2] = np.nan
    reg = lgb.LGBMRegressor(n_estimators=30, verbose=-1).fit(xd, yd)
    (tmp_path / "reg").mkdir()
    reg.booster_.save_model(tmp_path / "reg" / "model.txt")
    cases = [("binary", cancer, xc), ("multi", iris, xi), ("reg", reg, xd)]
    for folder, est, x in cases:
        model = trees.load(_config("lightgbm", execution="lleaves"), tmp_path / folder)
        assert model.execution == "lleaves" and model.platform == "lightgbm_lleaves"
        for rows in (x[:1], x[:100]):
            out = model.run(0, {"features": rows})
            if folder == "reg":
                np.testing.assert_allclose(out["predict"], est.predict(rows), rtol=1e-9, atol=1e-9)
            else:
                np.testing.assert_allclose(out["predict_proba"], est.predict_proba(rows), atol=1e-9)
                np.testing.assert_array_equal(out["predict"], est.predict(rows))
    # cached beside the model by its hash: a second load compiles nothing
    cache = tmp_path / "binary" / ".rtserve-compiled"
    libs = sorted(cache.glob("lightgbm-*-ll*.so"))
    assert len(libs) == 1
    stamp = libs[0].stat().st_mtime_ns
    trees.load(_config("lightgbm", execution="lleaves"), tmp_path / "binary")
    assert libs[0].stat().st_mtime_ns == stamp


@needs_lleaves
def test_lleaves_refused_for_xgboost_naming_the_field(tmp_path: Path) -> None:
    x, y = load_breast_cancer(return_X_y=True)
    xgb.XGBClassifier(n_estimators=5, max_depth=2).fit(x, y).save_model(tmp_path / "model.json")
    with pytest.raises(Exception, match=r"xgboost\.execution: lleaves"):
        trees.load(_config("xgboost", execution="lleaves"), tmp_path)


def test_optimize_lightgbm_measures_every_choice_and_writes_a_servable_variant(
    tmp_path: Path,
) -> None:
    est, x = _cancer_lightgbm(tmp_path / "src")
    out = tmp_path / "repo" / "cancer"
    code = cli_main(["optimize-trees", str(tmp_path / "src"), "--out", str(out),
                        "--work", str(tmp_path / "work"), *FAST])  # fmt: skip
    assert code == 0
    report = (tmp_path / "work" / "report.md").read_text()
    record = json.loads((out / "optimization.json").read_text())
    names = {m["name"]: m for m in record["measurements"]}
    expected = {"native", "native-fp32-input", "treelite", "onnx"}
    if _lleaves():
        expected.add("lleaves")
    assert expected <= set(names), (set(names), record["skipped"])
    for name in expected:
        assert f"`{name}`" in report
        m = names[name]
        assert m["p50_ms"] > 0 and m["throughput"]["64"] > 0 and m["size_bytes"] > 0
    assert names["native"]["score"] == 1.0
    # rows drawn at LightGBM's float64 thresholds: float32 features cross some of them
    assert names["native-fp32-input"]["score"] < 1.0
    assert names["native-fp32-input"]["metrics"]["max_abs_diff"] > 1e-6
    chosen = record["chosen"]
    assert chosen != "native-fp32-input" and names[chosen]["score"] >= 1.0 - 1e-6
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["backend"] == "lightgbm"
    assert config["lightgbm"]["execution"] == record["execution"]
    # the written model serves the framework's answers through the chosen execution
    model = trees.load(parse_model_config(config, "cancer", str(out / "config.yaml")), out / "1")
    assert model.execution == record["execution"]
    got = model.run(0, {"features": x[:50]})
    np.testing.assert_allclose(got["predict_proba"], est.predict_proba(x[:50]), atol=1e-6)


def test_optimize_xgboost_with_user_rows_and_a_budget_that_admits_float32(tmp_path: Path) -> None:
    x, y = load_breast_cancer(return_X_y=True)
    clf = xgb.XGBClassifier(n_estimators=30, max_depth=3).fit(x, y)
    clf.save_model(tmp_path / "model.json")
    rows = tmp_path / "rows.npy"
    np.save(rows, x[:200].astype(np.float32))
    out = tmp_path / "repo" / "x"
    code = cli_main(["optimize-trees", str(tmp_path / "model.json"), "--out", str(out),
                        "--work", str(tmp_path / "w"), "--eval", str(rows), "--variants",
                        "treelite,onnx", *FAST])  # fmt: skip
    assert code == 0
    record = json.loads((out / "optimization.json").read_text())
    assert [m["name"] for m in record["measurements"]] == ["native", "treelite", "onnx"]
    # XGBoost is float32 inside: no float32-input variant to try
    assert all(m["score"] == 1.0 for m in record["measurements"])
    assert (out / "1" / "model.json").read_bytes() == (tmp_path / "model.json").read_bytes()


def test_bad_inputs_are_refused_naming_the_flag(tmp_path: Path, capsys: Any) -> None:
    x, y = load_breast_cancer(return_X_y=True)
    xgb.XGBClassifier(n_estimators=3, max_depth=2).fit(x, y).save_model(tmp_path / "model.json")
    np.save(tmp_path / "bad.npy", x[:5, :4])
    args = ["optimize-trees", str(tmp_path / "model.json"), "--out", str(tmp_path / "o"), *FAST]
    assert cli_main([*args, "--eval", str(tmp_path / "bad.npy")]) == 2
    err = capsys.readouterr().err
    assert "--eval" in err and "expected rows of 30 features [n, 30]" in err and "[5, 4]" in err
    assert cli_main([*args, "--variants", "lleaves"]) == 1
    assert "none of --variants lleaves could be built" in capsys.readouterr().err
    assert not (tmp_path / "o" / "config.yaml").exists()
    assert cli_main(["optimize-trees", str(tmp_path / "bad.npy"), "--out", "o"]) == 2
    assert "expected a tree model file" in capsys.readouterr().err
    assert cli_main([*args, "--max-accuracy-drop", "-1"]) == 2
    assert "--max-accuracy-drop" in capsys.readouterr().err


def test_optimize_early_stopped_xgboost_serves_its_best_iteration(tmp_path: Path) -> None:
    """An XGBoost model saved after early stopping: every measured choice and the written
    variant answer ``XGBClassifier.predict_proba`` (the trees up to ``best_iteration``)."""
    x, y = load_breast_cancer(return_X_y=True)
    clf = xgb.XGBClassifier(n_estimators=200, max_depth=3, learning_rate=0.5,
                            early_stopping_rounds=3, eval_metric="logloss")  # fmt: skip
    clf.fit(x[:400], y[:400], eval_set=[(x[400:], y[400:])], verbose=False)
    assert 0 < clf.best_iteration < 150  # (it stopped early: the later trees must not count)
    clf.save_model(tmp_path / "model.json")
    out = tmp_path / "repo" / "x"
    code = cli_main(["optimize-trees", str(tmp_path / "model.json"), "--out", str(out),
                     "--work", str(tmp_path / "w"), "--variants", "treelite,onnx", *FAST])  # fmt: skip
    assert code == 0
    record = json.loads((out / "optimization.json").read_text())
    assert {"native", "treelite", "onnx"} <= {m["name"] for m in record["measurements"]}
    config = yaml.safe_load((out / "config.yaml").read_text())
    want = clf.predict_proba(x[:60])
    for execution in ("native", "treelite", "onnx"):
        config["xgboost"]["execution"] = execution
        model = trees.load(parse_model_config(config, "x", str(out / "config.yaml")), out / "1")
        got = model.run(0, {"features": x[:60].astype(np.float32)})
        np.testing.assert_allclose(got["predict_proba"], want, atol=1e-6, err_msg=execution)
