"""Dynamic batching under concurrency, overload, timeouts and draining, on real servers."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest

from tests.conftest import RunningServer, start_server
from tests.models import build_slow_repository, write_python_model
from tests.v2 import infer_body


def _batch_histogram(metrics: str, model: str) -> dict[str, float]:
    pattern = rf'rtserve_batch_size_bucket{{le="([^"]+)",model="{model}",version="1"}} (\S+)'
    return {le: float(v) for le, v in re.findall(pattern, metrics)}


def _fp32_body(name: str, x: np.ndarray) -> dict:
    """A V2 JSON request with one FP32 input tensor."""
    return {
        "inputs": [
            {"name": name, "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}
        ]
    }


async def _fire(
    base: str, bodies: list[dict], model: str, timeout: float = 60.0
) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=timeout) as client:
        return await asyncio.gather(
            *(client.post(f"/v2/models/{model}/infer", json=b) for b in bodies)
        )


@pytest.mark.parametrize("model", ["mlp", "mlp_threads"], ids=["inline", "two-threaded-instances"])
def test_200_concurrent_requests_each_get_their_own_output(
    server: RunningServer, test_repo: Path, model: str
) -> None:
    rng = np.random.default_rng(7)
    xs = rng.normal(size=(200, 256)).astype(np.float32)
    bodies = [
        {
            "id": str(i),
            "inputs": [
                {"name": "input", "shape": [1, 256], "datatype": "FP32", "data": xs[i].tolist()}
            ],
        }
        for i in range(200)
    ]
    responses = asyncio.run(_fire(server.base, bodies, model))
    session = ort.InferenceSession(str(test_repo / model / "1" / "model.onnx"))
    want = session.run(None, {"input": xs})[0]
    for i, r in enumerate(responses):
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["id"] == str(i)
        np.testing.assert_allclose(doc["outputs"][0]["data"], want[i], rtol=1e-4, atol=1e-5)
    hist = _batch_histogram(httpx.get(f"{server.base}/metrics").text, model)
    assert hist["+Inf"] > 0
    assert hist["1.0"] < hist["+Inf"], f"no batch larger than 1: {hist}"


def test_multi_row_requests_are_split_back(server: RunningServer, test_repo: Path) -> None:
    rng = np.random.default_rng(8)
    sizes = [1, 3, 2, 5, 1, 4, 7, 2]
    xs = [rng.normal(size=(n, 256)).astype(np.float32) for n in sizes]
    bodies = [_fp32_body("input", x) for x in xs]
    responses = asyncio.run(_fire(server.base, bodies, "mlp"))
    session = ort.InferenceSession(str(test_repo / "mlp" / "1" / "model.onnx"))
    for x, r in zip(xs, responses, strict=True):
        out = r.json()["outputs"][0]
        assert out["shape"] == [x.shape[0], 10]
        np.testing.assert_allclose(
            np.array(out["data"]).reshape(-1, 10),
            session.run(None, {"input": x})[0],
            rtol=1e-4,
            atol=1e-5,
        )


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory: pytest.TempPathFactory):
    repo = build_slow_repository(
        tmp_path_factory.mktemp("slow-repo"), max_queue_size=3, delay_us=300_000
    )
    s = start_server(repo, tmp_path_factory.mktemp("slow-server"))
    yield s
    s.stop()


def _slow_body(i: int, **params: object) -> dict:
    return {"id": str(i), **infer_body("x", [i, i, i, i], [1, 4], **params)}


def test_overload_returns_503_with_retry_after_while_admitted_complete(
    slow_server: RunningServer,
) -> None:
    async def scenario() -> list[tuple[float, httpx.Response]]:
        async with httpx.AsyncClient(base_url=slow_server.base, timeout=30) as client:
            start = time.perf_counter()

            async def one(i: int) -> tuple[float, httpx.Response]:
                r = await client.post("/v2/models/slow/infer", json=_slow_body(i))
                return time.perf_counter() - start, r

            return await asyncio.gather(*(one(i) for i in range(20)))

    results = asyncio.run(scenario())
    ok = [(t, r) for t, r in results if r.status_code == 200]
    refused = [(t, r) for t, r in results if r.status_code == 503]
    assert len(ok) + len(refused) == 20
    assert 1 <= len(ok) <= 6, [r.status_code for _, r in results]
    assert len(refused) >= 14
    for t, r in refused:
        assert r.headers["retry-after"] == "1"
        assert "queue is full" in r.json()["error"]
        assert t < 0.25, f"refusal took {t:.3f} s; admitted requests wait 0.3 s"
    for _, r in ok:
        i = float(r.json()["id"])
        assert r.json()["outputs"][0]["data"] == [3 * i] * 4


def test_request_timeout_is_answered_with_504(slow_server: RunningServer) -> None:
    start = time.perf_counter()
    r = httpx.post(
        f"{slow_server.base}/v2/models/slow/infer", json=_slow_body(1, timeout=20_000), timeout=10
    )
    elapsed = time.perf_counter() - start
    assert r.status_code == 504
    assert "timed out after 20 ms" in r.json()["error"]
    assert elapsed < 0.25
    ok = httpx.post(f"{slow_server.base}/v2/models/slow/infer", json=_slow_body(2), timeout=10)
    assert ok.status_code == 200


def test_grpc_overload_is_unavailable(slow_server: RunningServer) -> None:
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    async def scenario() -> list[grpc.StatusCode]:
        async with grpc.aio.insecure_channel(slow_server.grpc) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)

            async def one(i: int) -> grpc.StatusCode:
                request = pb.ModelInferRequest(model_name="slow")
                request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
                request.raw_input_contents.append(np.full(4, i, np.float32).tobytes())
                try:
                    await stub.ModelInfer(request, timeout=10)
                    return grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    return exc.code()

            return await asyncio.gather(*(one(i) for i in range(12)))

    codes = asyncio.run(scenario())
    assert grpc.StatusCode.UNAVAILABLE in codes and grpc.StatusCode.OK in codes
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}


def test_drain_finishes_in_flight_requests_and_refuses_new_ones(tmp_path: Path) -> None:
    repo = build_slow_repository(tmp_path / "repo", max_queue_size=64, delay_us=400_000)
    s = start_server(repo, tmp_path / "server", "--grace-period", "10")

    async def scenario() -> tuple[list[httpx.Response], list[int]]:
        async with httpx.AsyncClient(base_url=s.base, timeout=30) as client:
            in_flight = [
                asyncio.create_task(client.post("/v2/models/slow/infer", json=_slow_body(i)))
                for i in range(3)
            ]
            await asyncio.sleep(0.15)  # all three admitted and waiting for their batch
            s.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.05)
            late: list[int] = []
            async with httpx.AsyncClient(base_url=s.base, timeout=5) as fresh:
                try:
                    late.append(
                        (await fresh.post("/v2/models/slow/infer", json=_slow_body(9))).status_code
                    )
                    late.append((await fresh.get("/v2/health/ready")).status_code)
                except httpx.TransportError:
                    late.append(-1)  # listener already closed: also a refusal
            return list(await asyncio.gather(*in_flight)), late

    try:
        done, late = asyncio.run(scenario())
        assert [r.status_code for r in done] == [200, 200, 200]
        assert [r.json()["outputs"][0]["data"][0] for r in done] == [0.0, 3.0, 6.0]
        assert late and all(code in (503, -1) for code in late), late
        assert s.proc.wait(15) == 0
    finally:
        s.stop()


STUCK_MODEL = """
import threading


class Model:
    def load(self, context):
        self.never = threading.Event()

    def infer(self, inputs):
        if (inputs["x"] == 7).any():  # never the warmup's input
            self.never.wait(120)
        return {"y": inputs["x"]}
"""


def test_a_request_stuck_in_a_models_code_does_not_keep_the_server_from_exiting(
    tmp_path: Path,
) -> None:
    """SIGTERM while a model's own code never returns: after the grace period and
    ``STOP_MODELS_S`` the process exits (status 1), saying which model was still running,
    instead of waiting for the stuck thread forever."""
    from rtserve.server.app import STOP_MODELS_S

    config = (
        "backend: python\nmax_batch_size: 4\n"
        "inputs: [{name: x, datatype: FP32, shape: [1]}]\n"
        "outputs: [{name: y, datatype: FP32, shape: [1]}]\n"
    )
    write_python_model(tmp_path / "repo", "stuck", config, STUCK_MODEL)
    s = start_server(tmp_path / "repo", tmp_path / "server", "--grace-period", "0.5")
    try:
        body = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [7.0]}]}
        with pytest.raises(httpx.TimeoutException):  # the model never answers
            httpx.post(f"{s.base}/v2/models/stuck/infer", json=body, timeout=0.5)
        start = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(0.5 + STOP_MODELS_S + 10) == 1
        assert time.monotonic() - start < 0.5 + STOP_MODELS_S + 5
        log = s.log_path.read_text()
        assert "models still running requests" in log and "stuck:1" in log, log[-2000:]
    finally:
        s.stop()


def test_requests_with_different_sequence_lengths_batch_separately(server: RunningServer) -> None:
    rng = np.random.default_rng(11)
    xs = [rng.normal(size=(1 + i % 2, 3 + i % 3)).astype(np.float32) for i in range(24)]
    bodies = [_fp32_body("x", x) for x in xs]
    responses = asyncio.run(_fire(server.base, bodies, "ragged"))
    for x, r in zip(xs, responses, strict=True):
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["outputs"][0]["data"], x.sum(axis=1), rtol=1e-5)
    hist = _batch_histogram(httpx.get(f"{server.base}/metrics").text, "ragged")
    assert hist["1.0"] < hist["+Inf"], f"no batch larger than 1: {hist}"


def test_model_without_config_batches_by_default(server: RunningServer) -> None:
    config = httpx.get(f"{server.base}/v2/models/noconfig/config").json()
    assert config["max_batch_size"] == 32
    assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}]
    body = {"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "data": [1.0] * 8}]}
    r = httpx.post(f"{server.base}/v2/models/noconfig/infer", json=body)
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [5.0] * 8
