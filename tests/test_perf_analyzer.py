"""Triton's load client, perf_analyzer (from the tritonclient wheel), runs against rtserve."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import RunningServer

PERF_ANALYZER = Path(sys.executable).parent / "perf_analyzer"


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_runs_without_errors(
    server: RunningServer, perf_analyzer_env: dict[str, str], protocol: str, tmp_path: Path
) -> None:
    binary = PERF_ANALYZER if PERF_ANALYZER.exists() else shutil.which("perf_analyzer")
    assert binary, "perf_analyzer not installed (pip install 'tritonclient[all]==2.51.0')"
    url = server.http if protocol == "http" else server.grpc
    csv = tmp_path / "result.csv"
    cmd = [
        str(binary), "-m", "mlp", "-u", url, "-i", protocol,
        "--concurrency-range", "4", "--input-data", "zero",
        "--measurement-mode", "count_windows", "--measurement-request-count", "300",
        "--stability-percentage", "999", "--max-trials", "3", "-f", str(csv),
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=perf_analyzer_env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Throughput:" in output and "error" not in output.lower()
    rows = csv.read_text().strip().splitlines()
    assert rows[0].startswith("Concurrency,Inferences/Second")
    assert float(rows[1].split(",")[1]) > 0
