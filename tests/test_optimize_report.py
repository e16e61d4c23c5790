"""Choosing the variant: Pareto front, budget, and the report files."""

from __future__ import annotations

import math
import pathlib

from rtserve.optimize.evaluate import Measurement
from rtserve.optimize.report import choose, markdown_table, pareto_front, plot


def _m(name: str, p50: float, score: float) -> Measurement:
    return Measurement(
        name=name, path=f"{name}.onnx", size_bytes=1000, p50_ms=p50, p99_ms=p50 * 1.5,
        throughput={1: 1000 / p50, 32: 32000 / p50}, score=score, score_name="cosine_mean",
    )  # fmt: skip


VARIANTS = [
    _m("fp32", 10.0, 1.0),
    _m("fp16", 10.5, 0.9999),  # slower and worse than fp32: dominated
    _m("int8-dynamic", 6.0, 0.991),
    _m("int8-static", 4.0, 0.93),
    _m("pruned", 7.0, 0.90),  # dominated by int8-dynamic
]


def test_pareto_front_keeps_only_undominated_variants_sorted_by_latency() -> None:
    assert pareto_front(VARIANTS) == ["int8-static", "int8-dynamic", "fp32"]


def test_pareto_front_ignores_unmeasured_variants() -> None:
    assert "x" not in pareto_front([*VARIANTS, _m("x", math.nan, 1.0)])


def test_choose_picks_the_fastest_within_budget() -> None:
    assert (c := choose(VARIANTS, 1.0, 0.01)) is not None and c.name == "int8-dynamic"
    assert (c := choose(VARIANTS, 1.0, 0.1)) is not None and c.name == "int8-static"
    assert (c := choose(VARIANTS, 1.0, 0.0)) is not None and c.name == "fp32"


def test_choose_returns_none_when_nothing_fits() -> None:
    assert choose(VARIANTS[1:], 1.0, 0.0) is None


def test_markdown_table_marks_choice_pareto_and_budget() -> None:
    table = markdown_table(VARIANTS, "fp32", 1.0, 0.01, chosen="int8-dynamic")
    row = next(line for line in table.splitlines() if "`int8-dynamic`" in line)
    assert "**chosen**" in row and "Pareto" in row and "1.67x" in row and "| yes |" in row
    static_row = next(line for line in table.splitlines() if "`int8-static`" in line)
    assert "| no |" in static_row


def test_plot_writes_a_small_png(tmp_path: pathlib.Path) -> None:
    path = plot(VARIANTS, tmp_path / "p.png", "test", chosen="int8-dynamic")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size < 200_000


def test_choose_keeps_the_baseline_when_the_gain_is_within_noise() -> None:
    from rtserve.optimize.report import choice_note

    variants = [_m("fp32", 10.0, 1.0), _m("fp16", 8.8, 1.0), _m("pruned-magnitude-50", 9.8, 1.0)]
    assert (c := choose(variants, 1.0, 0.01, "fp32", 0.2)) is not None and c.name == "fp32"
    note = choice_note(variants, 1.0, 0.01, "fp32", 0.2)
    assert note.startswith("within noise: kept the baseline") and "`fp16`, ran 1.14x" in note
    assert "+-20%" in note
    table = markdown_table(variants, "fp32", 1.0, 0.01, chosen="fp32", noise=0.2)
    fp16_row = next(line for line in table.splitlines() if "`fp16`" in line)
    assert "within noise" in fp16_row
    faster = [*variants, _m("int8-static", 7.0, 0.995)]  # 1.43x: beyond the band
    assert (c := choose(faster, 1.0, 0.01, "fp32", 0.2)) is not None and c.name == "int8-static"
    assert choice_note(faster, 1.0, 0.01, "fp32", 0.2) == ""
    assert (c := choose(variants, 1.0, 0.01, "fp32", 0.1)) is not None and c.name == "fp16"


def test_noise_band_widens_with_the_baseline_spread_between_rounds() -> None:
    from rtserve.optimize.report import noise_band

    base = _m("fp32", 10.0, 1.0)
    assert noise_band(base, 0.2) == 0.2  # no rounds recorded: the floor
    base.round_p50_ms = [10.0, 10.5, 11.0]
    assert noise_band(base, 0.2) == 0.2
    base.round_p50_ms = [10.0, 13.0, 14.0, 15.0]
    assert math.isclose(noise_band(base, 0.2), 0.35)


def test_speedup_is_the_median_of_round_by_round_ratios() -> None:
    from rtserve.optimize.report import speedup

    base, fast = _m("fp32", 10.0, 1.0), _m("int8-qat", 5.0, 1.0)
    assert speedup(base, fast) == 2.0  # no rounds recorded: the best rounds' ratio
    # the baseline's best round (10 ms) fell in a quiet spell the variant did not share
    base.round_p50_ms, fast.round_p50_ms = [10.0, 16.0, 16.0], [8.0, 10.0, 9.0]
    base.p50_ms, fast.p50_ms = 10.0, 8.0
    assert math.isclose(speedup(base, fast), 1.6)  # ratios 1.25, 1.6, 1.78: the median
    assert speedup(base, base) == 1.0
    base.round_throughput, fast.round_throughput = (
        {8: [100.0, 80.0, 90.0]},
        {8: [150.0, 160.0, 90.0]},
    )
    assert math.isclose(speedup(base, fast, 8), 1.5)  # 1.5, 2.0, 1.0
    # the chooser and the table read the same figure
    assert (c := choose([base, fast], 1.0, 0.01, "fp32", 0.2)) is not None and c is fast
    row = next(
        r for r in markdown_table([base, fast], "fp32", 1.0, 0.01).splitlines() if "qat" in r
    )
    assert "1.60x" in row
