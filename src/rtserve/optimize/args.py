"""Argument helpers shared by the ``rtserve export`` / ``optimize`` / ``edge`` / ``early-exit``
subcommands: the error guard, example-input shapes, import paths and bound checks."""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

from rtserve.optimize.errors import OptimizeError

EXIT_USAGE = 2


def guard(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except OptimizeError as exc:
            print(f"error: {exc.message}", file=sys.stderr)
            return EXIT_USAGE

    return wrapped


MAX_EXAMPLE_ELEMENTS = 1 << 28  # an example input (zeros) of at most 1 GiB of float32


def parse_shape(text: str) -> tuple[str, list[int], str]:
    """``name:2x3x224x224[:dtype]`` -> (name, shape, dtype)."""
    import numpy as np

    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise OptimizeError(
            f"--input {text!r}: expected NAME:DIMS[:DTYPE], e.g. image:2x3x224x224:float32"
        )
    try:
        shape = [int(d) for d in parts[1].lower().split("x")]
    except ValueError:
        raise OptimizeError(f"--input {text!r}: dims must be integers joined by 'x'") from None
    if any(d < 1 for d in shape):
        raise OptimizeError(f"--input {text!r}: every dim must be at least 1")
    if math.prod(shape) > MAX_EXAMPLE_ELEMENTS:
        raise OptimizeError(
            f"--input {text!r}: {math.prod(shape)} elements, more than an example input "
            f"needs (at most {MAX_EXAMPLE_ELEMENTS})"
        )
    dtype = parts[2] if len(parts) == 3 else "float32"
    try:
        ok = np.dtype(dtype).kind in "biuf"
    except TypeError:
        ok = False
    if not ok:
        raise OptimizeError(
            f"--input {text!r}: DTYPE {dtype!r} is not a numeric numpy type (float32, int64, ...)"
        )
    return parts[0], shape, dtype


def load_module_here(spec: str) -> Any:
    """:func:`~rtserve.optimize.export.load_module` with the current directory importable.

    ``python -m`` puts the current directory on ``sys.path``; the ``rtserve`` console
    script does not, so ``rtserve export mymodel:build`` next to ``mymodel.py`` would fail
    without PYTHONPATH. Files (TorchScript, ExportedProgram) need no path.
    """
    from rtserve.optimize.export import load_module

    cwd = os.getcwd()
    if ":" in spec and not pathlib.Path(spec).exists() and cwd not in sys.path:
        sys.path.insert(0, cwd)
    return load_module(spec)


def check_folder(path: pathlib.Path, flag: str) -> None:
    """Refuse, before any work, a folder that cannot be made: it or an ancestor is a file."""
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                what = "is a file" if p == path else f"is under {p}, a file"
                raise OptimizeError(f"{flag} {path}: {what}; expected a folder")
            return


def at_least(args: argparse.Namespace, names: dict[str, int]) -> None:
    """Each option ``--name`` (unset: None, its default applies) at least its bound."""
    for name, low in names.items():
        value = getattr(args, name)
        if value is not None and value < low:
            flag = "--" + name.replace("_", "-")
            raise OptimizeError(f"{flag}: expected an integer >= {low}, got {value}")


def number(args: argparse.Namespace, name: str, low: float, high: float, low_open: bool) -> None:
    value = getattr(args, name)
    below = value <= low if low_open else value < low
    if not math.isfinite(value) or below or value > high:
        flag = "--" + name.replace("_", "-")
        bounds = f"> {low:g}" if low_open else f">= {low:g}"
        if high != math.inf:
            bounds += f" and <= {high:g}"
        raise OptimizeError(f"{flag}: expected a number {bounds}, got {value}")


def run_command(register: Callable[[Any], None], argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` for the subcommands ``register`` adds and run the chosen one."""
    parser = argparse.ArgumentParser(prog="rtserve")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code
