"""``make run`` installs only what serving the examples needs (no sudo, no apt, no browser,
no second venv); ``make setup`` (test, lint, bench, CI) still installs every tool. Read
from ``make -n --always-make`` (what make would run, nothing run)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.conftest import ROOT

MAKE = shutil.which("make")
NOT_FOR_SERVING = ("sudo", "apt-get", "chromium", "redis-server", "wrk", "promtool", "litert")


def _extras(plan: str) -> set[str]:
    """The extras of every ``pip install -e '.[...]'`` in the plan."""
    found = re.findall(r"pip install -q -e '\.\[([a-z,]+)\]'", plan)
    assert found, plan
    return {e for line in found for e in line.split(",")}


def _plan(target: str) -> str:
    assert MAKE is not None
    done = subprocess.run(
        [MAKE, "-n", "--always-make", target], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(MAKE is None, reason="make not installed")
@pytest.mark.parametrize("target", ["run", "run-llm", "examples", "setup-serve"])
def test_serving_targets_install_only_serving_dependencies(target: str) -> None:
    plan = _plan(target)
    extras = _extras(plan)
    assert {"llm", "examples"} <= extras and not extras & {"dev", "tracing", "edge"}, extras
    for word in NOT_FOR_SERVING:
        assert word not in plan, f"make {target} would run {word}"


@pytest.mark.skipif(MAKE is None, reason="make not installed")
@pytest.mark.parametrize("target", ["setup", "test", "lint", "bench-quick"])
def test_test_and_bench_targets_still_install_every_tool(target: str) -> None:
    plan = _plan(target)
    assert {"dev", "optimize", "tracing", "llm", "edge", "examples"} <= _extras(plan)
    assert "litert-torch" in plan  # the converter venv (export-edge's tests)
    for word in ("redis-server", "wrk", "chromium", "promtool"):
        assert word in plan, f"make {target} no longer installs {word}"
