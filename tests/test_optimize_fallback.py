"""The static INT8 fallback loop keeps nodes in float until the accuracy budget holds."""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from rtserve.optimize.evaluate import accuracy_metrics, open_session, run_batched
from rtserve.optimize.pipeline import FallbackStep, fallback_search, static_with_fallback
from tests.test_optimize_helpers import cnn_onnx, images


def _setup(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict[str, np.ndarray], np.ndarray]:
    model = cnn_onnx(tmp_path / "cnn.onnx")
    eval_data = {"image": images(24, seed=5)}
    reference = run_batched(open_session(model), eval_data)
    return model, eval_data, reference


def test_fallback_stops_at_once_when_budget_already_holds(tmp_path: pathlib.Path) -> None:
    model, eval_data, ref = _setup(tmp_path)
    _, steps, excluded = static_with_fallback(
        model, tmp_path, "q", {"image": images(16, seed=1)}, "minmax", eval_data, ref,
        "regression", None, 1.0, max_drop=1.0,
    )  # fmt: skip
    assert len(steps) == 1 and steps[0].within_budget and excluded == []


@pytest.mark.parametrize("method", ["minmax", "entropy"])
def test_fallback_honours_a_tight_budget_by_keeping_nodes_float(
    tmp_path: pathlib.Path, method: str
) -> None:
    model, eval_data, ref = _setup(tmp_path)
    budget = 1e-6  # only a (nearly) float model meets it
    dst, steps, excluded = static_with_fallback(
        model, tmp_path, "q", {"image": images(16, seed=1)}, method, eval_data, ref,
        "regression", None, 1.0, max_drop=budget, max_steps=8,
    )  # fmt: skip
    counts = [s.excluded for s in steps]
    assert counts[0] == 0 and not steps[0].within_budget
    first_hit = next(i for i, s in enumerate(steps) if s.within_budget)
    assert counts[: first_hit + 1] == sorted(counts[: first_hit + 1])  # 0, 1, 2, 4, ...
    assert steps[-1].within_budget and counts[-1] == len(excluded)
    # the bisection never settles above a count that met the budget, nor below a miss
    assert all(s.excluded >= counts[-1] for s in steps if s.within_budget)
    assert all(s.excluded < counts[-1] for s in steps if not s.within_budget)
    assert (tmp_path / "q-full.onnx").is_file()
    out = run_batched(open_session(dst), eval_data)
    score = accuracy_metrics("regression", out, ref)[0]
    assert 1.0 - score <= budget
    assert len(excluded) == counts[-1]


def test_fallback_reports_failure_when_steps_run_out(tmp_path: pathlib.Path) -> None:
    model, eval_data, ref = _setup(tmp_path)
    _, steps, _ = static_with_fallback(
        model, tmp_path, "q", {"image": images(16, seed=1)}, "minmax", eval_data, ref,
        "regression", None, 1.0, max_drop=1e-6, max_steps=1,
    )  # fmt: skip
    assert len(steps) == 2 and not steps[-1].within_budget


def _builder(threshold: int, calls: list[int]) -> Callable[[Sequence[str]], FallbackStep]:
    """A stand-in for quantize-and-score: within budget once ``threshold`` nodes are float."""

    def build(excluded: Sequence[str]) -> FallbackStep:
        calls.append(len(excluded))
        return FallbackStep(len(excluded), float(len(excluded)), len(excluded) >= threshold)

    return build


def test_fallback_search_doubles_then_bisects_to_the_fewest_float_nodes() -> None:
    ranking = [f"n{i}" for i in range(20)]
    calls: list[int] = []
    steps, excluded = fallback_search(_builder(5, calls), ranking, max_steps=8)
    assert calls == [1, 2, 4, 8, 6, 5]
    assert excluded == ranking[:5] and steps[-1].excluded == 5 and steps[-1].within_budget


def test_fallback_search_rebuilds_the_winner_when_the_last_probe_missed() -> None:
    ranking = [f"n{i}" for i in range(20)]
    calls: list[int] = []
    steps, excluded = fallback_search(_builder(4, calls), ranking, max_steps=8)
    assert calls == [1, 2, 4, 3, 4]  # the model on disk is the 4-node one
    assert excluded == ranking[:4] and steps[-1].within_budget


def test_fallback_search_out_of_steps_keeps_the_last_tried_nodes() -> None:
    ranking = [f"n{i}" for i in range(20)]
    calls: list[int] = []
    steps, excluded = fallback_search(_builder(50, calls), ranking, max_steps=3)
    assert calls == [1, 2, 4]
    assert excluded == ranking[:4] and not steps[-1].within_budget
    calls.clear()
    steps, excluded = fallback_search(_builder(50, calls), ranking[:3], max_steps=8)
    assert calls == [1, 2, 3] and excluded == ranking[:3]  # stops once every node is float
