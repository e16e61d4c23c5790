"""Single-flight does not hand one client's deadline to another: a real server, a slow
cached Python model, identical requests over HTTP with and without ``parameters.timeout``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import RunningServer, start_server
from tests.models import write_python_model
from tests.v2 import http_infer, infer_body

SLEEP_S = 1.0  # long enough that timing margins hold on a loaded machine
MODEL_PY = f"""
import time

class Model:
    def load(self, context):
        pass

    def infer(self, inputs):
        time.sleep({SLEEP_S})
        return {{"Y": inputs["X"] * 2}}
"""


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("sf-repo")
    config = {
        "backend": "python",
        "max_batch_size": 8,
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "Y", "datatype": "FP32", "shape": [4]}],
        "dynamic_batching": {"max_queue_delay_us": 1000},
        "python": {"isolation": "thread", "batch_timeout_s": 10},
        "response_cache": {"memory": {"max_bytes": 1000000, "ttl_s": 60}},
    }
    write_python_model(repo, "slow", config, MODEL_PY)
    server = start_server(repo, tmp_path_factory.mktemp("sf-server"))
    yield server
    server.stop()


def _post(server: RunningServer, seed: float, timeout_us: int | None = None) -> httpx.Response:
    params = {} if timeout_us is None else {"timeout": timeout_us}
    return http_infer(server, "slow", infer_body("X", [seed] * 4, [1, 4], **params), timeout=30)


def _pair(
    server: RunningServer, seed: float, first_timeout: int | None, second_timeout: int | None
) -> tuple[httpx.Response, httpx.Response, float]:
    """Two identical requests, the second sent while the first leads the single-flight;
    returns both answers and the second's latency in seconds."""
    with ThreadPoolExecutor(2) as pool:
        first: Future[httpx.Response] = pool.submit(_post, server, seed, first_timeout)
        time.sleep(0.2)  # the first is leading by then, even on a loaded machine
        t0 = time.monotonic()
        second = _post(server, seed, second_timeout)
        elapsed = time.monotonic() - t0
        return first.result(), second, elapsed


def test_a_leaders_timeout_does_not_fail_an_identical_request_without_one(
    slow_server: RunningServer,
) -> None:
    leader, follower, _ = _pair(slow_server, 1.0, 100_000, None)
    assert leader.status_code == 504, leader.text
    assert follower.status_code == 200, follower.text
    assert follower.json()["outputs"][0]["data"] == [2.0] * 4
    assert follower.headers["x-rtserve-cache"] == "miss"  # it ran the model itself
    again = _post(slow_server, 1.0)
    assert again.status_code == 200 and again.headers["x-rtserve-cache"] == "memory"


def test_a_followers_own_timeout_still_applies(slow_server: RunningServer) -> None:
    leader, follower, elapsed = _pair(slow_server, 2.0, None, 100_000)
    assert follower.status_code == 504, follower.text
    assert "identical request in flight" in follower.json()["error"]
    assert elapsed < SLEEP_S - 0.1  # its own 100 ms, not the leader's run
    assert leader.status_code == 200 and leader.json()["outputs"][0]["data"] == [4.0] * 4
