"""Several worker processes share the HTTP and gRPC ports and drain together."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import numpy as np
import tritonclient.grpc as tgrpc

from tests.conftest import start_server
from tests.models import build_slow_repository


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def test_two_workers_serve_the_same_ports_and_stop_together(tmp_path: Path) -> None:
    repo = build_slow_repository(tmp_path / "repo", max_queue_size=64, delay_us=0)
    server = start_server(repo, tmp_path / "server", "--workers", "2")
    try:
        workers = _children(server.proc.pid)
        assert len(workers) == 2, workers
        for i in range(30):  # a fresh connection each time: the kernel spreads them
            body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [i] * 4}]}
            r = httpx.post(f"{server.base}/v2/models/slow/infer", json=body)
            assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [3.0 * i] * 4
        client = tgrpc.InferenceServerClient(server.grpc)
        x = tgrpc.InferInput("x", [1, 4], "FP32")
        x.set_data_from_numpy(np.ones((1, 4), np.float32))
        assert client.infer("slow", [x]).as_numpy("y").tolist() == [[3.0] * 4]
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        for pid in workers:
            assert (
                not os.path.exists(f"/proc/{pid}")
                or "zombie" in Path(f"/proc/{pid}/status").read_text()
            )
    finally:
        server.stop()
