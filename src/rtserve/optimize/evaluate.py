"""Measure a variant: size on disk, latency, throughput, peak memory and accuracy.

Every variant runs on ONNX Runtime's CPU provider with fixed thread counts so that the
ratios between variants of one run are comparable. Accuracy is the task accuracy when
labels are given, otherwise agreement with the FP32 reference outputs.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

from rtserve.optimize.errors import OptimizeError

Task = Literal["classification", "embedding", "regression"]

DEFAULT_THREADS = 2


@dataclass
class Measurement:
    """What one variant costs and how well it agrees with the reference."""

    name: str
    path: str
    size_bytes: int
    p50_ms: float = float("nan")
    p99_ms: float = float("nan")
    throughput: dict[int, float] = field(default_factory=dict)  # rows per second by batch size
    peak_mem_mb: float = float("nan")
    score: float = float("nan")  # the figure the accuracy budget applies to (higher is better)
    score_name: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    round_p50_ms: list[float] = field(default_factory=list)  # batch-1 median of each round
    # rows per second by batch size in each round (from that round's median)
    round_throughput: dict[int, list[float]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["throughput"] = {str(k): v for k, v in self.throughput.items()}
        d["round_throughput"] = {str(k): v for k, v in self.round_throughput.items()}
        return d


def open_session(
    path: pathlib.Path | str | bytes,
    threads: int = DEFAULT_THREADS,
    graph_optimization: Any = None,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    optimized_model_path: pathlib.Path | None = None,
) -> Any:
    """An InferenceSession with fixed threads; errors name the file and the failing node."""
    import onnxruntime as ort

    if isinstance(path, str | pathlib.Path) and not pathlib.Path(path).is_file():
        raise OptimizeError(f"model file {path} does not exist")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3
    opts.graph_optimization_level = (
        graph_optimization
        if graph_optimization is not None
        else ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    )
    if optimized_model_path is not None:
        opts.optimized_model_filepath = str(optimized_model_path)
    source = str(path) if isinstance(path, pathlib.Path) else path
    try:
        return ort.InferenceSession(source, sess_options=opts, providers=list(providers))
    except Exception as exc:
        from rtserve.optimize.check import explain_load_failure

        raise OptimizeError(explain_load_failure(path, exc)) from exc


def _rows(data: Mapping[str, np.ndarray]) -> int:
    return len(next(iter(data.values())))


def run_batched(session: Any, data: Mapping[str, np.ndarray], batch_size: int = 32) -> np.ndarray:
    """The first output for all rows of ``data``, run ``batch_size`` rows at a time."""
    n = _rows(data)
    outs = []
    for i in range(0, n, batch_size):
        feed = {k: v[i : i + batch_size] for k, v in data.items()}
        outs.append(session.run(None, feed)[0])
    return np.concatenate(outs, axis=0)


def _take_rows(data: Mapping[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
    n = _rows(data)
    idx = np.arange(batch) % n
    return {k: np.ascontiguousarray(v[idx]) for k, v in data.items()}


def measure_latency(
    session: Any,
    data: Mapping[str, np.ndarray],
    batch_sizes: Sequence[int] = (1, 8, 32),
    iterations: int = 100,
    max_seconds: float = 3.0,
    warmup: int = 3,
) -> tuple[float, float, dict[int, float]]:
    """p50 / p99 milliseconds at the first batch size and rows/s at every batch size.

    Each batch size runs up to ``iterations`` times or ``max_seconds``, whichever ends
    first (so a slow variant still finishes), with the rows cycling through ``data``.
    """
    p50 = p99 = float("nan")
    throughput: dict[int, float] = {}
    for bs in batch_sizes:
        feed = _take_rows(data, bs)
        for _ in range(warmup):
            session.run(None, feed)
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < iterations and (time.perf_counter() - start) < max_seconds:
            t0 = time.perf_counter()
            session.run(None, feed)
            times.append(time.perf_counter() - t0)
        arr = np.asarray(times)
        if bs == batch_sizes[0]:
            p50 = float(np.percentile(arr, 50) * 1e3)
            p99 = float(np.percentile(arr, 99) * 1e3)
        throughput[bs] = float(bs / np.median(arr))
    return p50, p99, throughput


_PEAK_SCRIPT = """
import sys
import numpy as np
import onnxruntime as ort


def status(key):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(key + ":"))


# The high-water mark is inherited from the parent process: reset it to the current size.
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")
before = status("VmRSS")
opts = ort.SessionOptions()
opts.intra_op_num_threads = int(sys.argv[3])
opts.inter_op_num_threads = 1
opts.log_severity_level = 3
session = ort.InferenceSession(sys.argv[1], sess_options=opts, providers=["CPUExecutionProvider"])
with np.load(sys.argv[2]) as z:
    feed = {k: z[k] for k in z.files}
session.run(None, feed)
print(status("VmHWM") - before)
"""


def peak_memory_mb(
    path: pathlib.Path,
    data: Mapping[str, np.ndarray],
    batch: int = 32,
    threads: int = DEFAULT_THREADS,
) -> float:
    """Peak resident memory added by loading ``path`` and running one batch, in MB.

    Measured in a fresh interpreter (after numpy and onnxruntime are imported), so one
    variant's allocations cannot hide inside another's freed memory.
    """
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rtserve-mem-") as tmp:
        feed = pathlib.Path(tmp) / "feed.npz"
        np.savez(feed, **_take_rows(data, batch))
        proc = subprocess.run(
            [sys.executable, "-c", _PEAK_SCRIPT, str(path), str(feed), str(threads)],
            capture_output=True,
            text=True,
            check=False,
        )
    if proc.returncode != 0:
        return float("nan")
    try:
        return float(proc.stdout.strip().splitlines()[-1]) / 1024.0
    except (ValueError, IndexError):
        return float("nan")


def infer_task(
    outputs: np.ndarray, output_name: str = "", labels: np.ndarray | None = None
) -> Task:
    """Guess the task from the reference outputs: labels or a 2-D score matrix mean classification."""
    if labels is not None:
        return "classification"
    if output_name.lower().startswith("embed"):
        return "embedding"
    if outputs.ndim == 2 and outputs.shape[1] > 1:
        norms = np.linalg.norm(outputs, axis=1)
        if np.allclose(norms, 1.0, atol=1e-3):
            return "embedding"
        return "classification"
    return "regression"


def accuracy_metrics(
    task: Task,
    outputs: np.ndarray,
    reference: np.ndarray,
    labels: np.ndarray | None = None,
) -> tuple[float, str, dict[str, float]]:
    """(score, score name, all metrics): the score is what the accuracy budget applies to."""
    if outputs.shape != reference.shape:
        raise OptimizeError(
            f"variant output shape {outputs.shape} differs from the reference {reference.shape}"
        )
    out = outputs.astype(np.float64)
    ref = reference.astype(np.float64)
    if task == "classification":
        flat_out = out.reshape(len(out), -1)
        flat_ref = ref.reshape(len(ref), -1)
        agreement = float(np.mean(flat_out.argmax(1) == flat_ref.argmax(1)))
        metrics = {"top1_agreement": agreement}
        if labels is not None:
            acc = float(np.mean(flat_out.argmax(1) == labels.reshape(-1)))
            metrics["accuracy"] = acc
            return acc, "accuracy", metrics
        return agreement, "top1_agreement", metrics
    if task == "embedding":
        a = out.reshape(len(out), -1)
        b = ref.reshape(len(ref), -1)
        denom = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
        cos = np.sum(a * b, axis=1) / np.maximum(denom, 1e-12)
        metrics = {"cosine_mean": float(cos.mean()), "cosine_min": float(cos.min())}
        return metrics["cosine_mean"], "cosine_mean", metrics
    err = np.abs(out - ref)
    scale = float(np.mean(np.abs(ref))) or 1.0
    metrics = {
        "max_abs_error": float(err.max()),
        "mean_abs_error": float(err.mean()),
        "relative_mean_abs_error": float(err.mean() / scale),
    }
    return 1.0 - metrics["relative_mean_abs_error"], "1-rel_mean_abs_error", metrics


def measure_variant(
    name: str,
    path: pathlib.Path,
    eval_data: Mapping[str, np.ndarray],
    reference: np.ndarray,
    task: Task,
    labels: np.ndarray | None = None,
    batch_sizes: Sequence[int] = (1, 8, 32),
    iterations: int = 100,
    max_seconds: float = 3.0,
    threads: int = DEFAULT_THREADS,
    latency: bool = True,
) -> Measurement:
    """Size, accuracy, peak memory and (unless ``latency`` is false) latency of one ONNX file."""
    path = pathlib.Path(path)
    size = path.stat().st_size
    data_file = path.with_name(path.name + ".data")
    if data_file.exists():
        size += data_file.stat().st_size
    m = Measurement(name=name, path=str(path), size_bytes=size)
    session = open_session(path, threads=threads)
    outputs = run_batched(session, eval_data, batch_size=max(batch_sizes))
    m.score, m.score_name, m.metrics = accuracy_metrics(task, outputs, reference, labels)
    if latency:
        m.p50_ms, m.p99_ms, m.throughput = measure_latency(
            session, eval_data, batch_sizes, iterations, max_seconds
        )
    del session
    m.peak_mem_mb = peak_memory_mb(path, eval_data, max(batch_sizes), threads)
    return m


SETTLE_S = 0.05


def measure_latencies(
    measurements: Sequence[Measurement],
    data: Mapping[str, np.ndarray],
    batch_sizes: Sequence[int] = (1, 8, 32),
    rounds: int = 3,
    iterations: int = 100,
    max_seconds: float = 3.0,
    threads: int = DEFAULT_THREADS,
) -> None:
    """Latency and throughput of all variants in alternating rounds, filled in place.

    Variants take turns (round 1: a, b, c; round 2: a, b, c; ...). p50 and throughput come
    from the least disturbed round of each variant (the lowest per-round median); each
    round's median is kept too, so speed-ups can be taken round by round
    (``report.speedup``: the median of the paired ratios), which a busy spell during one
    variant's turn moves less than a ratio of two best rounds; p99 is over all rounds
    pooled, busy spells included. Each variant gets ``iterations / rounds``
    runs per batch size and round, cut short after ``max_seconds / rounds``.
    """
    sessions = [open_session(m.path, threads=threads) for m in measurements]
    feeds = {bs: _take_rows(data, bs) for bs in batch_sizes}
    times: dict[tuple[int, int], list[float]] = {}
    medians: dict[tuple[int, int], list[float]] = {}
    per_round = max(1, iterations // rounds)
    budget = max_seconds / rounds
    for _ in range(rounds):
        for i, session in enumerate(sessions):
            for bs in batch_sizes:
                feed = feeds[bs]
                # The previous turn's thread pool (another session's) spins on the cores for
                # a while after its last run; timing now would charge its spin to this one.
                time.sleep(SETTLE_S)
                session.run(None, feed)  # warm the arena for this shape
                got: list[float] = []
                start = time.perf_counter()
                while len(got) < per_round and (time.perf_counter() - start) < budget:
                    t0 = time.perf_counter()
                    session.run(None, feed)
                    got.append(time.perf_counter() - t0)
                times.setdefault((i, bs), []).extend(got)
                medians.setdefault((i, bs), []).append(float(np.median(got)))
    for i, m in enumerate(measurements):
        first = (i, batch_sizes[0])
        m.round_p50_ms = [r * 1e3 for r in medians[first]]
        m.p50_ms = min(m.round_p50_ms)
        m.p99_ms = max(float(np.percentile(times[first], 99) * 1e3), m.p50_ms)
        m.throughput = {bs: bs / min(medians[(i, bs)]) for bs in batch_sizes}
        m.round_throughput = {bs: [bs / r for r in medians[(i, bs)]] for bs in batch_sizes}
