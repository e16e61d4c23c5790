"""The ``rtserve export`` / ``rtserve optimize`` command lines: help text and imports."""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys

import pytest

from rtserve.optimize.cli import register


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rtserve")
    sub = parser.add_subparsers(dest="command")
    register(sub)
    chosen: argparse.ArgumentParser = sub.choices[name]
    return chosen


@pytest.mark.parametrize("command", ["optimize", "export"])
def test_every_option_has_help_that_states_its_default(command: str) -> None:
    options = [
        a
        for a in _subparser(command)._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction)
    ]
    assert len(options) >= (20 if command == "optimize" else 7)
    for action in options:
        text = action.help or ""
        assert len(text) > 10, f"{action.option_strings[0]} has no help text"
        assert "default" in text or "required" in text, (
            f"{action.option_strings[0]}: help does not state the default: {text!r}"
        )


def test_optimize_help_prints_the_actual_default_values() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-m", "rtserve.cli", "optimize", "--help"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for shown in (
        "(default: 0.01)",
        "(default: minmax,percentile,entropy)",
        "(default: 100)",
        "(default: 4.0)",
        "(default: 32)",
    ):
        assert shown in text
    assert "%(default)" not in text


def _export_from(cwd: pathlib.Path, target: str) -> subprocess.CompletedProcess[str]:
    """``rtserve export <target>`` run in ``cwd`` as the installed script runs it: ``-P``
    keeps the current directory off sys.path, and no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [
            sys.executable, "-P", "-m", "rtserve.cli", "export", target,
            "--out", "m.onnx", "--input", "x:2x8:float32",
        ],
        capture_output=True, text=True, timeout=120, cwd=cwd, env=env,
    )  # fmt: skip


def test_export_imports_a_module_from_the_current_directory(tmp_path: pathlib.Path) -> None:
    (tmp_path / "my_local_model.py").write_text(
        "import torch\n\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU())\n"
    )
    proc = _export_from(tmp_path, "my_local_model:build")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "m.onnx").is_file()
    assert "max abs diff vs torch" in proc.stdout


def test_export_names_a_module_that_is_not_there(tmp_path: pathlib.Path) -> None:
    proc = _export_from(tmp_path, "no_such_module_here:build")
    assert proc.returncode == 2
    assert "cannot import 'no_such_module_here'" in proc.stderr
    assert "Traceback" not in proc.stderr
