"""perf_analyzer: V2 load over HTTP (binary or JSON tensors) and gRPC, closed and open loop."""

from __future__ import annotations

import csv
import io
import os
import re
import subprocess
from pathlib import Path

from bench.envs import MAIN_VENV
from bench.results import Measurement, short_error

BINARY = MAIN_VENV / "bin" / "perf_analyzer"
CUDA_RUNTIME_LIB = (
    MAIN_VENV / "lib" / "python3.11" / "site-packages" / "nvidia" / "cuda_runtime" / "lib"
)

# client name -> (protocol, extra flags)
PROTOCOLS: dict[str, tuple[str, list[str]]] = {
    "pa-http-binary": ("http", []),
    "pa-http-json": ("http", ["--input-tensor-format", "json", "--output-tensor-format", "json"]),
    "pa-grpc": ("grpc", []),
}


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(CUDA_RUNTIME_LIB), env.get("LD_LIBRARY_PATH", "")) if p
    )
    return env


def command(
    client: str,
    model: str,
    address: str,
    data_file: Path,
    csv_file: Path,
    window_ms: int,
    *,
    concurrency: int | None = None,
    rate: float | None = None,
    trials: int = 3,
) -> list[str]:
    """The perf_analyzer argv for one load point: a concurrency (closed) or a Poisson rate (open).

    ``--stability-percentage 999`` with a trial cap makes every point take a fixed number of
    windows, so a point's time is bounded whatever the server's variance.
    """
    protocol, flags = PROTOCOLS[client]
    cmd = [
        str(BINARY),
        "-m",
        model,
        "-u",
        address,
        "-i",
        protocol,
        "-b",
        "1",
        "--input-data",
        str(data_file),
        "--measurement-mode",
        "time_windows",
        "--measurement-interval",
        str(window_ms),
        "--max-trials",
        str(trials),
        "--stability-percentage",
        "999",
        "--percentile",
        "99",
        "-f",
        str(csv_file),
        *flags,
    ]
    if rate is not None:
        cmd += [
            "--request-rate-range",
            f"{rate:g}",
            "--request-distribution",
            "poisson",
            "--async",
            "--max-threads",
            "16",
        ]
    else:
        cmd += ["--concurrency-range", str(concurrency or 1)]
    return cmd


def parse_csv(text: str) -> dict[str, float]:
    """Throughput and client-side percentiles (ms) from perf_analyzer's ``-f`` CSV."""
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows:
        raise ValueError("perf_analyzer CSV has no rows")
    row = rows[-1]
    return {
        "rps": float(row["Inferences/Second"]),
        "p50_ms": float(row["p50 latency"]) / 1000,
        "p90_ms": float(row["p90 latency"]) / 1000,
        "p99_ms": float(row["p99 latency"]) / 1000,
    }


def parse_stdout(text: str) -> dict[str, float]:
    """Request count and, in open loop, the share of requests the client sent late."""
    found: dict[str, float] = {}
    counts = re.findall(r"Request count: (\d+)", text)
    if counts:
        found["requests"] = int(counts[-1])
    delayed = re.findall(r"([\d.]+)% of the requests were delayed", text)
    if delayed:
        found["delayed_pct"] = float(delayed[-1])
    return found


def error_line(text: str) -> str:
    """The most telling line of a failed run's output."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        low = line.lower()
        if "error" in low or "failed" in low or "unable" in low or "invalid" in low:
            return short_error(line)
    return short_error(lines[-1] if lines else "no output")


def measure(cmd: list[str], csv_file: Path, base: Measurement, timeout_s: float) -> Measurement:
    base.extra["command"] = " ".join(
        Path(part).name if part.startswith(str(MAIN_VENV)) else part for part in cmd
    )
    csv_file.unlink(missing_ok=True)
    try:
        env = environment()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        base.error = f"perf_analyzer timed out after {timeout_s:.0f}s"
        return base
    except OSError as exc:
        base.error = f"perf_analyzer: {exc}"
        return base
    output = proc.stdout + proc.stderr
    if proc.returncode != 0 or not csv_file.exists():
        base.error = f"perf_analyzer: {error_line(output)}"
        return base
    try:
        parsed = parse_csv(csv_file.read_text())
    except (ValueError, KeyError) as exc:
        base.error = f"perf_analyzer CSV: {exc}"
        return base
    base.rps = parsed["rps"]
    base.p50_ms, base.p90_ms, base.p99_ms = parsed["p50_ms"], parsed["p90_ms"], parsed["p99_ms"]
    extra = parse_stdout(output)
    base.requests = int(extra.get("requests", 0))
    if "delayed_pct" in extra:
        base.extra["delayed_pct"] = extra["delayed_pct"]
    return base
