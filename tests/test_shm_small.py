"""A Python model with ``isolation: process`` behind a 64 MiB ``/dev/shm`` (the container
default): large requests are answered or refused with a 507 naming shared memory, never
kill the server or the worker (issue 23, item 2).

The server runs in a private mount namespace (``unshare -m``) with its own 64 MiB tmpfs
on ``/dev/shm``, as root can make here; the test is skipped where that is not permitted.
"""

from __future__ import annotations

import http.client
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import yaml
from tritonclient.utils import InferenceServerException

from tests.conftest import ROOT, RunningServer, start_server
from tests.models import write_python_model

MiB = 1 << 20
SHM = "64m"
IN_A_SMALL_SHM = (
    "unshare", "-m", "sh", "-c",
    f'mount -t tmpfs -o size={SHM} tmpfs /dev/shm && exec "$@"', "sh",
)  # fmt: skip

ECHO_PY = """
import os
import numpy as np

class Model:
    def infer(self, inputs):
        return {"Y": inputs["X"], "PID": np.array([os.getpid()], dtype=np.int64)}
"""


def _private_shm_allowed() -> bool:
    try:
        probe = subprocess.run([*IN_A_SMALL_SHM, "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


needs_private_shm = pytest.mark.skipif(
    not _private_shm_allowed(),
    reason="needs root and `unshare -m` to mount a 64 MiB tmpfs on /dev/shm privately",
)


def write_echo(repo: Path, name: str) -> None:
    config = {
        "backend": "python",
        "max_batch_size": 0,
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [-1]}],
        "outputs": [
            {"name": "Y", "datatype": "FP32", "shape": [-1]},
            {"name": "PID", "datatype": "INT64", "shape": [1]},
        ],
        "python": {"isolation": "process"},
    }
    write_python_model(repo, name, config, ECHO_PY)


@pytest.fixture(scope="module")
def small_shm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("shmrepo")
    write_echo(repo, "big")
    write_echo(repo, "other")
    server = start_server(
        repo,
        tmp_path_factory.mktemp("shmserver"),
        "--max-request-bytes", str(128 * MiB), "--max-tensor-elements", str(32 * MiB),
        prefix=IN_A_SMALL_SHM,
    )  # fmt: skip
    yield server
    server.stop()


def infer(server: RunningServer, model: str, x: np.ndarray) -> tuple[int, Any]:
    """A binary V2 request; (status, (Y, PID)) when answered, (status, error) otherwise."""
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "X",
                    "datatype": "FP32",
                    "shape": [x.size],
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "outputs": [{"name": "Y", "parameters": {"binary_data": True}}, {"name": "PID"}],
        }
    ).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        conn.request(
            "POST",
            f"/v2/models/{model}/infer",
            body=head + x.tobytes(),
            headers={"Inference-Header-Content-Length": str(len(head))},
        )
        resp = conn.getresponse()
        body = resp.read()
        length = resp.getheader("Inference-Header-Content-Length")
    finally:
        conn.close()
    if resp.status != 200:
        return resp.status, json.loads(body)["error"]
    n = int(length or len(body))
    answer = json.loads(body[:n])
    pid = next(o["data"][0] for o in answer["outputs"] if o["name"] == "PID")
    return 200, (np.frombuffer(body[n:], dtype=np.float32), pid)


def request_of(mib: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random(mib * MiB // 4, dtype=np.float32)


def assert_names_shm(message: str) -> None:
    assert "shared memory is full" in message and "/dev/shm (64 MiB," in message, message
    assert "MiB free" in message and "--shm-size" in message, message


def grpc_infer(server: RunningServer, model: str, x: np.ndarray) -> Any:
    client = tgrpc.InferenceServerClient(server.grpc)
    inp = tgrpc.InferInput("X", [x.size], "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp])


@needs_private_shm
def test_requests_larger_than_shm_never_kill_the_server(small_shm_server: RunningServer) -> None:
    server = small_shm_server
    status, (_, worker) = infer(server, "big", request_of(1, 0))
    assert status == 200
    for i, mib in enumerate((40, 40, 48, 72)):
        x = request_of(mib, i)
        status, answer = infer(server, "big", x)
        assert server.proc.poll() is None, f"the server died at the {mib} MiB request"
        if mib == 72:  # more than the whole /dev/shm: refused, naming it
            assert status == 507, answer
            assert_names_shm(answer)
            continue
        assert status == 200, f"{mib} MiB: {status} {answer}"
        np.testing.assert_array_equal(answer[0], x)
        assert answer[1] == worker, "the worker was replaced"
    for model in ("big", "other"):
        x = request_of(1, 9)
        status, answer = infer(server, model, x)
        assert status == 200, f"{model}: {status} {answer}"
        np.testing.assert_array_equal(answer[0], x)
    assert infer(server, "big", request_of(1, 9))[1][1] == worker
    log = server.log()
    assert "SIGBUS" not in log
    assert "outputs cross the pipe (slower): shared memory is full" in log


@needs_private_shm
def test_grpc_batch_larger_than_shm_is_resource_exhausted(small_shm_server: RunningServer) -> None:
    with pytest.raises(InferenceServerException) as refused:
        grpc_infer(small_shm_server, "big", request_of(72, 3))
    assert refused.value.status() == str(grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert_names_shm(refused.value.message())
    x = request_of(1, 4)
    np.testing.assert_array_equal(grpc_infer(small_shm_server, "big", x).as_numpy("Y"), x)


def test_deploy_files_give_dev_shm_room() -> None:
    deployment = next(yaml.safe_load_all((ROOT / "deploy/k8s/deployment.yaml").read_text()))
    pod = deployment["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    volume = next(v for v in pod["volumes"] if v["name"] == mounts["/dev/shm"])
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    assert (
        "docker run --rm -p 8000:8000 -p 8001:8001 --shm-size=1g"
        in (ROOT / "deploy/README.md").read_text()
    )
    assert "--shm-size" in (ROOT / "deploy/Dockerfile").read_text()
