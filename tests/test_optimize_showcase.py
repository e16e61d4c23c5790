"""The optimization showcase lives in bench/, outside the installed package."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

from bench.showcase.report import Section, Target, classic_table, render
from rtserve.optimize.evaluate import Measurement
from rtserve.optimize.pipeline import OptimizeResult

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _m(name: str, p50: float, score: float) -> Measurement:
    return Measurement(
        name=name, path=f"{name}.onnx", size_bytes=2_000_000, p50_ms=p50, p99_ms=p50 * 2,
        throughput={1: 1000 / p50, 32: 32000 / p50 * 2}, score=score, score_name="accuracy",
    )  # fmt: skip


def test_the_report_generator_is_not_part_of_the_package() -> None:
    for name in ("rtserve.optimize.showcase", "rtserve.optimize.zoo"):
        assert importlib.util.find_spec(name) is None, name
    src = ROOT / "src" / "rtserve"
    assert not any("parents[3]" in p.read_text() for p in src.rglob("*.py"))


def test_showcase_command_line_answers_help_from_the_repository() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.showcase", "--help"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "--only" in proc.stdout and "early-exit" in proc.stdout


def test_render_lists_targets_sections_and_the_regenerating_command(
    tmp_path: pathlib.Path,
) -> None:
    fp32, int8 = _m("fp32", 2.0, 0.95), _m("int8-dynamic", 1.0, 0.945)
    result = OptimizeResult([fp32, int8], 0.95, "fp32", int8, "classification", 0.01)
    section = Section(
        "Tiny", "tiny", "A tiny model.", result, int8_name="int8-dynamic",
        targets=[Target("speed-up", 2.0, 1.6), Target("accuracy", 0.5, 0.9, "too small")],
    )  # fmt: skip
    text = render([section], tmp_path / "img", tmp_path / "optimization.md", 60.0)
    assert "`python -m bench.showcase --out docs/optimization.md`" in text
    assert "| speed-up | 2.000 | 1.6 | yes |" in text
    assert "- accuracy: 0.500, short by 0.400. Why: too small." in text
    assert "## Tiny" in text and "Chosen: **int8-dynamic**" in text
    table = classic_table(section)
    assert "| INT8 (`int8-dynamic`) | 1.00 | 1000 | 2.00 MB | 0.9450 | 2.00x |" in table
