"""A compression bomb is refused without stalling other clients (it is inflated on a thread)."""

from __future__ import annotations

import gzip
import json
import threading
import time
from pathlib import Path

import httpx

from tests.conftest import start_server
from tests.models import build_scale

BODY = json.dumps(
    {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
).encode()


def test_gzip_bomb_gets_413_while_other_clients_are_answered(tmp_path: Path) -> None:
    build_scale(tmp_path / "repo" / "a" / "1" / "model.onnx", 2.0)
    (tmp_path / "repo" / "a" / "config.yaml").write_text("max_batch_size: 4\n")
    s = start_server(tmp_path / "repo", tmp_path / "s")
    bomb = gzip.compress(b" " * (200 * 1024 * 1024), compresslevel=9)  # ~200 KB -> 200 MiB
    url = f"{s.base}/v2/models/a/infer"
    latencies: list[float] = []
    stop = threading.Event()

    def valid() -> None:
        with httpx.Client(timeout=10) as client:
            while not stop.is_set():
                t0 = time.perf_counter()
                r = client.post(url, content=BODY)
                assert r.status_code == 200
                latencies.append(time.perf_counter() - t0)

    worker = threading.Thread(target=valid)
    try:
        worker.start()
        time.sleep(0.3)
        before = len(latencies)
        with httpx.Client(timeout=30) as client:
            for _ in range(3):
                r = client.post(url, content=bomb, headers={"content-encoding": "gzip"})
                assert r.status_code == 413
                assert "max_decompressed_bytes" in r.json()["error"]
        time.sleep(0.2)
        stop.set()
        worker.join()
        during = latencies[before:]
        assert len(during) > 10
        # A bomb inflated on the loop stalls everyone for hundreds of ms; on a thread the
        # valid client keeps being answered.
        assert sorted(during)[len(during) // 2] < 0.05, sorted(during)[-5:]
        # A small gzip body is still served.
        r = httpx.post(url, content=gzip.compress(BODY), headers={"content-encoding": "gzip"})
        assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [2, 4, 6, 8]
    finally:
        stop.set()
        s.stop()
