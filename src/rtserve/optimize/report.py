"""Choosing a variant and reporting: Pareto front, markdown table, accuracy/latency plot."""

from __future__ import annotations

import math
import pathlib
from collections.abc import Sequence

import numpy as np

from rtserve.optimize.evaluate import Measurement


def pareto_front(measurements: Sequence[Measurement]) -> list[str]:
    """Names of variants no other variant beats on both latency (lower) and score (higher)."""
    valid = [m for m in measurements if not (math.isnan(m.p50_ms) or math.isnan(m.score))]
    front = []
    for m in valid:
        dominated = any(
            o is not m
            and o.p50_ms <= m.p50_ms
            and o.score >= m.score
            and (o.p50_ms < m.p50_ms or o.score > m.score)
            for o in valid
        )
        if not dominated:
            front.append(m.name)
    return sorted(front, key=lambda n: next(m.p50_ms for m in valid if m.name == n))


def within_budget(m: Measurement, reference_score: float, max_drop: float) -> bool:
    return not math.isnan(m.score) and reference_score - m.score <= max_drop + 1e-12


NOISE_BAND = 0.2


def speedup(base: Measurement, m: Measurement, batch: int | None = None) -> float:
    """How many times faster ``m`` ran than ``base``: at batch 1 by p50, or by rows/s at
    ``batch``. With per-round figures for both, the median of the round-by-round ratios
    (rounds alternate, so round i of each ran minutes apart at most, on the same machine
    state); else the ratio of their best rounds."""
    if m is base:
        return 1.0
    if batch is None:  # times: base's over m's
        num, den = base.round_p50_ms, m.round_p50_ms
        best = (base.p50_ms, m.p50_ms)
    else:  # rows per second: m's over base's
        num, den = m.round_throughput.get(batch, []), base.round_throughput.get(batch, [])
        best = (m.throughput.get(batch, math.nan), base.throughput.get(batch, math.nan))
    pairs = list(zip(num, den, strict=False))
    if pairs and all(a > 0 and b > 0 for a, b in pairs):
        return float(np.median([a / b for a, b in pairs]))
    return best[0] / best[1] if best[1] > 0 else math.nan


def noise_band(baseline: Measurement | None, floor: float = NOISE_BAND) -> float:
    """The run's noise band: ``floor``, or the baseline's own spread if that is wider.

    The spread is how much the baseline's median round was slower than its best round
    (p50 comes from the best round of each variant); a busy machine widens it.
    """
    rounds = [r for r in (baseline.round_p50_ms if baseline else []) if r > 0]
    if not rounds:
        return floor
    return max(floor, float(np.median(rounds)) / min(rounds) - 1.0)


def choose(
    measurements: Sequence[Measurement],
    reference_score: float,
    max_drop: float,
    baseline: str | None = None,
    noise: float = 0.0,
) -> Measurement | None:
    """The fastest variant at batch 1 whose score drop is within ``max_drop``: the largest
    :func:`speedup` over ``baseline`` (the lowest p50 without one).

    A variant whose speed-up over ``baseline`` is within ``noise`` (0.2: up to 1.2x) is
    not told apart from the baseline: the baseline is kept (see :func:`choice_note`).
    """
    best = _fastest(measurements, reference_score, max_drop, baseline)
    if best is None:
        return None
    base = next(
        (
            m
            for m in measurements
            if m.name == baseline and within_budget(m, reference_score, max_drop)
        ),
        None,
    )
    if base is not None and within_noise(base, best, noise):
        return base
    return best


def _fastest(
    measurements: Sequence[Measurement],
    reference_score: float,
    max_drop: float,
    baseline: str | None,
) -> Measurement | None:
    ok = [m for m in measurements if within_budget(m, reference_score, max_drop)]
    ok = [m for m in ok if not math.isnan(m.p50_ms)]
    if not ok:
        return None
    ref = next((m for m in measurements if m.name == baseline), None)
    if ref is not None and not math.isnan(ref.p50_ms):
        return max(ok, key=lambda m: (speedup(ref, m), m.score))
    return min(ok, key=lambda m: (m.p50_ms, -m.score))


def within_noise(base: Measurement, m: Measurement, noise: float) -> bool:
    """``m`` is no slower than ``base`` but not faster by more than the noise band."""
    return m is not base and 1.0 <= speedup(base, m) <= 1.0 + noise


def choice_note(
    measurements: Sequence[Measurement],
    reference_score: float,
    max_drop: float,
    baseline: str,
    noise: float,
) -> str:
    """Why the baseline was kept when a faster variant in budget was within the noise."""
    fastest = _fastest(measurements, reference_score, max_drop, baseline)
    base = next((m for m in measurements if m.name == baseline), None)
    if fastest is None or base is None or not within_noise(base, fastest, noise):
        return ""
    return (
        f"within noise: kept the baseline. The fastest variant within the accuracy budget, "
        f"`{fastest.name}`, ran {speedup(base, fastest):.2f}x the speed of `{baseline}` "
        f"at batch 1, inside this run's noise band of +-{noise:.0%}."
    )


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} KB"


def markdown_table(
    measurements: Sequence[Measurement],
    baseline: str,
    reference_score: float,
    max_drop: float,
    chosen: str | None = None,
    noise: float = 0.0,
) -> str:
    """One row per variant with size, latency, throughput, memory, accuracy and ratios.

    With ``noise`` > 0, variants faster than the baseline by no more than it are
    flagged "within noise".
    """
    base = next((m for m in measurements if m.name == baseline), None)
    front = set(pareto_front(measurements))
    batch_sizes = sorted({b for m in measurements for b in m.throughput})
    head = (
        ["variant", "size", "p50 b1 (ms)", "p99 b1 (ms)"]
        + [f"rows/s b{b}" for b in batch_sizes]
        + ["peak mem (MB)", "accuracy", "speed-up b1", "in budget", "notes"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in measurements:
        speed = speedup(base, m) if base and m.p50_ms > 0 else float("nan")
        score = f"{m.score:.4f} {m.score_name}"
        extra = [f"{k} {v:.4f}" for k, v in m.metrics.items() if k != m.score_name]
        if extra:
            score += " (" + ", ".join(extra) + ")"
        flags = []
        if m.name == chosen:
            flags.append("**chosen**")
        if m.name in front:
            flags.append("Pareto")
        if noise > 0 and base is not None and within_noise(base, m, noise):
            flags.append("within noise")
        row = (
            [f"`{m.name}`", _mb(m.size_bytes), f"{m.p50_ms:.2f}", f"{m.p99_ms:.2f}"]
            + [f"{m.throughput.get(b, float('nan')):.0f}" for b in batch_sizes]
            + [
                f"{m.peak_mem_mb:.0f}",
                score,
                f"{speed:.2f}x",
                "yes" if within_budget(m, reference_score, max_drop) else "no",
                "; ".join(flags + m.notes),
            ]
        )
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plot(
    measurements: Sequence[Measurement],
    path: pathlib.Path,
    title: str,
    chosen: str | None = None,
) -> pathlib.Path:
    """Accuracy against batch-1 latency, Pareto front as a line, chosen variant circled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    valid = [m for m in measurements if not (math.isnan(m.p50_ms) or math.isnan(m.score))]
    front_names = pareto_front(valid)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=90)
    ax.scatter([m.p50_ms for m in valid], [m.score for m in valid], s=22, color="tab:blue")
    for m in valid:
        ax.annotate(
            m.name, (m.p50_ms, m.score), fontsize=7, xytext=(3, 3), textcoords="offset points"
        )
    front = [next(m for m in valid if m.name == n) for n in front_names]
    if front:
        ax.step(
            [m.p50_ms for m in front],
            [m.score for m in front],
            where="post",
            color="tab:red",
            linewidth=1.2,
            label="Pareto front",
        )
    if chosen is not None:
        c = next((m for m in valid if m.name == chosen), None)
        if c is not None:
            ax.scatter(
                [c.p50_ms],
                [c.score],
                s=140,
                facecolors="none",
                edgecolors="tab:green",
                linewidths=1.8,
                label="chosen",
            )
    ax.set_xscale("log")
    ax.set_xlabel("p50 latency at batch 1 (ms, log scale)")
    ax.set_ylabel(valid[0].score_name if valid else "accuracy")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
