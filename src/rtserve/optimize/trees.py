"""``rtserve optimize-trees``: the execution choices of a tree model, measured and chosen.

For an XGBoost / LightGBM / CatBoost / scikit-learn model file (what ``backend: xgboost |
lightgbm | catboost | sklearn`` serves), each way to run it is built: the framework's own
predict (the reference), treelite's compiled library, lleaves' (LightGBM), ONNX Runtime's
TreeEnsemble after onnxmltools (float32 thresholds: LightGBM's are float64), and the same
predict fed float32 features where the model keeps float64 (``datatype: FP32``). Each is
scored by its agreement with the framework's predict (the predicted class, or the value's
relative error for a regressor) on evaluation rows, and timed at one row and at batches in
alternating rounds. The fastest within the budget, past the noise band, is written as a
model directory whose ``config.yaml`` names the execution; it is loaded once as the server
would load it before the command reports success.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rtserve.optimize.errors import OptimizeError
from rtserve.optimize.evaluate import Measurement
from rtserve.optimize.report import choice_note, choose, markdown_table, noise_band

SUFFIXES = {".json": "xgboost", ".ubj": "xgboost", ".txt": "lightgbm", ".cbm": "catboost",
            ".skops": "sklearn"}  # fmt: skip
BASELINE = "native"
EVAL_ROWS = 2000


@dataclass
class TreeOptions:
    max_accuracy_drop: float = 1e-6
    rounds: int = 3
    iterations: int = 300  # timed runs per variant and size, over all rounds
    batch_sizes: tuple[int, ...] = (1, 32, 256)
    noise_band: float = 0.2
    max_batch_size: int = 256
    variants: tuple[str, ...] = ()  # () : every one that applies


@dataclass
class Variant:
    name: str
    execution: str  # what the served config names
    datatype: str | None  # FP32 / FP64 input, or None (the model's own)
    predict: Callable[[np.ndarray], np.ndarray]
    dtype: Any
    size: int
    mem_mb: float
    notes: list[str] = field(default_factory=list)


def find_model(path: pathlib.Path) -> tuple[str, pathlib.Path]:
    """(framework, file) of a model file, or of the one model file in a version directory."""
    from rtserve.runtime.trees import FILES

    if path.is_dir():
        for framework, names in FILES.items():
            for name in names:
                if (path / name).is_file() and name != "model.onnx":
                    return framework, path / name
        raise OptimizeError(
            f"{path}: no tree model file (expected one of "
            f"{', '.join(n for names in FILES.values() for n in names if n != 'model.onnx')})"
        )
    if not path.is_file():
        raise OptimizeError(f"{path}: no such file or directory")
    found = SUFFIXES.get(path.suffix)
    if found is None:
        raise OptimizeError(
            f"{path}: expected a tree model file ({', '.join(sorted(SUFFIXES))}) or its directory"
        )
    return found, path


def load_adapter(framework: str, path: pathlib.Path) -> Any:
    """The runtime's adapter of the model (errors name the file)."""
    from rtserve.config import parse_model_config
    from rtserve.errors import ConfigError
    from rtserve.runtime import trees

    config = parse_model_config({"backend": framework}, path.parent.name, str(path))
    options = trees.parse_options(config)
    loaders: dict[str, Callable[[], Any]] = {
        "xgboost": lambda: trees._xgboost(path),
        "lightgbm": lambda: trees._lightgbm(path),
        "catboost": lambda: trees._catboost(path),
        "sklearn": lambda: trees._sklearn(path, options),
    }
    try:
        return loaders[framework]()
    except ConfigError as exc:
        raise OptimizeError(str(exc)) from None
    except Exception as exc:
        raise OptimizeError(f"{path}: {framework} could not load the model: {exc}") from None


def split_values(framework: str, booster: Any) -> dict[int, np.ndarray]:
    """Each feature's split thresholds (XGBoost, LightGBM): evaluation rows drawn at and
    around them exercise every comparison, and the float32-vs-float64 edge of each."""
    if booster is None:
        return {}
    try:
        df = booster.trees_to_dataframe()
    except Exception:
        return {}
    if framework == "xgboost":
        names = list(booster.feature_names or [])
        rows = df[df["Feature"] != "Leaf"]
        feature = rows["Feature"].map(lambda f: names.index(f) if f in names else int(f[1:]))
        split = rows["Split"]
    else:
        names = list(booster.feature_name())
        rows = df[df["split_feature"].notna() & (df["decision_type"] == "<=")]
        feature = rows["split_feature"].map(names.index)
        split = rows["threshold"]
    out: dict[int, list[float]] = {}
    for f, t in zip(feature, split, strict=True):
        out.setdefault(int(f), []).append(float(t))
    return {f: np.unique(np.asarray(v, np.float64)) for f, v in out.items()}


def synthetic_rows(n_features: int, splits: dict[int, np.ndarray], rows: int = EVAL_ROWS,
                   seed: int = 0) -> np.ndarray:  # fmt: skip
    """Evaluation rows without user data: per feature, split thresholds exactly (a third),
    just above or below them (a third), or between them; standard normal for features no
    tree splits on; one value in ten missing."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, n_features))
    for f, t in splits.items():
        pick = t[rng.integers(0, len(t), rows)]
        spread = np.maximum(np.abs(pick) * 1e-3, 1e-3)
        which = rng.integers(0, 3, rows)
        x[:, f] = np.where(
            which == 0, pick, np.where(which == 1, pick + rng.uniform(-1, 1, rows) * spread,
                                       rng.uniform(t.min() - 1, t.max() + 1, rows))
        )  # fmt: skip
    x[rng.random(x.shape) < 0.1] = np.nan
    return x


def load_eval(path: pathlib.Path, n_features: int) -> np.ndarray:
    """Rows of features from ``.npy``, ``.npz`` (its ``features`` array or its only one) or
    ``.csv`` (numbers, an optional header line)."""
    if not path.is_file():
        raise OptimizeError(f"--eval {path}: no such file")
    try:
        if path.suffix == ".npy":
            x = np.load(path, allow_pickle=False)
        elif path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                key = "features" if "features" in z.files else z.files[0]
                x = z[key]
        elif path.suffix == ".csv":
            first = path.read_text().split("\n", 1)[0]
            skip = 1 if any(c.isalpha() and c not in "eEnN" for c in first) else 0
            x = np.loadtxt(path, delimiter=",", skiprows=skip, ndmin=2)
        else:
            raise OptimizeError(f"--eval {path}: expected .npy, .npz or .csv")
    except OptimizeError:
        raise
    except Exception as exc:
        raise OptimizeError(f"--eval {path}: could not read it: {exc}") from None
    if x.ndim != 2 or x.shape[1] != n_features or x.shape[0] < 1:
        raise OptimizeError(
            f"--eval {path}: expected rows of {n_features} features [n, {n_features}], "
            f"got shape {list(x.shape)}"
        )
    return x.astype(np.float64)


def _rss_mb() -> float:
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return math.nan


def build_variants(framework: str, path: pathlib.Path, adapter: Any,
                   wanted: tuple[str, ...] = ()) -> tuple[list[Variant], dict[str, str]]:  # fmt: skip
    """Every execution choice that applies (or those ``wanted``), and why others were not
    built."""
    from rtserve.runtime import tree_engines

    a = adapter
    size = path.stat().st_size
    variants = [Variant(BASELINE, "native", None, a.value, a.dtype, size, 0.0)]
    makers: list[tuple[str, str, str | None, Callable[[], Any], list[str]]] = []
    if a.dtype == np.float64:
        makers.append(("native-fp32-input", "native", "FP32",
                       lambda: tree_engines.Engine("native", a.value), ["float32 features"]))  # fmt: skip
    if a.booster is not None and path.suffix in (".json", ".ubj", ".txt"):
        makers.append(("treelite", "treelite", None, lambda: tree_engines.treelite_engine(
            framework, a.booster, path, a.n_features, a.kind), []))  # fmt: skip
    if framework == "lightgbm":
        n_class = len(a.classes)
        makers.append(("lleaves", "lleaves", None,
                       lambda: tree_engines.lleaves_engine(path, a.kind, n_class), []))  # fmt: skip
    if a.booster is not None:
        notes = ["float32 thresholds"] if framework == "lightgbm" else []
        makers.append(("onnx", "onnx", None, lambda: tree_engines.onnx_engine(
            framework, a.booster, a.n_features, a.kind, a.dtype), notes))  # fmt: skip
    skipped: dict[str, str] = {}
    for name, execution, datatype, make, notes in makers:
        if wanted and name not in wanted:
            continue
        before = _rss_mb()
        try:
            engine = make()
        except Exception as exc:
            skipped[name] = (
                f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            )
            continue
        dtype = np.float32 if datatype == "FP32" else a.dtype
        variants.append(Variant(name, execution, datatype, engine.predict, dtype,
                                engine.size or size, max(0.0, _rss_mb() - before), notes))  # fmt: skip
    if wanted:
        unknown = [w for w in wanted if w != BASELINE and w not in {m[0] for m in makers}]
        for w in unknown:
            skipped[w] = f"does not apply to a {framework} model"
    return variants, skipped


def _labels(kind: str, v: np.ndarray) -> np.ndarray:
    return (v > 0.5).astype(np.int64) if kind == "binary" else v.argmax(axis=1)


def score(kind: str, got: np.ndarray, want: np.ndarray) -> tuple[float, str, dict[str, float]]:
    """Agreement with the framework's predict: the predicted class, or 1 - the relative
    mean absolute error of a regressor's value; the largest difference either way."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if got.shape != want.shape:
        return math.nan, "agreement", {"shape_mismatch": 1.0}
    diff = np.abs(got - want)
    worst = float(np.nanmax(diff)) if diff.size else 0.0
    if np.isnan(got).sum() != np.isnan(want).sum():
        worst = math.inf
    if kind == "regression":
        scale = float(np.nanmean(np.abs(want))) or 1.0
        return (
            1.0 - float(np.nanmean(diff)) / scale,
            "1-rel_mean_abs_error",
            {"max_abs_diff": worst},
        )
    agree = float(np.mean(_labels(kind, got) == _labels(kind, want)))
    return agree, "class_agreement", {"max_abs_diff": worst}


def _time(
    fn: Callable[[np.ndarray], Any], x: np.ndarray, runs: int, budget_s: float
) -> list[float]:
    fn(x)
    times: list[float] = []
    end = time.perf_counter() + budget_s
    while len(times) < runs and (time.perf_counter() < end or len(times) < 3):
        t = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t)
    return times


def measure(variants: list[Variant], x: np.ndarray, kind: str,
            options: TreeOptions) -> list[Measurement]:  # fmt: skip
    """Scores against the baseline's answers; latency and rows/s in alternating rounds."""
    reference = variants[0].predict(x.astype(variants[0].dtype))
    out = []
    for v in variants:
        m = Measurement(v.name, v.execution, v.size, peak_mem_mb=v.mem_mb, notes=list(v.notes))
        try:
            got = v.predict(x.astype(v.dtype))
            m.score, m.score_name, m.metrics = score(kind, got, reference)
        except Exception as exc:
            m.notes.append(f"failed: {str(exc)[:120]}")
        out.append(m)
    per_round = max(1, options.iterations // options.rounds)
    feeds = {b: np.ascontiguousarray(x[np.arange(b) % len(x)]) for b in options.batch_sizes}
    medians: dict[tuple[int, int], list[float]] = {}
    pooled: dict[int, list[float]] = {}
    for _ in range(options.rounds):
        for i, v in enumerate(variants):
            if math.isnan(out[i].score):
                continue
            for b, feed in feeds.items():
                t = _time(v.predict, feed.astype(v.dtype), per_round, 1.0 / options.rounds)
                medians.setdefault((i, b), []).append(float(np.median(t)))
                if b == options.batch_sizes[0]:
                    pooled.setdefault(i, []).extend(t)
    first = options.batch_sizes[0]
    for i, m in enumerate(out):
        if (i, first) not in medians:
            continue
        m.round_p50_ms = [r * 1e3 for r in medians[(i, first)]]
        m.p50_ms = min(m.round_p50_ms)
        m.p99_ms = max(float(np.percentile(pooled[i], 99)) * 1e3, m.p50_ms)
        m.throughput = {b: b / min(medians[(i, b)]) for b in options.batch_sizes}
        m.round_throughput = {b: [b / r for r in medians[(i, b)]] for b in options.batch_sizes}
    return out


@dataclass
class TreeResult:
    framework: str
    kind: str
    measurements: list[Measurement]
    chosen: Measurement | None
    variants: list[Variant]
    skipped: dict[str, str]
    noise: float
    note: str

    def table(self, max_drop: float) -> str:
        chosen = self.chosen.name if self.chosen else None
        text = markdown_table(self.measurements, BASELINE, 1.0, max_drop, chosen, self.noise)
        if self.note:
            text += f"\n{self.note}\n"
        for name, why in self.skipped.items():
            text += f"\n- `{name}` not measured: {why}"
        return text + ("\n" if self.skipped else "")


def run_trees(model: pathlib.Path, options: TreeOptions,
              eval_path: pathlib.Path | None = None) -> tuple[TreeResult, pathlib.Path]:  # fmt: skip
    framework, path = find_model(model)
    adapter = load_adapter(framework, path)
    if eval_path is not None:
        x = load_eval(eval_path, adapter.n_features)
    else:
        x = synthetic_rows(adapter.n_features, split_values(framework, adapter.booster))
    if framework in ("catboost", "sklearn"):
        x = np.nan_to_num(x)  # (categorical columns, imputers: no NaN by default)
    variants, skipped = build_variants(framework, path, adapter, options.variants)
    measurements = measure(variants, x, adapter.kind, options)
    noise = noise_band(measurements[0], options.noise_band)
    chosen = choose(measurements, 1.0, options.max_accuracy_drop, BASELINE, noise)
    note = choice_note(measurements, 1.0, options.max_accuracy_drop, BASELINE, noise)
    result = TreeResult(
        framework, adapter.kind, measurements, chosen, variants, skipped, noise, note
    )
    return result, path


def publish_tree(out: pathlib.Path, result: TreeResult, source: pathlib.Path,
                 max_batch_size: int, max_drop: float) -> pathlib.Path:  # fmt: skip
    """``out/config.yaml`` naming the chosen execution, ``out/1/<model file>`` and
    ``out/optimization.json``; loaded once as the server would. Returns the config."""
    import yaml

    from rtserve.config import parse_model_config
    from rtserve.runtime import trees

    assert result.chosen is not None
    if not out.name or out.name in (".", ".."):
        raise OptimizeError(f"--out must be REPO/NAME, got {out}")
    variant = next(v for v in result.variants if v.name == result.chosen.name)
    section: dict[str, Any] = {"execution": variant.execution}
    if variant.datatype:
        section["datatype"] = variant.datatype
    config = {"backend": result.framework, "max_batch_size": max_batch_size,
              result.framework: section}  # fmt: skip
    version = out / "1"
    version.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, version / source.name)
    text = f"# written by rtserve optimize-trees: {result.chosen.name} was chosen\n"
    text += yaml.safe_dump(config, sort_keys=False)
    (out / "config.yaml").write_text(text)
    record = {
        "chosen": result.chosen.name,
        "execution": variant.execution,
        "datatype": variant.datatype,
        "max_accuracy_drop": max_drop,
        "noise_band": result.noise,
        "rule": "fastest at one row within the agreement budget, beyond the noise band",
        "measurements": [m.as_dict() for m in result.measurements],
        "skipped": result.skipped,
    }
    (out / "optimization.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    parsed = parse_model_config(config, out.name, str(out / "config.yaml"))
    try:
        trees.load(parsed, version).close()
    except Exception as exc:
        raise OptimizeError(
            f"{out / 'config.yaml'}: the written model does not load: {exc}"
        ) from None
    return out / "config.yaml"


def cmd_optimize_trees(args: argparse.Namespace) -> int:
    from rtserve.optimize.args import check_folder, number

    number(args, "max_accuracy_drop", 0.0, 1.0, False)
    number(args, "noise_band", 0.0, 10.0, False)
    for name in ("rounds", "iterations", "batch", "max_batch_size"):
        if getattr(args, name) < 1:
            raise OptimizeError(
                f"--{name.replace('_', '-')}: expected at least 1, got {getattr(args, name)}"
            )
    out = pathlib.Path(args.out)
    work = (
        pathlib.Path(args.work)
        if args.work
        else pathlib.Path("optimize-out") / (out.resolve().name or "model")
    )
    check_folder(out, "--out")
    check_folder(work, "--work")
    work.mkdir(parents=True, exist_ok=True)
    wanted = tuple(v.strip() for v in args.variants.split(",")) if args.variants else ()
    options = TreeOptions(
        max_accuracy_drop=args.max_accuracy_drop, rounds=args.rounds, iterations=args.iterations,
        batch_sizes=(1, args.batch), noise_band=args.noise_band,
        max_batch_size=args.max_batch_size, variants=wanted,
    )  # fmt: skip
    result, source = run_trees(pathlib.Path(args.model), options,
                               pathlib.Path(args.eval) if args.eval else None)  # fmt: skip
    table = result.table(options.max_accuracy_drop)
    head = (f"{source} ({result.framework} {result.kind}): execution choices against "
            f"{result.framework}'s own predict\n\n")  # fmt: skip
    (work / "report.md").write_text(head + table)
    print(head + table)
    print(f"report: {work / 'report.md'}")
    if wanted and all(w in result.skipped for w in wanted):
        print(f"error: none of --variants {args.variants} could be built; nothing written",
              file=sys.stderr)  # fmt: skip
        return 1
    if result.chosen is None:
        print(f"error: no execution stays within --max-accuracy-drop {options.max_accuracy_drop}; "
              "nothing written", file=sys.stderr)  # fmt: skip
        return 1
    config = publish_tree(out, result, source, options.max_batch_size, options.max_accuracy_drop)
    print(f"chose {result.chosen.name}: wrote {config} and {out / '1' / source.name}")
    return 0


def register(subparsers: Any) -> None:
    """Add ``optimize-trees`` to an argparse subparsers action."""
    from rtserve.optimize.args import guard

    p = subparsers.add_parser(
        "optimize-trees",
        help="measure a tree model's execution choices and write the fastest that agrees",
        description="Build each way to run an XGBoost / LightGBM / CatBoost / scikit-learn "
        "model (the framework's predict, treelite, lleaves, ONNX Runtime, float32 features), "
        "measure agreement with the framework and latency on this machine, and write the "
        "fastest within the budget as a model directory.",
    )
    p.add_argument(
        "model", help="model file (model.json, .ubj, model.txt, .cbm, .skops) or its folder"
    )
    p.add_argument(
        "--out", required=True, help="REPO/NAME: where the chosen variant is written (required)"
    )
    p.add_argument("--work", help="folder for the report (default: optimize-out/NAME)")
    p.add_argument("--eval", help="evaluation rows (.npy, .npz, .csv) [n, features] (default: "
                   "rows drawn at and around the model's split thresholds, 10%% missing)")  # fmt: skip
    p.add_argument("--variants", help="comma list of native-fp32-input,treelite,lleaves,onnx "
                   "(default: every one that applies)")  # fmt: skip
    p.add_argument("--max-accuracy-drop", type=float, default=1e-6,
                   help="budget: agreement with the framework's predict may fall by this much "
                   "(default: %(default)s: the same answers)")  # fmt: skip
    p.add_argument("--noise-band", type=float, default=0.2,
                   help="a variant must beat the framework's predict at one row by more than "
                   "this fraction (or the run's own spread) (default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--rounds", type=int, default=3, help="alternating rounds (default: %(default)s)"
    )
    p.add_argument("--iterations", type=int, default=300,
                   help="timed runs per variant and batch size (default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--batch", type=int, default=256, help="rows of the batch timed (default: %(default)s)"
    )
    p.add_argument("--max-batch-size", type=int, default=256,
                   help="max_batch_size of the written config.yaml (default: %(default)s)")  # fmt: skip
    p.set_defaults(func=guard(cmd_optimize_trees))


def main(argv: list[str] | None = None) -> int:
    from rtserve.optimize.args import run_command

    return run_command(register, argv)


if __name__ == "__main__":
    raise SystemExit(main())
