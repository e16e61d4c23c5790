"""``rtserve export-edge``: the files that ship to phones and ARM boards, measured with the
runtime that will run them there.

- ``--format litert``: a torch model -> ``model.tflite`` (FP32) and, with ``--int8``,
  ``model-int8.tflite`` (PT2E static INT8 calibrated on ``--calibration``), converted by
  ``litert-torch`` (in this interpreter when it has it, else in ``--converter-python``).
- ``--format ort``: an ONNX file (or a torch model, exported first) -> ``model.ort`` and,
  with ``--int8``, ``model-int8.ort`` (static QDQ INT8), by
  ``onnxruntime.tools.convert_onnx_models_to_ort``, which also writes the operator config
  for an ONNX Runtime minimal build (``required_operators.config``).

Each file is then loaded by its edge runtime (``ai_edge_litert.interpreter.Interpreter``;
ONNX Runtime loading the ``.ort``) and measured: size, load time, latency p50/p99 at 1 and
2 threads at the exported batch, and agreement with the FP32 reference (the torch model,
or the source ONNX on ONNX Runtime). ``report.json`` and ``report.md`` hold the results.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from rtserve.optimize.errors import OptimizeError
from rtserve.optimize.evaluate import SETTLE_S

if TYPE_CHECKING:
    import torch

Runner = Callable[[dict[str, np.ndarray]], list[np.ndarray]]
FORMATS = ("litert", "ort")
CONVERTER_ENV = "RTSERVE_LITERT_PYTHON"
ORT_OPS_CONFIG = "required_operators.config"


@dataclass
class EdgeResult:
    """One edge file as its runtime runs it."""

    name: str
    format: str
    path: str
    size_bytes: int
    load_ms: float = float("nan")
    latency_ms: dict[int, tuple[float, float]] = field(default_factory=dict)  # threads: p50, p99
    score: float = float("nan")
    score_name: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    max_abs_diff: float = float("nan")

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["latency_ms"] = {str(t): {"p50": v[0], "p99": v[1]} for t, v in self.latency_ms.items()}
        return d


@dataclass
class EdgeRequest:
    """What to export and how to measure it."""

    fmt: str
    out: pathlib.Path
    example: dict[str, np.ndarray]
    output_names: list[str]
    eval_data: dict[str, np.ndarray]
    labels: np.ndarray | None = None
    calibration: dict[str, np.ndarray] | None = None
    converter_python: str | None = None
    threads: tuple[int, ...] = (1, 2)
    iterations: int = 200
    rounds: int = 3
    target_platform: str = field(default_factory=lambda: this_platform())


def this_platform() -> str:
    """The ORT converter's name for this machine: its platform-specific fusions (NCHWc on
    amd64) are only baked into an ``.ort`` built for the platform that runs it."""
    import platform

    return "arm" if platform.machine().lower() in ("aarch64", "arm64") else "amd64"


def open_runner(path: pathlib.Path, threads: int) -> Runner:
    """A function running one feed on ``path``'s edge runtime: the LiteRT interpreter for
    ``.tflite`` (INT8 inputs/outputs converted as the server converts them), ONNX Runtime
    for ``.ort`` / ``.onnx``. Outputs in the model's order."""
    if path.suffix == ".tflite":
        from rtserve.runtime.litert import open_instance

        instance = open_instance(path, threads)
        return lambda feed: list(instance.run(feed).values())
    from rtserve.optimize.evaluate import open_session

    session = open_session(path, threads=threads)
    return lambda feed: list(session.run(None, feed))


def _chunks(data: Mapping[str, np.ndarray], batch: int) -> list[dict[str, np.ndarray]]:
    """Whole batches of ``batch`` rows (an edge model's batch is fixed)."""
    rows = len(next(iter(data.values())))
    return [
        {k: np.ascontiguousarray(v[i : i + batch]) for k, v in data.items()}
        for i in range(0, rows - batch + 1, batch)
    ]


def run_all(runner: Runner, data: Mapping[str, np.ndarray], batch: int) -> np.ndarray:
    """The first output over every whole batch of ``data``."""
    return np.concatenate([runner(feed)[0] for feed in _chunks(data, batch)], axis=0)


def load_ms(path: pathlib.Path, loads: int = 3) -> float:
    """Median time to open ``path`` in its runtime, ready to run (this process, runtime
    already imported)."""
    times = []
    for _ in range(loads):
        t0 = time.perf_counter()
        open_runner(path, 1)
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def time_alternating(
    runners: Mapping[str, Runner], feed: dict[str, np.ndarray], iterations: int, rounds: int
) -> dict[str, tuple[float, float]]:
    """p50 / p99 ms of each runner on ``feed``, taking turns over ``rounds`` rounds: p50 from
    each runner's least disturbed round, p99 over all rounds (as ``measure_latencies``)."""
    per_round = max(1, iterations // rounds)
    times: dict[str, list[float]] = {n: [] for n in runners}
    medians: dict[str, list[float]] = {n: [] for n in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            time.sleep(SETTLE_S)  # (the previous runner's threads stop spinning)
            run(feed)
            got = []
            for _ in range(per_round):
                t0 = time.perf_counter()
                run(feed)
                got.append(time.perf_counter() - t0)
            times[name] += got
            medians[name].append(float(np.median(got)))
    return {n: (min(medians[n]) * 1e3, float(np.percentile(times[n], 99)) * 1e3) for n in runners}


def measure(
    files: Mapping[str, pathlib.Path],
    req: EdgeRequest,
    reference: np.ndarray,
) -> list[EdgeResult]:
    """Size, load time, latency at each thread count and accuracy of every file."""
    from rtserve.optimize.evaluate import accuracy_metrics, infer_task

    batch = len(next(iter(req.example.values())))
    task = infer_task(reference, req.output_names[0], req.labels)
    results = []
    for name, path in files.items():
        r = EdgeResult(name, _format_of(path), str(path), path.stat().st_size)
        r.load_ms = load_ms(path)
        out = run_all(open_runner(path, 1), req.eval_data, batch).astype(np.float64)
        ref = reference[: len(out)].astype(np.float64)
        labels = req.labels[: len(out)] if req.labels is not None else None
        r.score, r.score_name, r.metrics = accuracy_metrics(task, out, ref, labels)
        r.max_abs_diff = float(np.max(np.abs(out - ref)))
        results.append(r)
    feed = _chunks(req.eval_data, batch)[0]
    for threads in req.threads:
        runners = {name: open_runner(path, threads) for name, path in files.items()}
        timed = time_alternating(runners, feed, req.iterations, req.rounds)
        for r in results:
            r.latency_ms[threads] = timed[r.name]
    return results


def _format_of(path: pathlib.Path) -> str:
    return {".tflite": "litert", ".ort": "ort", ".onnx": "onnx"}[path.suffix]


def _reference_torch(
    model: torch.nn.Module, data: Mapping[str, np.ndarray], names: int = 0
) -> np.ndarray:
    """The model's first output on ``data``; ``names``: how many output names were given
    (they must match the outputs)."""
    import torch

    outs = []
    with torch.no_grad():
        for feed in _chunks(data, 1):
            result = model(*(torch.from_numpy(v) for v in feed.values()))
            count = 1 if isinstance(result, torch.Tensor) else len(result)
            if names and count != names:
                raise OptimizeError(
                    f"--output-name: {names} name(s) (default: one, 'output'), but the model "
                    f"returns {count} outputs; name each"
                )
            first = result if isinstance(result, torch.Tensor) else result[0]
            outs.append(first.numpy())
    return np.concatenate(outs, axis=0)


def _has_litert_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("litert_torch") is not None


def export_litert(model: torch.nn.Module, req: EdgeRequest) -> dict[str, pathlib.Path]:
    """``model.tflite`` (and ``model-int8.tflite`` with calibration data): converted here
    when litert-torch imports, else in the converter interpreter (one run for both)."""
    files = {"litert-fp32": req.out / "model.tflite"}
    if req.calibration is not None:
        files["litert-int8"] = req.out / "model-int8.tflite"
    python = req.converter_python or os.environ.get(CONVERTER_ENV)
    if python is None and _has_litert_torch():
        from rtserve.optimize.litert_convert import convert

        convert(model, req.example, files["litert-fp32"], req.output_names)
        if req.calibration is not None:
            convert(model, req.example, files["litert-int8"], req.output_names, req.calibration)
        return files
    if python is None:
        raise OptimizeError(
            "--format litert needs litert-torch: pip install litert-torch in this "
            "environment, or in another one and pass its python with --converter-python "
            f"(or {CONVERTER_ENV}); `make edge-converter` builds one"
        )
    _convert_elsewhere(python, model, req, files)
    return files


def _convert_elsewhere(
    python: str, model: torch.nn.Module, req: EdgeRequest, files: dict[str, pathlib.Path]
) -> None:
    """Run :mod:`rtserve.optimize.litert_convert` in ``python``; the model travels as a
    ``torch.export`` program, the data as ``.npz``."""
    import torch

    import rtserve

    with tempfile.TemporaryDirectory(prefix="rtserve-litert-") as tmp:
        work = pathlib.Path(tmp)
        # Only the rtserve package on the path: not the site-packages it is installed in.
        (work / "path").mkdir()
        (work / "path" / "rtserve").symlink_to(pathlib.Path(rtserve.__file__).parent)
        args = tuple(torch.from_numpy(v) for v in req.example.values())
        try:
            torch.export.save(torch.export.export(model, args), str(work / "model.pt2"))
        except Exception as exc:
            raise OptimizeError(f"torch.export of the model failed: {exc}") from exc
        np.savez(work / "example.npz", **req.example)
        cmd = [python, "-m", "rtserve.optimize.litert_convert", str(work / "model.pt2")]
        cmd += ["--example", str(work / "example.npz"), "--out", str(files["litert-fp32"])]
        if req.calibration is not None:
            np.savez(work / "calibration.npz", **req.calibration)
            cmd += ["--int8-out", str(files["litert-int8"])]
            cmd += ["--calibration", str(work / "calibration.npz")]
        for name in req.output_names:
            cmd += ["--output-name", name]
        env = {**os.environ, "PYTHONPATH": str(work / "path")}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0 or not all(p.is_file() for p in files.values()):
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise OptimizeError(f"LiteRT conversion in {python} failed:\n{tail}")


def export_ort(onnx_path: pathlib.Path, req: EdgeRequest) -> dict[str, pathlib.Path]:
    """``.ort`` files of the FP32 model (and its static INT8) plus the minimal build's
    operator config, all in ``req.out``."""
    from rtserve.optimize.quantize import prepare_for_static, quantize_static_int8

    staging = req.out / "onnx"
    staging.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(onnx_path, staging / "model.onnx")
    if req.calibration is not None:
        prepared = prepare_for_static(onnx_path, req.out / "work" / "prepared.onnx")
        quantize_static_int8(prepared, staging / "model-int8.onnx", req.calibration)
    convert_to_ort(staging, req.out, req.target_platform)
    files = {"ort-fp32": req.out / "model.ort"}
    if req.calibration is not None:
        files["ort-int8"] = req.out / "model-int8.ort"
    missing = [str(p) for p in [*files.values(), req.out / ORT_OPS_CONFIG] if not p.is_file()]
    if missing:
        raise OptimizeError(f"the ORT converter did not write {', '.join(missing)}")
    return files


def convert_to_ort(staging: pathlib.Path, out: pathlib.Path, target_platform: str) -> None:
    """Every ``.onnx`` in ``staging`` to ``out/<stem>.ort`` (runtime optimizations for
    ``target_platform`` baked in), plus the minimal build's operator config."""
    cmd = [sys.executable, "-m", "onnxruntime.tools.convert_onnx_models_to_ort", str(staging)]
    cmd += ["--output_dir", str(out), "--optimization_style", "Fixed"]
    cmd += ["--target_platform", target_platform]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise OptimizeError(f"conversion to the ORT format failed:\n{tail}")


def markdown(results: Sequence[EdgeResult], threads: Sequence[int]) -> str:
    head = ["file", "format", "size", "load (ms)"]
    head += [f"p50 / p99 {t} thread{'s' if t > 1 else ''} (ms)" for t in threads]
    head += ["accuracy", "max abs diff vs FP32"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [f"`{pathlib.Path(r.path).name}`", r.format, _size(r.size_bytes)]
        cells.append(f"{r.load_ms:.1f}")
        cells += [f"{r.latency_ms[t][0]:.3f} / {r.latency_ms[t][1]:.3f}" for t in threads]
        cells += [f"{r.score:.4f} ({r.score_name})", f"{r.max_abs_diff:.3g}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _size(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} KB"


def write_report(
    results: Sequence[EdgeResult], req: EdgeRequest, reference: dict[str, Any]
) -> pathlib.Path:
    (req.out / "report.json").write_text(
        json.dumps({"reference": reference, "results": [r.as_dict() for r in results]}, indent=2)
        + "\n"
    )
    rows = len(next(iter(req.eval_data.values())))
    text = (
        f"# Edge export ({req.fmt})\n\n"
        f"{markdown(results, req.threads)}\n"
        f"FP32 reference ({reference['runtime']}): {reference['score']:.4f} "
        f"{reference['score_name']}. "
        f"Accuracy on {rows} rows (agreement with the reference unless labels are given); batch "
        f"{len(next(iter(req.example.values())))}, {req.iterations} runs per thread count "
        f"in {req.rounds} alternating rounds (p50: least disturbed round).\n"
    )
    path = req.out / "report.md"
    path.write_text(text)
    return path


def export_edge(source: torch.nn.Module | pathlib.Path, req: EdgeRequest) -> list[EdgeResult]:
    """Export ``source`` (a torch model, or for ``ort`` also an ONNX file), measure every
    file and write the report; the results, FP32 reference runtime first for ``ort``."""
    req.out.mkdir(parents=True, exist_ok=True)
    batch = len(next(iter(req.example.values())))
    if req.fmt == "litert":
        if isinstance(source, pathlib.Path):
            raise OptimizeError(
                f"--format litert converts a torch model, not {source.name}: give its import "
                "path or a .pt2 file (no ONNX -> LiteRT route installs here)"
            )
        reference = _reference_torch(source, req.eval_data, len(req.output_names))
        files = export_litert(source, req)
    elif req.fmt == "ort":
        onnx_path = source if isinstance(source, pathlib.Path) else _to_onnx(source, req)
        reference = run_all(open_runner(onnx_path, 1), req.eval_data, batch)
        files = {"onnx-fp32": onnx_path, **export_ort(onnx_path, req)}
    else:
        raise OptimizeError(f"--format: expected one of {', '.join(FORMATS)}, got {req.fmt!r}")
    results = measure(files, req, reference)
    write_report(results, req, _reference_info(req, reference))
    return results


def _reference_info(req: EdgeRequest, reference: np.ndarray) -> dict[str, Any]:
    from rtserve.optimize.evaluate import accuracy_metrics, infer_task

    task = infer_task(reference, req.output_names[0], req.labels)
    score, name, _ = accuracy_metrics(task, reference, reference, req.labels)
    runtime = "torch" if req.fmt == "litert" else "onnxruntime, the source .onnx"
    return {"runtime": runtime, "score": score, "score_name": name}


def _to_onnx(model: torch.nn.Module, req: EdgeRequest) -> pathlib.Path:
    from rtserve.optimize.export import export_module

    return export_module(model, req.out / "work" / "source.onnx", req.example, req.output_names)


def _thread_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(t) for t in text.split(","))
    except ValueError:
        counts = ()
    if not counts or any(c < 1 for c in counts):
        raise OptimizeError(f"--threads: expected thread counts >= 1 joined by ',', got {text!r}")
    return counts


def _eval_data(args: argparse.Namespace, example: dict[str, np.ndarray]) -> Any:
    from rtserve.optimize.data import InputSpec, load_data
    from rtserve.optimize.export import random_inputs

    specs = [InputSpec(n, a.dtype.type, (None, *a.shape[1:])) for n, a in example.items()]
    calibration = None
    if args.calibration:
        calibration, _ = load_data(pathlib.Path(args.calibration), specs)
    if args.eval:
        data, labels = load_data(pathlib.Path(args.eval), specs, args.labels)
    elif calibration is not None:
        data, labels = calibration, None
    else:
        data, labels = random_inputs(example, 64, seed=0), None
    return data, labels, calibration


def _example_for_onnx(path: pathlib.Path, batch: int) -> dict[str, np.ndarray]:
    from rtserve.optimize.data import model_inputs

    return {
        s.name: np.zeros(
            [batch, *(d if isinstance(d, int) and d > 0 else 1 for d in s.shape[1:])], s.dtype
        )
        for s in model_inputs(path)
    }


def cmd_export_edge(args: argparse.Namespace) -> int:
    from rtserve.optimize.args import at_least, load_module_here, parse_shape

    if args.int8 and not args.calibration:
        raise OptimizeError("--int8 needs --calibration (an .npz keyed by input name)")
    at_least(args, {"batch": 1, "iterations": 1})
    threads = _thread_counts(args.threads)
    if args.converter_python and not os.access(args.converter_python, os.X_OK | os.R_OK):
        raise OptimizeError(f"--converter-python {args.converter_python}: not an executable")
    if args.converter_python and pathlib.Path(args.converter_python).is_dir():
        raise OptimizeError(f"--converter-python {args.converter_python}: a folder, not a python")
    try:
        pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OptimizeError(f"--out {args.out}: cannot make the folder ({exc.strerror})") from None
    source: torch.nn.Module | pathlib.Path
    path = pathlib.Path(args.model)
    if path.suffix == ".onnx":
        source = path
        example = _example_for_onnx(path, args.batch)
    else:
        if not args.input:
            raise OptimizeError("a torch model needs --input NAME:DIMS[:DTYPE] (e.g. x:1x64)")
        source = load_module_here(args.model)
        example = {}
        for spec in args.input:
            name, shape, dtype = parse_shape(spec)
            example[name] = np.zeros(shape, dtype=np.dtype(dtype))
    data, labels, calibration = _eval_data(args, example)
    short = [k for k, v in data.items() if len(v) < len(example[k])]
    if short:
        raise OptimizeError(
            f"--eval / --calibration: input {short[0]} has {len(data[short[0]])} row(s), fewer "
            f"than the exported batch of {len(example[short[0]])}"
        )
    example = {k: np.ascontiguousarray(v[: len(example[k])]) for k, v in data.items()}
    req = EdgeRequest(
        fmt=args.format,
        out=pathlib.Path(args.out),
        example=example,
        output_names=args.output_name or ["output"],
        eval_data=data,
        labels=labels,
        calibration=calibration if args.int8 else None,
        converter_python=args.converter_python,
        threads=threads,
        iterations=args.iterations,
        target_platform=args.target_platform or this_platform(),
    )
    results = export_edge(source, req)
    print(markdown(results, req.threads))
    print(f"report: {req.out / 'report.md'} and {req.out / 'report.json'}")
    return 0


def register(subparsers: Any) -> None:
    """Add ``export-edge`` to an argparse subparsers action."""
    from rtserve.optimize.args import guard

    e = subparsers.add_parser(
        "export-edge",
        help="write a .tflite (LiteRT) or .ort (ONNX Runtime) file and measure it on its runtime",
        description=__doc__.splitlines()[0].replace("``", "") if __doc__ else None,
    )
    e.add_argument(
        "model",
        help="import path 'pkg.module:name', a .pt2 / .pt file, or (--format ort) an .onnx file",
    )
    e.add_argument("--format", required=True, choices=FORMATS, help="edge format (required)")
    e.add_argument("--out", required=True, help="folder for the files and report (required)")
    e.add_argument(
        "--input",
        action="append",
        help="NAME:DIMS[:DTYPE] of a torch model's input at the exported batch, e.g. "
        "x:1x64:float32; repeat per input",
    )
    e.add_argument(
        "--output-name", action="append", help="output name(s); repeat (default: output)"
    )
    e.add_argument(
        "--int8",
        action="store_true",
        help="also write a static INT8 file (model-int8.*), calibrated on --calibration",
    )
    e.add_argument("--calibration", help=".npz by input name: INT8 calibration data")
    e.add_argument(
        "--eval",
        help=".npz by input name to measure accuracy on (default: --calibration, else 64 "
        "random rows)",
    )
    e.add_argument("--labels", type=pathlib.Path, help="labels for --eval (default: none)")
    e.add_argument(
        "--batch", type=int, default=1, help="exported batch of an .onnx source (default: 1)"
    )
    e.add_argument(
        "--threads", default="1,2", help="thread counts to time, comma list (default: 1,2)"
    )
    e.add_argument(
        "--iterations", type=int, default=200, help="timed runs per thread count (default: 200)"
    )
    e.add_argument(
        "--target-platform",
        choices=["arm", "amd64"],
        help="--format ort: the platform whose fusions the .ort bakes in (default: this "
        "machine's; arm for phones and ARM boards)",
    )
    e.add_argument(
        "--converter-python",
        help=f"a python with litert-torch, when this one lacks it (default: ${CONVERTER_ENV})",
    )
    e.set_defaults(func=guard(cmd_export_edge))
