"""Tree and scikit-learn models from their own files: ``backend: xgboost | lightgbm |
catboost | sklearn``.

Files read from the version directory (the first present):

- xgboost: ``model.json``, ``model.ubj``
- lightgbm: ``model.txt``
- catboost: ``model.cbm``
- sklearn: ``model.skops`` (types outside skops' defaults must be listed in the config's
  ``sklearn.trusted_types``; any other is refused), or ``model.onnx`` (skl2onnx's output,
  served by ONNX Runtime)
- any of them: ``model.pkl`` / ``model.joblib``, only with ``allow_pickle: true`` in the
  backend's section of config.yaml (a pickle runs code when loaded; the load is logged).

One input, ``features`` ``[n, F]`` (FP32 for xgboost, FP64 otherwise; NaN is missing; for
catboost and sklearn, ``datatype: BYTES``: every value as text, categories as their strings).
Outputs (the section's ``outputs`` chooses; default ``predict`` and, for classifiers,
``predict_proba``): ``predict`` (the class or value, as the framework's ``predict``),
``predict_proba`` ``[classes]``, ``margin`` (raw score). Models whose framework computes
TreeSHAP also have, on request (``parameters: {"contributions": true}`` or asking for the
output), ``contributions`` ``[F + 1]`` (``[classes, F + 1]`` multiclass; the last column is
the bias) and ``reasons`` ``[k]``: the top-k features by magnitude, ``name:value``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import struct
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rtserve.config import AUTO_BATCH, ModelConfig, TensorSpec
from rtserve.errors import ConfigError, InvalidInput
from rtserve.runtime import tree_engines
from rtserve.runtime.parameters import RowParameter

log = logging.getLogger(__name__)

FRAMEWORKS = ("xgboost", "lightgbm", "catboost", "sklearn")
FILES = {
    "xgboost": ("model.json", "model.ubj"),
    "lightgbm": ("model.txt",),
    "catboost": ("model.cbm",),
    "sklearn": ("model.skops", "model.onnx"),
}
PICKLES = ("model.pkl", "model.joblib")
OUTPUTS = ("predict", "predict_proba", "margin")
CONTRIBUTIONS = "contributions"
REASONS = "reasons"
INPUT = "features"
DEFAULT_MAX_BATCH = 256
_OPTIONS = ("outputs", "execution", "allow_pickle", "trusted_types", "reason_codes", "datatype")


@dataclass(frozen=True, slots=True)
class FlagParameter(RowParameter):
    """A request parameter that is true or false (``contributions``)."""

    def value(self, given: Any) -> float:
        if given is None:
            return self.default
        if isinstance(given, bool) or given in (0, 1):
            return float(given)
        raise InvalidInput(f"parameters.{self.name}: expected true or false, got {given!r:.100}")


CONTRIBUTIONS_PARAMETER = FlagParameter(CONTRIBUTIONS, 0.0, meaning="per-feature contributions")


@dataclass(frozen=True)
class Options:
    outputs: tuple[str, ...] | None
    execution: str
    allow_pickle: bool
    trusted_types: tuple[str, ...]
    reason_codes: int
    datatype: str | None


def parse_options(config: ModelConfig) -> Options:
    where = f"{config.source}: {config.backend}"
    section = config.backend_options
    unknown = [k for k in section if k not in _OPTIONS]
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown option (expected: {', '.join(_OPTIONS)})")
    outputs = section.get("outputs")
    if outputs is not None and (
        not isinstance(outputs, list) or not outputs or any(o not in OUTPUTS for o in outputs)
    ):
        raise ConfigError(
            f"{where}.outputs: expected a list drawn from {', '.join(OUTPUTS)}, got {outputs!r:.100}"
        )
    execution = section.get("execution", "auto")
    if execution not in tree_engines.EXECUTIONS:
        raise ConfigError(
            f"{where}.execution: expected one of {', '.join(tree_engines.EXECUTIONS)}, got {execution!r:.100}"
        )
    allow = section.get("allow_pickle", False)
    if not isinstance(allow, bool):
        raise ConfigError(f"{where}.allow_pickle: expected true or false, got {allow!r:.100}")
    trusted = section.get("trusted_types", [])
    if not isinstance(trusted, list) or any(not isinstance(t, str) for t in trusted):
        raise ConfigError(
            f"{where}.trusted_types: expected a list of type names, got {trusted!r:.100}"
        )
    k = section.get("reason_codes", 5)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"{where}.reason_codes: expected an integer >= 1, got {k!r:.100}")
    datatype = section.get("datatype")
    if datatype not in (None, "FP32", "FP64", "BYTES"):
        raise ConfigError(f"{where}.datatype: expected FP32, FP64 or BYTES, got {datatype!r:.100}")
    if datatype == "BYTES" and config.backend not in ("catboost", "sklearn"):
        raise ConfigError(
            f"{where}.datatype: BYTES is for CatBoost and scikit-learn models (features as "
            "text: string categories)"
        )
    return Options(
        tuple(outputs) if outputs else None, execution, allow, tuple(trusted), k, datatype
    )


def find_file(framework: str, version_dir: Path, options: Options, where: str) -> Path:
    for name in FILES[framework]:
        if (version_dir / name).is_file():
            return version_dir / name
    for name in PICKLES:
        path = version_dir / name
        if path.is_file():
            if not options.allow_pickle:
                raise ConfigError(
                    f"{path}: a pickle runs code when it is loaded; refused (save the model in "
                    f"{' or '.join(FILES[framework])}, or set {framework}: {{allow_pickle: true}} "
                    f"in {where} if you trust the file)"
                )
            return path
    names = sorted(p.name for p in version_dir.iterdir()) if version_dir.is_dir() else []
    raise ConfigError(
        f"{version_dir}: backend {framework} reads {' or '.join(FILES[framework])} "
        f"(or a pickle with allow_pickle: true); the directory holds {', '.join(names[:10]) or 'no files'}"
    )


def _load_pickle(path: Path) -> Any:
    log.warning("%s: loading a pickle (allow_pickle: true): it may run code", path)
    if path.suffix == ".joblib":
        import joblib

        return joblib.load(path)
    import pickle

    with path.open("rb") as f:
        return pickle.load(f)  # noqa: S301 (allowed by the model's config)


def _names(names: Any, n: int) -> tuple[str, ...]:
    if names is not None and len(names) == n:
        return tuple(str(x) for x in names)
    return tuple(f"f{i}" for i in range(n))


@dataclass
class Adapter:
    """One loaded model, whatever its framework: what the runtime needs from it."""

    framework: str
    kind: str  # binary | multiclass | regression
    n_features: int
    feature_names: tuple[str, ...]
    classes: tuple[Any, ...]  # the classifier's, in probability column order
    out_dtype: Any  # of probabilities, values, margins
    value: Callable[[np.ndarray], np.ndarray]  # native "value" (see tree_engines)
    margin: Callable[[np.ndarray], np.ndarray] | None
    contributions: Callable[[np.ndarray], np.ndarray] | None
    labels_fn: Callable[[np.ndarray], np.ndarray] | None = None  # predict (sklearn's own)
    proba_fn: Callable[[np.ndarray], np.ndarray] | None = None
    booster: Any = None  # for treelite / onnx conversion
    dtype: Any = np.float32
    targets: int = 1  # a regressor's outputs per row (XGBoost's multi-target models)
    contributions_shape: tuple[int, ...] | None = None  # per row, if not [targets, F + 1]
    probabilities: bool = True  # False: a classifier without predict_proba (LinearSVC)


def _xgboost(path: Path, obj: Any = None) -> Adapter:
    import xgboost as xgb

    if obj is None:
        problem = _ubjson_problem(path.read_bytes()) if path.suffix == ".ubj" else ""
        if problem:
            raise ConfigError(f"{path}: xgboost could not load the model: {problem}")
        booster = xgb.Booster()
        try:
            booster.load_model(str(path))
        except xgb.core.XGBoostError as exc:
            raise ConfigError(
                f"{path}: xgboost could not load the model: {_first_line(exc)}"
            ) from None
    else:
        booster = obj.get_booster() if hasattr(obj, "get_booster") else obj
    booster = _xgboost_best_iteration(booster, path)
    booster.set_param({"nthread": 1})
    learner = json.loads(booster.save_config())["learner"]
    objective = learner["objective"]["name"]
    n_class = int(learner["learner_model_param"].get("num_class", "0") or 0)
    targets = int(learner["learner_model_param"].get("num_target", "1") or 1)
    kind = "binary" if objective == "binary:logistic" else "regression"
    if objective.startswith("multi:"):
        kind = "multiclass"
    n = booster.num_features()
    softmax = objective == "multi:softmax"
    inplace = booster.inplace_predict
    if learner.get("gradient_booster", {}).get("name") == "gblinear":

        def inplace(x: np.ndarray, predict_type: str = "value") -> np.ndarray:
            # (gblinear has no inplace_predict: through a DMatrix)
            dm = xgb.DMatrix(x, feature_names=booster.feature_names, nthread=1)
            return booster.predict(dm, output_margin=predict_type == "margin")

    def value(x: np.ndarray) -> np.ndarray:
        if softmax:
            m = inplace(x, predict_type="margin")
            e = np.exp(m - m.max(axis=1, keepdims=True))
            return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)
        return inplace(x)

    def margin(x: np.ndarray) -> np.ndarray:
        return inplace(x, predict_type="margin")

    names = booster.feature_names

    def contributions(x: np.ndarray) -> np.ndarray:
        return booster.predict(xgb.DMatrix(x, feature_names=names, nthread=1), pred_contribs=True)

    classes = tuple(range(max(n_class, 2))) if kind != "regression" else ()
    return Adapter("xgboost", kind, n, _names(booster.feature_names, n), classes, np.float32,
                   value, margin, contributions, booster=booster, dtype=np.float32,
                   targets=targets if kind == "regression" else 1)  # fmt: skip


def _xgboost_best_iteration(booster: Any, path: Path) -> Any:
    """The trees up to the early-stopping best iteration the file records, as XGBoost's
    scikit-learn models predict (``XGBClassifier.predict``): the later rounds sliced off,
    for every execution (treelite and ONNX convert the sliced booster)."""
    best = booster.attr("best_iteration")
    if best is None:
        return booster
    try:
        rounds = int(best) + 1
        if not 0 < rounds < booster.num_boosted_rounds():
            return booster
        sliced = booster[:rounds]
    except Exception:  # (gblinear: no trees to slice; XGBoost uses all of it)
        return booster
    log.info("%s: early-stopped model: its first %d of %d rounds used (best_iteration %s)",
             path, rounds, booster.num_boosted_rounds(), best)  # fmt: skip
    return sliced


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def _lightgbm(path: Path, obj: Any = None) -> Adapter:
    import lightgbm as lgb

    if obj is None:
        _check_lightgbm_text(path)
        try:
            booster = lgb.Booster(model_file=str(path))
        except lgb.basic.LightGBMError as exc:
            raise ConfigError(
                f"{path}: lightgbm could not load the model: {_first_line(exc)}"
            ) from None
        text = path.read_text(errors="replace")
    else:
        booster = obj.booster_ if hasattr(obj, "booster_") else obj
        text = booster.model_to_string()
    header = text.split("Tree=", 1)[0]
    fields = dict(re.findall(r"^(\w+)=(.*)$", header, re.M))
    objective = fields.get("objective", "regression").split()[0]
    n_class = int(fields.get("num_class", "1"))
    kind = "regression"
    if objective == "binary":
        kind = "binary"
    elif objective in ("multiclass", "multiclassova", "softmax", "ova"):
        kind = "multiclass"
    n = booster.num_feature()

    def value_many(x: np.ndarray) -> np.ndarray:
        return np.asarray(booster.predict(x, num_threads=1))

    def margin_many(x: np.ndarray) -> np.ndarray:
        return np.asarray(booster.predict(x, raw_score=True, num_threads=1))

    width = n_class if kind == "multiclass" else 1
    value = _lightgbm_one_row(booster, 0, n, width, value_many)
    margin = _lightgbm_one_row(booster, 1, n, width, margin_many)

    def contributions(x: np.ndarray) -> np.ndarray:
        c = np.asarray(booster.predict(x, pred_contrib=True, num_threads=1))
        return c.reshape(x.shape[0], n_class, n + 1) if kind == "multiclass" else c

    classes = tuple(range(max(n_class, 2))) if kind != "regression" else ()
    labels = getattr(obj, "classes_", None)  # (a pickled LGBMClassifier: its own labels)
    if kind != "regression" and labels is not None and len(labels) == len(classes):
        classes = tuple(labels)
    return Adapter("lightgbm", kind, n, _names(booster.feature_name(), n), classes, np.float64,
                   value, margin, None if _lightgbm_linear(text) else contributions,
                   booster=booster, dtype=np.float64)  # fmt: skip


def _lightgbm_linear(text: str) -> bool:
    """Whether a LightGBM model has linear trees (``linear_tree``): LightGBM computes no
    SHAP contributions for them."""
    return re.search(r"^is_linear=1$", text, re.M) is not None


def _lightgbm_one_row(
    booster: Any, predict_type: int, n: int, width: int, many: tree_engines.Predict
) -> tree_engines.Predict:
    """``many`` (``Booster.predict``), but one row through LightGBM's single-row C API
    (``LGBM_BoosterPredictForMatSingleRowFast``, set up once): the same trees and code
    without ``Booster.predict``'s per-call Python work, which costs more than the trees of
    one row. Checked against ``many`` here (NaNs included); ``many`` alone if it differs or
    the library lacks the API. ``predict_type``: 0 the value, 1 the raw score."""
    import ctypes
    import threading

    import lightgbm as lgb

    lib = lgb.basic._LIB
    handle = getattr(booster, "_handle", None)
    config = ctypes.c_void_p()
    try:
        iterations = int(booster.best_iteration)
        if handle is None or lib.LGBM_BoosterPredictForMatSingleRowFastInit(
            handle, ctypes.c_int(predict_type), ctypes.c_int(0), ctypes.c_int(iterations),
            ctypes.c_int(1), ctypes.c_int32(n), ctypes.c_char_p(b"num_threads=1"),
            ctypes.byref(config),
        ) != 0:  # fmt: skip
            return many
    except (AttributeError, TypeError, ValueError):
        return many
    free = lib.LGBM_FastConfigFree
    weakref.finalize(booster, free, config)  # (freed with the booster it reads)
    run = lib.LGBM_BoosterPredictForMatSingleRowFast
    out_len = ctypes.c_int64()
    out_ref = ctypes.byref(out_len)
    lock = threading.Lock()  # (one fast config: one call at a time)

    def predict(x: np.ndarray) -> np.ndarray:
        if x.shape[0] != 1:
            return many(x)
        row = np.ascontiguousarray(x, dtype=np.float64)
        out = np.empty(width, np.float64)
        with lock:
            failed = run(config, row.ctypes.data_as(ctypes.c_void_p), out_ref,
                         out.ctypes.data_as(ctypes.c_void_p))  # fmt: skip
        if failed:
            return many(x)
        return out.reshape(1, width) if width > 1 else out

    rng = np.random.default_rng(0)
    check = rng.normal(size=(8, n))
    check[::3, :: max(1, n // 4)] = np.nan
    for r in range(check.shape[0]):
        one = check[r : r + 1]
        got, want = predict(one), np.asarray(many(one))
        if got.shape != want.shape or not np.array_equal(got, want, equal_nan=True):
            log.warning("lightgbm's single-row API differs from Booster.predict; not used")
            return many
    return predict


def _check_lightgbm_text(path: Path) -> None:
    """LightGBM aborts the process on some damaged files (a truncated tree: it reads the
    trees by the sizes its header gives); refuse those first: the header, every tree the
    header counts, whole, and the end marker."""
    data = path.read_bytes()
    why = ""
    header, _, rest = data.partition(b"\nTree=0\n")
    sizes = re.search(rb"^tree_sizes=([\d ]*)$", header, re.M)
    if data.startswith(b"tree\r\n"):  # (LightGBM aborts on them: the sizes count \n only)
        why = "it has CRLF (Windows) line endings; LightGBM reads only '\\n' ones"
    elif not data.startswith(b"tree\n"):
        why = "it does not start with LightGBM's 'tree' header"
    elif sizes is None or not rest:
        why = "its header or first tree is missing"
    elif b"\nend of trees" not in rest:
        why = "it ends before 'end of trees' (truncated?)"
    else:
        expected = sum(int(n) for n in sizes.group(1).split())
        start = len(header) + 1
        end = data.find(b"end of trees", start)
        if end - start < expected:
            why = f"its trees take {end - start} bytes where the header says {expected}"
    if why:
        raise ConfigError(f"{path}: lightgbm could not load the model: {why}")


_UBJ_SIZES = {b"i": 1, b"U": 1, b"I": 2, b"l": 4, b"L": 8, b"d": 4, b"D": 8, b"C": 1}
_UBJ_INTS = {b"i": ">b", b"U": ">B", b"I": ">h", b"l": ">i", b"L": ">q"}


def _ubjson_problem(data: bytes) -> str:
    """Why ``data`` is not one whole UBJSON value ('' if it is): every length and count in
    it must fit in the bytes that follow. XGBoost trusts them: a truncated ``model.ubj``
    can make it allocate a count read from the wrong bytes (and be killed for memory)."""
    end = len(data)

    def need(pos: int, k: int) -> None:
        if k < 0 or pos + k > end:
            raise ValueError(f"it ends inside a value at byte {pos} (truncated?)")

    def integer(pos: int, marker: bytes) -> tuple[int, int]:
        fmt = _UBJ_INTS.get(marker)
        if fmt is None:
            raise ValueError(f"expected an integer at byte {pos - 1}, found {marker!r}")
        k = _UBJ_SIZES[marker]
        need(pos, k)
        return struct.unpack_from(fmt, data, pos)[0], pos + k

    def length(pos: int) -> tuple[int, int]:
        need(pos, 1)
        n, pos = integer(pos + 1, data[pos : pos + 1])
        if n < 0:
            raise ValueError(f"a negative length at byte {pos}")
        return n, pos

    def value(pos: int, marker: bytes) -> int:
        if marker in (b"Z", b"T", b"F", b"N"):
            return pos
        if marker in _UBJ_SIZES:
            need(pos, _UBJ_SIZES[marker])
            return pos + _UBJ_SIZES[marker]
        if marker in (b"S", b"H"):
            n, pos = length(pos)
            need(pos, n)
            return pos + n
        if marker in (b"[", b"{"):
            return container(pos, marker == b"{")
        raise ValueError(f"unknown marker {marker!r} at byte {pos - 1}")

    def container(pos: int, is_object: bool) -> int:
        typed = None
        count = None
        need(pos, 1)
        if data[pos : pos + 1] == b"$":
            need(pos + 1, 1)
            typed = data[pos + 1 : pos + 2]
            pos += 2
            need(pos, 1)
            if data[pos : pos + 1] != b"#":
                raise ValueError(f"a typed container without a count at byte {pos}")
        if data[pos : pos + 1] == b"#":
            count, pos = length(pos + 1)
        close = b"}" if is_object else b"]"
        i = 0
        while True:
            if count is not None and i == count:
                return pos
            need(pos, 1)
            if count is None and data[pos : pos + 1] == close:
                return pos + 1
            if is_object:
                n, pos = length(pos)
                need(pos, n)
                pos += n
            if typed is not None:
                if not is_object and typed in _UBJ_SIZES:  # (a typed array: skipped at once)
                    need(pos, _UBJ_SIZES[typed] * (count or 0))
                    return pos + _UBJ_SIZES[typed] * (count or 0)
                pos = value(pos, typed)
            else:
                need(pos, 1)
                pos = value(pos + 1, data[pos : pos + 1])
            i += 1

    try:
        need(0, 1)
        pos = value(1, data[0:1])
    except (ValueError, struct.error) as exc:
        return str(exc)
    if pos != end:
        return f"{end - pos} bytes follow the model's end"
    return ""


def _catboost(path: Path, obj: Any = None) -> Adapter:
    import catboost

    if obj is None:
        model = catboost.CatBoost()
        try:
            model.load_model(str(path), format="cbm")
        except catboost.CatBoostError as exc:
            raise ConfigError(
                f"{path}: catboost could not load the model: {_first_line(exc)}"
            ) from None
    else:
        model = obj
    loss = str(model.get_all_params().get("loss_function", "RMSE")).split(":")[0]
    kind = {"Logloss": "binary", "CrossEntropy": "binary", "MultiClass": "multiclass",
            "MultiClassOneVsAll": "multiclass"}.get(loss, "regression")  # fmt: skip
    cats = list(model.get_cat_feature_indices())
    n = len(model.feature_names_)

    def rows(x: np.ndarray) -> Any:
        if x.dtype == object:  # (datatype: BYTES)
            return catboost.Pool(_catboost_text(x, cats), cat_features=cats or None)
        if not cats:
            return x
        if np.isnan(x[:, cats]).any():
            raise InvalidInput(f"input '{INPUT}': categorical features {cats} cannot be NaN")
        data = x.astype(object)
        data[:, cats] = x[:, cats].astype(np.int64)
        return catboost.Pool(data, cat_features=cats)

    if kind == "regression":
        regressor = model
        if obj is None:  # (the regressor's predict applies the loss's link: Poisson's exp)
            regressor = catboost.CatBoostRegressor()
            regressor.load_model(str(path), format="cbm")

        def value(x: np.ndarray) -> np.ndarray:
            return np.asarray(regressor.predict(rows(x), thread_count=1), np.float64)

    else:
        binary = kind == "binary"

        def value(x: np.ndarray) -> np.ndarray:
            p = model.predict(rows(x), prediction_type="Probability", thread_count=1)
            return p[:, 1] if binary else p

    def margin(x: np.ndarray) -> np.ndarray:
        return np.asarray(model.predict(rows(x), prediction_type="RawFormulaVal", thread_count=1))

    def contributions(x: np.ndarray) -> np.ndarray:
        data = rows(x)
        pool = data if isinstance(data, catboost.Pool) else catboost.Pool(data)
        return np.asarray(model.get_feature_importance(pool, type="ShapValues", thread_count=1))

    classes: tuple[Any, ...] = ()
    if kind != "regression":
        names = getattr(model, "classes_", None)
        classes = tuple(names) if names is not None and len(names) else (0, 1)
    targets, each = 1, None  # (MultiRMSE, RMSEWithUncertainty: several values per row)
    if kind == "regression":
        shape = np.shape(value(np.zeros((1, n))))
        targets = shape[1] if len(shape) == 2 else 1
        if targets > 1:  # (RMSEWithUncertainty's contributions: of the mean only)
            each = np.shape(contributions(np.zeros((1, n))))[1:]
    return Adapter("catboost", kind, n, _names(model.feature_names_, n), classes, np.float64,
                   value, margin, contributions, dtype=np.float64, targets=targets,
                   contributions_shape=each)  # fmt: skip


def _catboost_text(x: np.ndarray, cats: list[int]) -> np.ndarray:
    """Rows sent as BYTES: categorical columns as their text (the categories a model trained
    on strings knows), the others parsed as numbers (empty or ``nan``: missing)."""
    data = np.empty(x.shape, dtype=object)
    numeric = [j for j in range(x.shape[1]) if j not in cats]
    for j in cats:
        data[:, j] = [v.decode() if isinstance(v, bytes) else str(v) for v in x[:, j]]
    for j in numeric:
        try:
            data[:, j] = [
                float(v) if (v.strip() if isinstance(v, (bytes, str)) else True) else np.nan
                for v in x[:, j]
            ]
        except (TypeError, ValueError):
            raise InvalidInput(
                f"input '{INPUT}': feature {j} is numeric: expected a number as text, "
                f"got {next(v for v in x[:, j] if not _number(v))!r:.60}"
            ) from None
    return data


def _number(v: Any) -> bool:
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return True


def _text_rows(x: np.ndarray) -> np.ndarray:
    """Rows sent as BYTES to a scikit-learn model: every value as text (its numeric steps
    parse their columns, its encoders see the strings they were fitted on), empty: NaN."""
    flat = [v.decode() if isinstance(v, bytes) else str(v) for v in x.ravel()]
    out = np.array(flat, dtype=object).reshape(x.shape)
    out[out == ""] = np.nan
    return out


def _sklearn(path: Path, options: Options, obj: Any = None) -> Adapter:
    if obj is None:
        import skops.io as sio

        try:
            untrusted = sio.get_untrusted_types(file=str(path))
        except Exception as exc:
            raise ConfigError(
                f"{path}: skops could not read the file: {_first_line(exc)}"
            ) from None
        refused = [t for t in untrusted if t not in options.trusted_types]
        if refused:
            raise ConfigError(
                f"{path}: the file holds types skops does not trust by default: "
                f"{', '.join(refused)}; list those you trust in sklearn.trusted_types in "
                "config.yaml (refused otherwise: loading a type runs its code)"
            )
        try:
            obj = sio.load(str(path), trusted=list(untrusted))
        except Exception as exc:
            raise ConfigError(
                f"{path}: skops could not load the model: {_first_line(exc)}"
            ) from None
    est = obj
    n = int(getattr(est, "n_features_in_", 0))
    if not n:
        raise ConfigError(f"{path}: the model has no n_features_in_ (is it fitted?)")
    columns = getattr(est, "feature_names_in_", None)

    def as_frame(x: np.ndarray) -> Any:
        return _text_rows(x) if x.dtype == object else x

    if columns is not None:  # fitted on a DataFrame: its columns select by name
        import pandas as pd

        names = list(columns)

        def as_frame(x: np.ndarray) -> Any:
            return pd.DataFrame(_text_rows(x) if x.dtype == object else x, columns=names)

    classes = tuple(getattr(est, "classes_", ()))
    has_proba = hasattr(est, "predict_proba") and bool(classes)
    kind = "regression"
    if classes:
        kind = "binary" if len(classes) == 2 else "multiclass"

    def labels_fn(x: np.ndarray) -> np.ndarray:
        return np.asarray(est.predict(as_frame(x)))

    def proba(x: np.ndarray) -> np.ndarray:
        return np.asarray(est.predict_proba(as_frame(x)))

    def value(x: np.ndarray) -> np.ndarray:
        if has_proba:
            p = proba(x)
            return p[:, 1] if kind == "binary" else p
        if classes:  # (no probabilities: the class's index, for the timing at load only)
            return np.searchsorted(np.asarray(classes), labels_fn(x)).astype(np.float64)
        return labels_fn(x).astype(np.float64)

    contributions = None
    feature_names = _names(columns, n)
    steps = getattr(est, "steps", None)
    final = steps[-1][1] if steps else est
    if "n_jobs" in getattr(final, "get_params", dict)():
        final.set_params(n_jobs=1)  # (one request's rows: a thread pool costs more than it saves)
    booster = final.get_booster() if hasattr(final, "get_booster") else None
    if booster is not None:  # (its predict uses the early-stopping best iteration)
        booster = _xgboost_best_iteration(booster, path)
    lgbm: Any = getattr(final, "booster_", None) if booster is None else None
    if lgbm is not None and _lightgbm_linear(lgbm.model_to_string()):
        lgbm = None  # (no SHAP contributions for linear trees)
    if booster is not None or lgbm is not None:
        before = est[:-1] if steps else None

        def transformed(x: np.ndarray) -> np.ndarray:
            t = before.transform(as_frame(x)) if before is not None else as_frame(x)
            return np.asarray(t, dtype=np.float64)

        if booster is not None:
            import xgboost as xgb

            booster.set_param({"nthread": 1})

            def contributions(x: np.ndarray) -> np.ndarray:
                return booster.predict(xgb.DMatrix(transformed(x), nthread=1), pred_contribs=True)

        else:

            def contributions(x: np.ndarray) -> np.ndarray:
                c = np.asarray(lgbm.predict(transformed(x), pred_contrib=True, num_threads=1))
                k = len(classes) if kind == "multiclass" else 1
                return c.reshape(x.shape[0], k, -1) if k > 1 else c

        if before is not None:
            with contextlib.suppress(Exception):  # a step without names: positions
                feature_names = tuple(str(f) for f in before.get_feature_names_out())
    adapter = Adapter("sklearn", kind, n, feature_names, classes, np.float64, value, None,
                      contributions, labels_fn=labels_fn, proba_fn=proba if has_proba else None,
                      dtype=np.float64, probabilities=has_proba or not classes)  # fmt: skip
    if (
        booster is not None
        and kind != "regression"
        and classes == tuple(range(len(classes)))
        and options.datatype != "BYTES"
    ):
        _fuse_scaler_xgboost(adapter, est, booster, path)
    return adapter


def _fuse_scaler_xgboost(adapter: Adapter, est: Any, booster: Any, path: Path) -> None:
    """ "Scaler then XGBoost" without scikit-learn's per-call validation (most of a row's
    cost): a Pipeline of StandardScalers (or passthrough) before an XGBoost classifier with
    classes 0..C-1 runs as the same arithmetic in NumPy, then ``inplace_predict``. Used only
    if its answers equal the pipeline's own on a check batch (exactly: same operations)."""
    from sklearn.preprocessing import StandardScaler

    steps = getattr(est, "steps", None)
    if not steps:
        return
    scalers = [s for _, s in steps[:-1] if s not in (None, "passthrough")]
    if not all(type(s) is StandardScaler for s in scalers):
        return
    binary = adapter.kind == "binary"

    def scaled(x: np.ndarray) -> np.ndarray:
        y = np.array(x, dtype=np.float64)
        for s in scalers:
            if s.with_mean:
                y -= s.mean_
            if s.with_std:
                y /= s.scale_
        return y

    def value(x: np.ndarray) -> np.ndarray:
        return np.asarray(booster.inplace_predict(scaled(x)))

    def labels(x: np.ndarray) -> np.ndarray:
        v = value(x)
        return (v > 0.5).astype(np.int64) if binary else v.argmax(axis=1)

    check = np.nan_to_num(tree_engines.check_batch(adapter.n_features, np.float64))
    want = adapter.proba_fn(check) if adapter.proba_fn is not None else None
    got = value(check)
    if want is None or not np.array_equal(np.stack([1 - got, got], 1) if binary else got, want):
        return
    if adapter.labels_fn is None or not np.array_equal(labels(check), adapter.labels_fn(check)):
        return
    import xgboost as xgb

    def contributions(x: np.ndarray) -> np.ndarray:
        return booster.predict(xgb.DMatrix(scaled(x), nthread=1), pred_contribs=True)

    log.info("%s: the scaler and XGBoost run fused in NumPy + inplace_predict", path)
    adapter.value, adapter.labels_fn, adapter.proba_fn = value, labels, None
    adapter.contributions = contributions


def _numpy_type(dtype: Any) -> str:
    kind = np.dtype(dtype).kind
    if kind in "iub":
        return "INT64"
    if kind == "f":
        return "FP64" if np.dtype(dtype).itemsize == 8 else "FP32"
    return "BYTES"


class TreeModel:
    """The runtime (see ``runtime/base.py``) of one tree or scikit-learn model."""

    def __init__(self, adapter: Adapter, config: ModelConfig, options: Options, path: Path) -> None:
        a = adapter
        self.adapter = a
        self.path = path
        self.instance_count = config.instance_count
        mb = config.max_batch_size
        self.max_batch_size = DEFAULT_MAX_BATCH if mb == AUTO_BATCH else mb
        dtype = np.float64 if options.datatype == "FP64" else a.dtype
        if options.datatype == "FP32":
            dtype = np.float32
        elif options.datatype == "BYTES":
            dtype = object  # (CatBoost: categorical features as text)
        self.dtype = np.dtype(dtype)
        classifier = a.kind != "regression"
        probabilities = classifier and a.probabilities
        wanted = options.outputs or (
            ("predict", "predict_proba") if probabilities else ("predict",)
        )
        where = f"{config.source}: {config.backend}.outputs"
        if "predict_proba" in wanted and not classifier:
            raise ConfigError(f"{where}: predict_proba: the model is not a classifier")
        if "predict_proba" in wanted and not probabilities:
            raise ConfigError(f"{where}: predict_proba: the model has no predict_proba")
        if "margin" in wanted and a.margin is None:
            raise ConfigError(f"{where}: margin: a scikit-learn model has no raw score")
        self.wanted = tuple(wanted)
        self.k = min(options.reason_codes, a.n_features)
        self.contributing = a.contributions is not None
        batched = self.max_batch_size > 0
        rows: tuple[int, ...] = () if batched else (-1,)

        # The predicted class: its index when classes are 0..C-1, else the label (a string
        # label is BYTES).
        sample = np.zeros((1, a.n_features), self.dtype)
        self.label_type = "INT64"
        self._indices = classifier and a.classes == tuple(range(len(a.classes)))
        if a.labels_fn is not None and self.dtype == object and classifier:
            self.label_type = _numpy_type(np.asarray(a.classes).dtype)  # (its predict's)
        elif a.labels_fn is not None and self.dtype == object:
            self.label_type = "FP64"
        elif a.labels_fn is not None:
            self.label_type = _numpy_type(a.labels_fn(sample).dtype)
        elif not classifier:
            self.label_type = _numpy_type(a.out_dtype)
        elif not self._indices:
            self.label_type = _numpy_type(np.asarray(a.classes).dtype)
        classes = len(a.classes)
        multi = a.kind == "multiclass"
        # A multi-target regressor (XGBoost's): [targets] values per row.
        width: tuple[int, ...] = (classes,) if multi else ()
        if a.targets > 1:
            width = (a.targets,)
        specs = {
            "predict": TensorSpec("predict", self.label_type, rows if multi else (*rows, *width)),
            "predict_proba": TensorSpec(
                "predict_proba", _numpy_type(a.out_dtype), (*rows, classes)
            ),
            "margin": TensorSpec("margin", _numpy_type(a.out_dtype), (*rows, *width)),
        }
        outputs = [specs[w] for w in self.wanted]
        self.row_parameters: tuple[RowParameter, ...] = ()
        if self.contributing:
            shape = a.contributions_shape or (*width, a.n_features + 1)
            outputs.append(TensorSpec(CONTRIBUTIONS, "FP64", (*rows, *shape)))
            outputs.append(TensorSpec(REASONS, "BYTES", (*rows, self.k)))
            self.row_parameters = (CONTRIBUTIONS_PARAMETER,)
        self.on_request_outputs = (
            {CONTRIBUTIONS: CONTRIBUTIONS, REASONS: CONTRIBUTIONS} if self.contributing else {}
        )
        self.inputs = (TensorSpec(INPUT, _numpy_type(self.dtype), (*rows, a.n_features)),)
        self.outputs = tuple(outputs)
        self.labels: dict[str, tuple[str, ...]] = {}
        if classifier:
            self.labels["predict_proba"] = tuple(str(c) for c in a.classes)
        if self.contributing:
            self.labels[CONTRIBUTIONS] = (*a.feature_names, "bias")
        self._names = np.array(a.feature_names, dtype=object)
        self._classes = np.array(a.classes) if classifier else None
        self._binary = a.kind == "binary"

        self._choose_execution(a, config, options, path)

    def _choose_execution(
        self, a: Adapter, config: ModelConfig, options: Options, path: Path
    ) -> None:
        """The framework's own execution, or faster ones that give the same answers."""
        native = tree_engines.Engine("native", a.value)
        candidates = []
        where = f"{config.source}: {config.backend}.execution: {options.execution}"
        if options.execution == "lleaves" and a.framework != "lightgbm":
            raise ConfigError(f"{where} is for LightGBM models (model.txt)")
        if (
            options.execution in ("treelite", "lleaves")
            and a.booster is not None
            and path.suffix not in (".json", ".ubj", ".txt")
        ):
            raise ConfigError(
                f"{where} compiles the framework's own file (model.json, model.ubj, "
                f"model.txt), not {path.name}"
            )
        if a.booster is not None and options.execution in ("auto", "treelite", "lleaves", "onnx"):
            makers: list[tuple[str, Callable[[], tree_engines.Engine]]] = []
            if options.execution in ("auto", "treelite") and path.suffix in (
                ".json",
                ".ubj",
                ".txt",
            ):
                makers.append(("treelite", lambda: tree_engines.treelite_engine(
                    a.framework, a.booster, path, a.n_features, a.kind)))  # fmt: skip
            if (
                options.execution in ("auto", "lleaves")
                and a.framework == "lightgbm"
                and path.suffix == ".txt"
            ):
                n_class = len(a.classes)
                makers.append(("lleaves", lambda: tree_engines.lleaves_engine(
                    path, a.kind, n_class)))  # fmt: skip
            # ONNX's TreeEnsemble compares in float32: XGBoost's precision, not LightGBM's
            # (float64 thresholds and leaves), so for LightGBM only when asked for.
            if options.execution == "onnx" or (
                options.execution == "auto" and a.framework == "xgboost"
            ):
                makers.append(("onnx", lambda: tree_engines.onnx_engine(
                    a.framework, a.booster, a.n_features, a.kind, self.dtype)))  # fmt: skip
            for name, make in makers:
                try:
                    candidates.append(make())
                except Exception as exc:
                    log.warning("%s: execution %s unavailable: %s", path, name, _first_line(exc))
        elif options.execution not in ("auto", "native"):
            raise ConfigError(
                f"{config.source}: {config.backend}.execution: {options.execution} is for "
                "XGBoost and LightGBM files (model.json, model.ubj, model.txt)"
            )
        check = tree_engines.check_batch(a.n_features, np.float64)
        if a.framework == "catboost" or a.framework == "sklearn":
            check = np.nan_to_num(check)  # (categorical columns, imputers: no NaN by default)
        check = check.astype(self.dtype)
        if options.execution in ("treelite", "lleaves", "onnx") and not candidates:
            raise ConfigError(f"{config.source}: {config.backend}.execution: {options.execution} "
                              f"could not be built for {path} (see the log)")  # fmt: skip
        if self.dtype == object:  # (text features: no check rows to make; native only)
            choice = tree_engines.Choice(native, native, "native only (BYTES features)", [native])
        else:
            choice = tree_engines.choose(candidates, native, check, str(path))
        if options.execution in ("treelite", "lleaves", "onnx"):
            forced = [e for e in choice.valid if e.name == options.execution]
            if not forced:
                raise ConfigError(
                    f"{config.source}: {config.backend}.execution: {options.execution} "
                    f"gives answers that differ from {a.framework}'s own for {path} (see the log)"
                )
            choice.small = choice.large = forced[0]
        self.choice = choice
        self.execution = (
            choice.small.name
            if choice.small is choice.large
            else f"{choice.small.name} (<= {tree_engines.SMALL_ROWS} rows), {choice.large.name}"
        )
        self.platform = f"{a.framework}_{choice.small.name}"
        if choice.large is not choice.small:
            self.platform += f"_{choice.large.name}"
        log.info("%s: %s %s model, %d features; execution %s (measured: %s)",
                 path, a.framework, a.kind, a.n_features, self.execution, choice.report)  # fmt: skip
        self._small = choice.small.predict
        self._large = choice.large.predict

    def run(self, instance: int, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = feeds[INPUT]
        batched = self.max_batch_size > 0
        if x.ndim != 2 or x.shape[1] != self.adapter.n_features:
            # (checked here too: XGBoost's contributions corrupt memory on a wider matrix)
            raise InvalidInput(
                f"input '{INPUT}': shape {list(x.shape)} does not match the model's "
                f"[-1, {self.adapter.n_features}]"
            )
        if x.dtype != self.dtype:
            x = x.astype(self.dtype)
        n = x.shape[0]
        a = self.adapter
        out: dict[str, np.ndarray] = {}
        need_value = "predict_proba" in self.wanted or (
            "predict" in self.wanted and a.labels_fn is None
        )
        if need_value:
            v = (self._small if n <= tree_engines.SMALL_ROWS else self._large)(x)
            if a.kind == "regression":
                out["predict"] = v
            else:
                if self._binary:  # (np.stack costs more than the model's one row)
                    proba = np.empty((n, 2), v.dtype)
                    proba[:, 1] = v
                    np.subtract(1, v, out=proba[:, 0])
                else:
                    proba = v
                if "predict_proba" in self.wanted:
                    out["predict_proba"] = (
                        a.proba_fn(x) if a.proba_fn is not None and not self._binary else proba
                    )
                if "predict" in self.wanted and a.labels_fn is None:
                    idx = (v > 0.5).astype(np.int64) if self._binary else proba.argmax(axis=1)
                    assert self._classes is not None
                    out["predict"] = idx if self._indices else self._classes[idx]
        if "predict" in self.wanted and a.labels_fn is not None:
            out["predict"] = a.labels_fn(x)
            if self.label_type == "FP64":  # (as declared: a regressor's predict may be FP32)
                out["predict"] = out["predict"].astype(np.float64, copy=False)
        if "margin" in self.wanted and a.margin is not None:
            out["margin"] = a.margin(x)
        if self.contributing:
            flags = feeds.get(CONTRIBUTIONS)
            if flags is not None and (flags[0] if n == 1 else flags.any()):
                c = np.asarray(a.contributions(x), dtype=np.float64)  # type: ignore[misc]
                out[CONTRIBUTIONS] = c
                out[REASONS] = self._reasons(c, out)
            else:
                shape = self.outputs[-2].shape[0 if batched else 1 :]  # (without the rows)
                out[CONTRIBUTIONS] = np.zeros((n, *shape))
                reasons = np.empty((n, self.k), dtype=object)
                reasons.fill(b"")
                out[REASONS] = reasons
        return out

    def _reasons(self, c: np.ndarray, out: dict[str, np.ndarray]) -> np.ndarray:
        """The top-k features by |contribution| per row (a multiclass row: of its predicted
        class), as ``name:value``."""
        if c.ndim == 3:
            cls = c[:, :, :-1].sum(axis=2).argmax(axis=1)
            c = c[np.arange(c.shape[0]), cls]
        values = c[:, :-1]
        top = np.argsort(-np.abs(values), axis=1, kind="stable")[:, : self.k]
        reasons = np.empty(top.shape, dtype=object)
        for i, row in enumerate(top):
            for j, f in enumerate(row):
                reasons[i, j] = f"{self._names[f]}:{values[i, f]:+.6g}".encode()
        return reasons

    def close(self) -> None:
        self.choice = None  # type: ignore[assignment]


def load(config: ModelConfig, version_dir: Path) -> Any:
    """The backend entry point (see ``core.factory.BACKENDS``)."""
    framework = config.backend
    if framework not in FRAMEWORKS:
        raise ConfigError(f"{config.source}: backend: {framework} is not a tree framework")
    options = parse_options(config)
    path = find_file(framework, version_dir, options, config.source)
    if path.suffix == ".onnx":
        from rtserve.runtime.onnx import OnnxRuntimeModel

        return OnnxRuntimeModel.load(config, version_dir)
    try:
        obj = _load_pickle(path) if path.name in PICKLES else None
        if framework == "xgboost":
            adapter = _xgboost(path, obj)
        elif framework == "lightgbm":
            adapter = _lightgbm(path, obj)
        elif framework == "catboost":
            adapter = _catboost(path, obj)
        else:
            adapter = _sklearn(path, options, obj)
    except (ConfigError, InvalidInput):
        raise
    except Exception as exc:  # what a damaged file makes the framework raise
        raise ConfigError(
            f"{path}: {framework} could not load the model: {type(exc).__name__}: {_first_line(exc)}"
        ) from exc
    if config.inputs is not None or config.outputs is not None:
        raise ConfigError(
            f"{config.source}: inputs/outputs: a {framework} model's come from the model "
            f"(choose outputs with {framework}.outputs)"
        )
    try:
        return TreeModel(adapter, config, options, path)
    except (ConfigError, InvalidInput):
        raise
    except Exception as exc:  # (the check batch at load: a model the framework cannot run)
        raise ConfigError(
            f"{path}: {framework} could not run the model: {type(exc).__name__}: {_first_line(exc)}"
        ) from exc
