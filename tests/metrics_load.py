"""A real server with two models (one cached) and a small mixed load, for the tests of what
reads its metrics: alert rules, the Grafana dashboard and the live ``/dashboard`` page."""

from __future__ import annotations

import random
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from examples.build_repository import build_mlp
from tests.conftest import RunningServer, start_server
from tests.models import build_scale

# Every family name a /metrics line can carry (histograms expose _bucket/_sum/_count).
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{|\s)", re.MULTILINE)


def build_metrics_repository(root: Path) -> Path:
    """``mlp`` (batched, a p99 objective, no cache) and ``scale`` (response cache in memory)."""
    build_mlp(root / "mlp" / "1" / "model.onnx")
    (root / "mlp" / "config.yaml").write_text(
        "max_batch_size: 32\n"
        "dynamic_batching: {max_queue_delay_us: 2000}\n"
        "slo: {p99_ms: 250}\n"
        "warmup: {batch_sizes: [1], iterations: 1}\n"
    )
    build_scale(root / "scale" / "1" / "model.onnx", 2.0)
    (root / "scale" / "config.yaml").write_text(
        "max_batch_size: 8\nresponse_cache: {memory: {max_bytes: 1000000, ttl_s: 60}}\n"
    )
    return root


class Load:
    """Client threads sending a mix of requests until stopped; counts answers by status.

    Per thread and round: one ``mlp`` request with fresh inputs, one ``scale`` request from a
    small pool (cache hits after the first of each), and now and then a malformed body (400),
    a 1 µs timeout (504) or an unknown model (404), so every panel has something to show. ``pause_s`` keeps the load
    light on a shared 2-core machine.
    """

    def __init__(self, base: str, threads: int = 2, pause_s: float = 0.004) -> None:
        self.base = base
        self.pause_s = pause_s
        self.statuses: Counter[int] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)
        ]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop sending and wait for the answers still in flight."""
        self._stop.set()
        for t in self._threads:
            t.join(10)

    def sent(self) -> int:
        with self._lock:
            return sum(self.statuses.values())

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        pool = [[float(i)] * 4 for i in range(16)]
        with httpx.Client(base_url=self.base, timeout=10) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                mlp = {"inputs": [_tensor("input", [rng.random() for _ in range(256)])]}
                if n % 40 == 0:
                    mlp["parameters"] = {"timeout": 1}
                bodies = [("mlp", mlp), ("scale", {"inputs": [_tensor("x", rng.choice(pool))]})]
                if n % 25 == 0:
                    bodies.append(("mlp", {"inputs": [{"name": "input", "shape": [1, 3]}]}))
                if n % 50 == 0:
                    bodies.append(("no_such_model", mlp))
                for model, body in bodies:
                    r = client.post(f"/v2/models/{model}/infer", json=body)
                    with self._lock:
                        self.statuses[r.status_code] += 1
                time.sleep(self.pause_s)


def _tensor(name: str, data: list[float]) -> dict[str, object]:
    return {"name": name, "shape": [1, len(data)], "datatype": "FP32", "data": data}


@contextmanager
def loaded_server(
    tmp: Path, *server_args: str, **load: float
) -> Iterator[tuple[RunningServer, Load]]:
    """A fresh server on the metrics repository with the load running."""
    server = start_server(build_metrics_repository(tmp / "repo"), tmp / "server", *server_args)
    try:
        with Load(server.base, **load) as running:  # type: ignore[arg-type]
            yield server, running
    finally:
        server.stop()


def scrape(server: RunningServer) -> str:
    r = httpx.get(f"{server.base}/metrics", timeout=10)
    assert r.status_code == 200, r.text
    return r.text


def sample_names(exposition: str) -> set[str]:
    """Names of every sample in a Prometheus text exposition."""
    return set(_SAMPLE.findall(exposition))


def sample_value(exposition: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in exposition.splitlines():
        if not line.startswith(name + "{"):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total
