"""Ways to execute a gradient-boosted tree model, and the choice between them by measurement.

Every engine computes the framework's own prediction ("value": a binary classifier's
probability of class 1 ``[n]``, a multiclass one's probabilities ``[n, classes]``, a
regressor's value ``[n]``) from a float matrix ``[n, features]`` where NaN is missing:

- ``native``: the framework itself (XGBoost's ``inplace_predict``, LightGBM's ``predict``
  with one thread), always present, the reference the others must match;
- ``treelite``: the trees compiled to C by treelite/tl2cgen and built with the system
  compiler into a shared library, cached beside the model under a name keyed by the model
  file's hash (a second load reuses it);
- ``lleaves``: a LightGBM model compiled by lleaves (LLVM through llvmlite) into a shared
  library, cached like treelite's;
- ``onnx``: the model converted by onnxmltools and run by ONNX Runtime's TreeEnsemble.

At load, each candidate's answers on a check batch (with NaNs) must equal the native ones
(to 1e-6), else it is dropped and the log says why; the rest are timed at one row and at a
batch, and the fastest at each is used for requests of that size.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

EXECUTIONS = ("auto", "native", "treelite", "lleaves", "onnx")
CHECK_ROWS = 64
SMALL_ROWS = 4  # requests of at most this many rows use the engine fastest at one row
TOLERANCE = 1e-6
CACHE_DIR = ".rtserve-compiled"

Predict = Callable[[np.ndarray], np.ndarray]


@dataclass
class Engine:
    name: str
    predict: Predict
    note: str = ""
    size: int = 0  # bytes of what it runs (a compiled library, an ONNX graph); 0: the model's


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:20]


def treelite_engine(framework: str, model: Any, path: Path, n_features: int, kind: str) -> Engine:
    """Compile (or reuse the cached) shared library of ``model`` (an ``xgboost.Booster`` or
    ``lightgbm.Booster``, saved at ``path``). An XGBoost booster is compiled as it is in
    memory (an early-stopped one holds only the file's first rounds: they key the cache)."""
    import tl2cgen
    import treelite

    if shutil.which("gcc") is None:
        raise RuntimeError("no gcc on PATH (treelite compiles the trees with it)")
    key = f"{framework}-{file_digest(path)}-tl{treelite.__version__}-tc{tl2cgen.__version__}"
    if framework == "xgboost":
        key += f"-r{model.num_boosted_rounds()}"
    lib = path.resolve().parent / CACHE_DIR / f"{key}.so"  # (beside the file a link names)
    if not lib.exists():
        if framework == "xgboost":
            tmodel = treelite.frontend.from_xgboost_json(bytes(model.save_raw("json")))
        else:
            tmodel = treelite.frontend.from_lightgbm(model)
        try:
            lib.parent.mkdir(exist_ok=True)
            target = lib
        except OSError:  # a read-only repository: compile into the temporary directory
            target = Path(tempfile.gettempdir()) / "rtserve-treelite" / lib.name
            target.parent.mkdir(exist_ok=True)
            lib = target
        if not target.exists():
            start = time.perf_counter()
            partial = target.with_suffix(f".{os.getpid()}.tmp.so")
            trees = max(1, int(getattr(tmodel, "num_tree", 1)))
            tl2cgen.export_lib(
                tmodel,
                toolchain="gcc",
                libpath=str(partial),
                params={"parallel_comp": max(1, min(16, trees // 50))},
                verbose=False,
            )
            partial.replace(target)  # (atomic: a concurrent load never sees half a library)
            log.info(
                "%s: compiled %d trees with treelite into %s in %.1f s",
                path, trees, target, time.perf_counter() - start,
            )  # fmt: skip
    predictor = tl2cgen.Predictor(str(lib), nthread=1)
    dmatrix = tl2cgen.DMatrix
    multi = kind == "multiclass"

    def many(x: np.ndarray) -> np.ndarray:
        out = predictor.predict(dmatrix(x))
        return out.reshape(x.shape[0], -1) if multi else out.reshape(x.shape[0])

    one = _treelite_one_row(lib, n_features, many, multi)

    def predict(x: np.ndarray) -> np.ndarray:
        return one(x) if one is not None and x.shape[0] == 1 else many(x)

    return Engine("treelite", predict, f"library {lib.name}", lib.stat().st_size)


def _treelite_one_row(lib: Path, n_features: int, many: Predict, multi: bool) -> Predict | None:
    """One row through the compiled library's own ``predict(union Entry*, int, leaf*)``,
    without tl2cgen's DMatrix and thread pool per call (they cost more than the trees of
    one row). None when the library is not the expected single-target kind, or its answers
    on check rows (NaNs included) differ from ``many`` (tl2cgen's predictor)."""
    import ctypes
    import sys

    types = {b"float32": np.float32, b"float64": np.float64}
    try:
        so = ctypes.CDLL(str(lib))
        so.get_num_target.restype = ctypes.c_int32
        so.get_num_feature.restype = ctypes.c_int32
        so.get_threshold_type.restype = ctypes.c_char_p
        so.get_leaf_output_type.restype = ctypes.c_char_p
        classes = ctypes.c_int32()
        if so.get_num_target() != 1 or so.get_num_feature() != n_features:
            return None
        so.get_num_class(ctypes.byref(classes))
        threshold = types[so.get_threshold_type()]
        leaf = types[so.get_leaf_output_type()]
        run = so.predict
    except (OSError, AttributeError, KeyError):
        return None
    if sys.byteorder != "little":
        return None
    run.restype = None
    run.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    width = classes.value
    wide = threshold is np.float64  # (an Entry of 8 bytes: ``missing`` is its low word)

    def one(x: np.ndarray) -> np.ndarray:
        row = np.array(x[0], dtype=threshold)  # (a copy: the Entry array)
        missing = np.isnan(row)
        if missing.any():
            words = row.view(np.int32)
            (words[::2] if wide else words)[missing] = -1
        out = np.zeros(width, leaf)
        run(row.ctypes.data, 0, out.ctypes.data)
        return out.reshape(1, width) if multi else out

    rng = np.random.default_rng(0)
    check = rng.normal(size=(8, n_features)).astype(threshold)
    check[::3, :: max(1, n_features // 4)] = np.nan
    for r in range(check.shape[0]):
        got, want = one(check[r : r + 1]), np.asarray(many(check[r : r + 1]))
        if got.shape != want.shape or not np.array_equal(got, want, equal_nan=True):
            log.warning("%s: its own one-row predict differs from tl2cgen's; not used", lib)
            return None
    return one


def _cached_library(path: Path, key: str) -> Path:
    """Where the compiled library of ``path`` lives: beside it, or in the temporary
    directory when the repository is read-only."""
    lib = path.resolve().parent / CACHE_DIR / f"{key}.so"
    try:
        lib.parent.mkdir(exist_ok=True)
    except OSError:
        lib = Path(tempfile.gettempdir()) / "rtserve-compiled" / lib.name
        lib.parent.mkdir(exist_ok=True)
    return lib


def lleaves_engine(path: Path, kind: str, n_class: int) -> Engine:
    """Compile (or reuse the cached) lleaves library of the LightGBM ``model.txt`` at
    ``path``; one thread per call."""
    from importlib.metadata import version

    import lleaves

    key = f"lightgbm-{file_digest(path)}-ll{version('lleaves')}-llvm{version('llvmlite')}"
    lib = _cached_library(path, key)
    model = lleaves.Model(model_file=str(path))
    if lib.exists():
        model.compile(cache=str(lib))
    else:
        start = time.perf_counter()
        partial = lib.with_suffix(f".{os.getpid()}.tmp.so")
        model.compile(cache=str(partial))
        partial.replace(lib)
        log.info("%s: compiled with lleaves into %s in %.1f s",
                 path, lib, time.perf_counter() - start)  # fmt: skip
    multi = kind == "multiclass"

    def predict(x: np.ndarray) -> np.ndarray:
        out = model.predict(np.ascontiguousarray(x, dtype=np.float64), n_jobs=1)
        return out.reshape(x.shape[0], n_class) if multi else out.reshape(x.shape[0])

    return Engine("lleaves", predict, f"library {lib.name}", lib.stat().st_size)


def onnx_engine(framework: str, model: Any, n_features: int, kind: str, dtype: Any) -> Engine:
    """Convert ``model`` with onnxmltools; run it in one single-threaded ORT session."""
    import onnxmltools
    import onnxruntime as ort
    from onnxmltools.convert.common.data_types import FloatTensorType

    types = [("features", FloatTensorType([None, n_features]))]
    convert = (
        onnxmltools.convert_xgboost if framework == "xgboost" else onnxmltools.convert_lightgbm
    )
    import contextlib
    import io

    if framework == "xgboost" and model.feature_names is not None:
        model = model.copy()  # (onnxmltools reads features by position: f0, f1, ...)
        model.feature_names = None
        model.feature_types = None
    extra = {"zipmap": False} if framework == "lightgbm" and kind != "regression" else {}
    with contextlib.redirect_stdout(io.StringIO()):
        onx = convert(model, initial_types=types, target_opset=15, **extra)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    graph = onx.SerializeToString()
    session = ort.InferenceSession(graph, so, providers=["CPUExecutionProvider"])
    outputs = [o.name for o in session.get_outputs()]
    run = session.run
    if kind == "regression":
        wanted = [outputs[0]]

        def predict(x: np.ndarray) -> np.ndarray:
            return run(wanted, {"features": x.astype(np.float32, copy=False)})[0].reshape(-1)

    else:
        wanted = [outputs[-1]]  # (label, probabilities)
        binary = kind == "binary"

        def predict(x: np.ndarray) -> np.ndarray:
            p = run(wanted, {"features": x.astype(np.float32, copy=False)})[0]
            return p[:, 1] if binary else p

    return Engine("onnx", predict, "onnxmltools + ONNX Runtime TreeEnsemble", len(graph))


def check_batch(n_features: int, dtype: Any, sample: np.ndarray | None = None) -> np.ndarray:
    """Rows to compare the engines on: standard normal values (or ``sample``'s rows
    resampled), one in ten missing (NaN)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((CHECK_ROWS, n_features)) * 2
    x[rng.random(x.shape) < 0.1] = np.nan
    return x.astype(dtype)


def _median_ns(fn: Predict, x: np.ndarray, budget_s: float = 0.15, most: int = 200) -> float:
    fn(x)
    times: list[int] = []
    end = time.perf_counter() + budget_s
    while len(times) < most and (time.perf_counter() < end or len(times) < 5):
        t = time.perf_counter_ns()
        fn(x)
        times.append(time.perf_counter_ns() - t)
    return statistics.median(times)


@dataclass
class Choice:
    small: Engine  # for requests of at most SMALL_ROWS rows
    large: Engine
    report: str  # what was measured, for the log and the metadata
    valid: list[Engine]  # the engines whose answers equal the framework's


def choose(candidates: list[Engine], native: Engine, x: np.ndarray, where: str) -> Choice:
    """Drop candidates whose answers differ from ``native``'s on ``x``; time the rest at
    one row and at ``len(x)`` rows; the fastest at each."""
    reference = native.predict(x)
    valid = [native]
    for engine in candidates:
        try:
            got = np.asarray(engine.predict(x))
        except Exception as exc:
            log.warning("%s: execution %s dropped: it failed on the check batch: %s",
                        where, engine.name, exc)  # fmt: skip
            continue
        if got.shape != reference.shape or not np.allclose(
            got, reference, rtol=TOLERANCE, atol=TOLERANCE, equal_nan=True
        ):
            diff = (
                float(np.nanmax(np.abs(got.astype(np.float64) - reference)))
                if got.shape == reference.shape
                else f"shape {got.shape} vs {reference.shape}"
            )
            log.warning("%s: execution %s dropped: its answers differ from the framework's "
                        "(max difference %s > %g)", where, engine.name, diff, TOLERANCE)  # fmt: skip
            continue
        valid.append(engine)
    one = x[:1]
    timed = [(_median_ns(e.predict, one), _median_ns(e.predict, x), e) for e in valid]
    small = min(timed, key=lambda t: t[0])[2]
    large = min(timed, key=lambda t: t[1])[2]
    report = "; ".join(
        f"{e.name} {a / 1e3:.1f} us/1 row, {b / 1e3 / len(x):.2f} us/row at {len(x)}"
        for a, b, e in timed
    )
    return Choice(small, large, report, valid)
