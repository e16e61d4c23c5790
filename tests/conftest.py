"""Shared fixtures: real rtserve servers in subprocesses on 127.0.0.1 with ephemeral ports."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.cache_fixtures import redis, redis_server  # noqa: F401  (shared fixtures)
from tests.models import build_test_repository

ROOT = Path(__file__).resolve().parent.parent
# For repositories with a model broken on purpose: serve the others and answer ready
# (the default, strict readiness, answers 503 while a model asked for failed to load).
RELAXED = ("--strict-readiness", "false")


@dataclass
class RunningServer:
    proc: subprocess.Popen[bytes]
    http_port: int
    grpc_port: int
    log_path: Path

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def base(self) -> str:
        return f"http://{self.http}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def post_json(url: str, doc: Any, timeout: float = 30) -> tuple[int, Any]:
    """POST ``doc`` as JSON; (status, the JSON answer), for error statuses too."""
    req = urllib.request.Request(
        url, data=json.dumps(doc).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def start_server(
    repo: Path,
    workdir: Path,
    *extra: str,
    timeout: float = 90.0,
    tls: ssl.SSLContext | None = None,
    prefix: tuple[str, ...] = (),
) -> RunningServer:
    """Start ``rtserve serve`` and wait until it is ready (``tls``: it serves HTTPS;
    ``prefix``: a command that execs the server, e.g. in its own mount namespace)."""
    workdir.mkdir(parents=True, exist_ok=True)
    ports = workdir / "ports.json"
    ports.unlink(missing_ok=True)
    log_path = workdir / "server.log"
    cmd = [
        *prefix, sys.executable, "-m", "rtserve.cli", "serve",
        "--model-repository", str(repo), "--host", "127.0.0.1",
        "--http-port", "0", "--grpc-port", "0", "--ports-file", str(ports), *extra,
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
            if ports.exists() and ports.stat().st_size:
                info = json.loads(ports.read_text())
                server = RunningServer(proc, info["http_port"], info["grpc_port"], log_path)
                scheme = "https" if tls is not None else "http"
                ready = f"{scheme}://{server.http}/v2/health/ready"
                with urllib.request.urlopen(ready, timeout=5, context=tls) as r:
                    assert r.status == 200
                return server
            time.sleep(0.05)
        raise RuntimeError(f"server not ready within {timeout} s:\n{log_path.read_text()}")
    except BaseException:
        proc.kill()  # never leave a server behind
        proc.wait(10)
        raise


def hold_connections(port: int, count: int) -> tuple[list[socket.socket], int]:
    """``count`` idle TCP connections to ``port`` (the caller closes them), and how many the
    server closed at once (read as end of file within 50 ms each, after half a second)."""
    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(count)]
    time.sleep(0.5)
    closed = 0
    for sock in held:
        sock.settimeout(0.05)
        with contextlib.suppress(TimeoutError):
            closed += sock.recv(1 << 16) == b""
    return held, closed


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB (from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="session")
def test_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_test_repository(tmp_path_factory.mktemp("repo"))


@pytest.fixture(scope="session")
def server(test_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    s = start_server(
        test_repo, tmp_path_factory.mktemp("server"), "--max-request-bytes", "1000000", *RELAXED
    )
    yield s
    s.stop()


def run_perf_analyzer(args: list[str], env: dict[str, str]) -> str:
    """Run the tritonclient wheel's perf_analyzer with ``args`` (``env``: the
    ``perf_analyzer_env`` fixture); its output, once it exited 0 having measured."""
    beside = Path(sys.executable).parent / "perf_analyzer"
    binary = beside if beside.exists() else shutil.which("perf_analyzer")
    assert binary, "perf_analyzer not installed (pip install 'tritonclient[all]==2.51.0')"
    result = subprocess.run(
        [str(binary), *args], capture_output=True, text=True, timeout=120, env=env
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "Throughput:" in output, output
    return output


@pytest.fixture(scope="session")
def perf_analyzer_env() -> dict[str, str]:
    """Environment in which the perf_analyzer binary from the tritonclient wheel runs."""
    import nvidia.cuda_runtime

    lib = Path(list(nvidia.cuda_runtime.__path__)[0]) / "lib"
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{lib}:{env.get('LD_LIBRARY_PATH', '')}"
    return env
