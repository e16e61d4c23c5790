"""``rtserve cold-start REPO [--model M]``: what a new process (a Lambda init, a new pod)
pays before its first answer, each phase timed in a fresh interpreter:

- start: process spawn to the first line of Python (interpreter, site-packages);
- import: ``import rtserve.serverless`` (the handler and everything it imports);
- backend import: the model's runtime library (onnxruntime, torch, ...);
- load: reading the model and building its runtime (the engine's start less warmup);
- warmup: the configured warmup batches;
- first answer / second answer: one request through the engine, then another.

Each run is a new process; the table shows the median of ``--runs``.
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PHASES = ("start", "import", "backend_import", "load", "warmup", "first_answer", "second_answer")


def _ms(start: float, end: float) -> float:
    return round((end - start) * 1000, 2)


def _child(repository: str, model: str | None, spawned: float) -> dict[str, Any]:
    """Runs in the fresh process: each phase in order, times in ms."""
    entered = time.time()
    t0 = time.perf_counter()
    import rtserve.serverless  # noqa: F401  (the handler's imports, no engine yet)

    t1 = time.perf_counter()
    from rtserve.backends import backend_of
    from rtserve.core import model as model_module
    from rtserve.core.warmup import example_batch, warmup
    from rtserve.engine import Engine
    from rtserve.repository import scan

    sources = [s for s in scan(Path(repository)) if model is None or s.name == model]
    if not sources:
        raise SystemExit(f"{repository}: no model {model!r}")
    for source in sources:
        if source.config is not None:  # (the modules its line in BACKENDS names)
            for module in backend_of(source.config.backend).imports:
                importlib.import_module(module)
    t2 = time.perf_counter()
    warmed: list[float] = []

    def timed_warmup(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return warmup(*args)
        finally:
            warmed.append(time.perf_counter() - start)

    model_module.warmup = timed_warmup  # type: ignore[assignment]
    names = tuple(s.name for s in sources)
    settings = {"model_control_mode": "explicit", "load_models": names}
    with Engine.from_repository(repository, **settings).sync() as engine:
        t3 = time.perf_counter()
        mv = engine.engine.registry.get(sources[0].name)
        feeds = example_batch(tuple(mv.inputs.values()), 1, mv.config.max_batch_size > 0)
        engine.infer(mv.name, feeds)
        t4 = time.perf_counter()
        engine.infer(mv.name, feeds)
        t5 = time.perf_counter()
    warm_s = sum(warmed)
    return {
        "model": mv.name,
        "backend": mv.config.backend,
        "start": round((entered - spawned) * 1000, 2),
        "import": _ms(t0, t1),
        "backend_import": _ms(t1, t2),
        "load": _ms(t2, t3 - warm_s),
        "warmup": round(warm_s * 1000, 2),
        "first_answer": _ms(t3, t4),
        "second_answer": _ms(t4, t5),
        "total": round((entered - spawned) * 1000 + (t4 - t0) * 1000, 2),
    }


def measure_once(repository: Path, model: str | None = None) -> dict[str, Any]:
    """One fresh process's phases (ms)."""
    argv = [sys.executable, "-m", "rtserve.coldstart", str(repository), model or ""]
    argv.append(repr(time.time()))
    done = subprocess.run(argv, capture_output=True, text=True, check=False, env=os.environ)
    if done.returncode != 0:
        raise RuntimeError(f"cold-start run failed:\n{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure(
    repository: Path, model: str | None = None, runs: int = 3
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The median of ``runs`` fresh processes, and each run."""
    each = [measure_once(repository, model) for _ in range(runs)]
    median: dict[str, Any] = {"model": each[0]["model"], "backend": each[0]["backend"]}
    for key in (*PHASES, "total"):
        median[key] = round(statistics.median(r[key] for r in each), 2)
    return median, each


def table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table: one row per model, one column per phase (ms)."""
    keys = (*PHASES, "total")
    lines = [
        "| model (backend) | " + " | ".join(k.replace("_", " ") for k in keys) + " |",
        "|---|" + "---:|" * len(keys),
    ]
    for r in rows:
        cells = " | ".join(f"{r[k]:.1f}" for k in keys)
        lines.append(f"| {r['model']} ({r['backend']}) | {cells} |")
    return "\n".join(lines)


def run_cli(repository: Path, models: list[str], runs: int, as_json: bool) -> int:
    chosen: list[str | None] = [*models] or [None]
    results = [measure(repository, m, runs)[0] for m in chosen]
    print(json.dumps(results, indent=2) if as_json else table(results))
    return 0


def _main(argv: list[str], out: Callable[[str], None] = print) -> None:
    repository, model, spawned = argv
    out(json.dumps(_child(repository, model or None, float(spawned))))


if __name__ == "__main__":
    _main(sys.argv[1:])
