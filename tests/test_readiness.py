"""Readiness tells the truth: with a model that failed to load, /v2/health/ready answers 503
and gRPC ServerReady false (strict readiness, the default, as Triton's); relaxed by
``--strict-readiness false`` or ``strict_readiness: false`` in the server config;
``--exit-on-error`` stops at start naming the model. Also the start log: one ready line,
``https://`` when serving TLS."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import tritonclient.grpc as grpcclient

from tests.conftest import ROOT, RunningServer, start_server
from tests.models import build_scale
from tests.test_security import make_cert

BODY = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}


def good_and_broken(root: Path) -> Path:
    """``good`` serves; ``broken`` has a config error and never loads."""
    for name, extra in (("good", ""), ("broken", "dynamic_batching: {max_queue_size: 0}\n")):
        build_scale(root / name / "1" / "model.onnx", 2.0)
        (root / name / "config.yaml").write_text(f"max_batch_size: 4\n{extra}")
    return root


def serve_cmd(repo: Path, ports: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "rtserve.cli", "serve", "--model-repository", str(repo),
        "--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0",
        "--ports-file", str(ports), *extra,
    ]  # fmt: skip


def launch(repo: Path, workdir: Path, *extra: str) -> RunningServer:
    """Start a server and wait for its ports file only (it may well not be ready)."""
    workdir.mkdir(parents=True, exist_ok=True)
    ports, log_path = workdir / "ports.json", workdir / "server.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            serve_cmd(repo, ports, *extra), stdout=log, stderr=subprocess.STDOUT, env=env
        )
    deadline = time.monotonic() + 60
    while not (ports.exists() and ports.stat().st_size):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait(10)
            raise RuntimeError(f"server did not start:\n{log_path.read_text()}")
        time.sleep(0.05)
    info = json.loads(ports.read_text())
    return RunningServer(proc, info["http_port"], info["grpc_port"], log_path)


def server_ready(s: RunningServer) -> tuple[int, object, bool]:
    """HTTP status and body of /v2/health/ready, and gRPC ServerReady."""
    r = httpx.get(f"{s.base}/v2/health/ready")
    grpc = grpcclient.InferenceServerClient(s.grpc)
    try:
        return r.status_code, r.json(), grpc.is_server_ready()
    finally:
        grpc.close()


def test_a_model_that_failed_to_load_makes_the_server_not_ready(tmp_path: Path) -> None:
    s = launch(good_and_broken(tmp_path / "repo"), tmp_path / "s")
    try:
        assert server_ready(s) == (503, {"ready": False}, False)
        # The model that loaded serves; the log says why the server is not ready.
        r = httpx.post(f"{s.base}/v2/models/good/infer", json=BODY)
        assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [2, 4, 6, 8]
        not_ready = [line for line in s.log().splitlines() if "not ready" in line]
        assert len(not_ready) == 1 and "model 'broken' failed to load" in not_ready[0]
        assert "max_queue_size" in not_ready[0]
    finally:
        s.stop()


@pytest.mark.parametrize("how", ["flag", "config-file"])
def test_relaxed_readiness_serves_the_models_that_loaded(tmp_path: Path, how: str) -> None:
    repo = good_and_broken(tmp_path / "repo")
    if how == "flag":
        extra: tuple[str, ...] = ("--strict-readiness", "false")
    else:
        (tmp_path / "server.yaml").write_text("strict_readiness: false\n")
        extra = ("--config", str(tmp_path / "server.yaml"))
    s = launch(repo, tmp_path / "s", *extra)
    try:
        assert server_ready(s) == (200, {"ready": True}, True)
        assert httpx.get(f"{s.base}/v2/models/broken/ready").status_code in (404, 503)
    finally:
        s.stop()


def test_exit_on_error_stops_at_start_naming_the_model(tmp_path: Path) -> None:
    repo = good_and_broken(tmp_path / "repo")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    ports = tmp_path / "ports.json"
    done = subprocess.run(
        serve_cmd(repo, ports, "--exit-on-error"), env=env, capture_output=True, timeout=60
    )
    assert done.returncode == 1
    err = done.stderr.decode()
    assert "rtserve: model 'broken' failed to load: broken/config.yaml" in err
    assert "'good'" not in err.splitlines()[-1]
    assert not ports.exists()  # it never announced itself


def test_a_model_loaded_later_that_fails_makes_the_server_not_ready(tmp_path: Path) -> None:
    """Explicit mode: a failed load of a new model is a model asked for; unloading it
    (giving up on it) makes the server ready again, as in Triton."""
    repo = good_and_broken(tmp_path / "repo")
    s = start_server(
        repo, tmp_path / "s", "--model-control-mode", "explicit", "--load-model", "good"
    )
    try:
        assert server_ready(s) == (200, {"ready": True}, True)
        assert httpx.post(f"{s.base}/v2/repository/models/broken/load").status_code == 400
        assert server_ready(s) == (503, {"ready": False}, False)
        assert httpx.post(f"{s.base}/v2/repository/models/broken/unload").status_code == 200
        assert server_ready(s) == (200, {"ready": True}, True)
    finally:
        s.stop()


def start_lines(log: str) -> list[str]:
    """The server's own start lines (not the per-model "model x ready" ones)."""
    return [line for line in log.splitlines() if " ready:" in line or "listening:" in line]


def test_one_ready_line_naming_https_when_serving_tls(tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path)
    repo = good_and_broken(tmp_path / "repo")
    (repo / "broken" / "config.yaml").write_text("max_batch_size: 4\n")
    tls = ("--tls-cert", str(cert), "--tls-key", str(key))
    ctx = ssl.create_default_context(cafile=str(cert))
    s = start_server(repo, tmp_path / "s", *tls, tls=ctx)
    s.stop()
    lines = start_lines(s.log())
    assert len(lines) == 2, lines  # "listening: ..." and "ready: ..."
    assert f"listening: https://127.0.0.1:{s.http_port} grpc (TLS) 127.0.0.1:" in lines[0]
    assert f"ready: https://127.0.0.1:{s.http_port} grpc (TLS)" in lines[1]
    assert "http://" not in s.log()


def test_one_ready_line_over_plain_http(tmp_path: Path) -> None:
    repo = good_and_broken(tmp_path / "repo")
    (repo / "broken" / "config.yaml").write_text("max_batch_size: 4\n")
    s = start_server(repo, tmp_path / "s")
    s.stop()
    lines = start_lines(s.log())
    assert len(lines) == 2, lines
    assert f"ready: http://127.0.0.1:{s.http_port} grpc 127.0.0.1:{s.grpc_port}" in lines[1]
    assert '"good": ["1"]' in lines[1]
