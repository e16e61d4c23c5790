"""The SLO controller in a real server: overload, cancellation and priorities end to end.

The model is a Python-backend model whose batch takes ``fixed + per_row * rows`` of sleep
(deterministic on a shared machine) and that logs every row it computes, so a test can
prove which requests were never run.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from rtserve.protocol import grpc_service_pb2 as pb
from rtserve.protocol import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import RunningServer, start_server
from tests.metrics_load import sample_value
from tests.models import write_python_model
from tests.v2 import infer_body

OBJECTIVE_MS = 250
CAPACITY = 8 / 0.052  # rows/s of the sleepy models at full batches

MODEL_PY = """
import os
import time
import numpy as np

class Model:
    def load(self, context):
        p = context.parameters
        self.fixed = float(p["fixed_ms"]) / 1e3
        self.per_row = float(p["per_row_ms"]) / 1e3
        self.log = p["log"]

    def infer(self, inputs):
        x = inputs["X"]
        # X == -1: a batch that keeps the instance busy while a test arranges the queue: it
        # says when it starts and runs until the test creates <log>.go.
        if (x == -1).any():
            with open(self.log, "a") as f:
                f.write("-1\\n")
            go = self.log + ".go"
            end = time.monotonic() + 10
            while not os.path.exists(go) and time.monotonic() < end:
                time.sleep(0.002)
            if os.path.exists(go):
                os.remove(go)
        else:
            time.sleep(self.fixed + self.per_row * len(x))
        with open(self.log, "a") as f:
            f.write("".join(f"{v:g}\\n" for v in x[:, 0]))
        return {"Y": x * 2}
"""


def _model(root: Path, name: str, log: Path, fixed_ms: float, per_row_ms: float, **extra) -> None:
    config = {
        "backend": "python",
        "max_batch_size": 8,
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [1]}],
        "outputs": [{"name": "Y", "datatype": "FP32", "shape": [1]}],
        "python": {"parameters": {"fixed_ms": fixed_ms, "per_row_ms": per_row_ms, "log": str(log)}},
        **extra,
    }
    write_python_model(root, name, config, MODEL_PY)


@pytest.fixture(scope="module")
def slo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, Path]]:
    root = tmp_path_factory.mktemp("slo-repo")
    logs = tmp_path_factory.mktemp("slo-logs")
    # 20 ms + 4 ms/row: a full batch of 8 takes 52 ms, ~150 rows/s at most.
    _model(root, "sleepy", logs / "sleepy", 20, 4, slo={"p99_ms": OBJECTIVE_MS})
    _model(
        root, "ranked", logs / "ranked", 20, 4, slo={"p99_ms": OBJECTIVE_MS}, priority_levels=2,
    )  # fmt: skip
    # Long objective: nothing ages past the bounded wait while a test arranges the queue.
    _model(
        root, "ordered", logs / "ordered", 1, 0, max_batch_size=2, slo={"p99_ms": 3000},
        priority_levels=2,
    )  # fmt: skip
    _model(root, "fixed", logs / "fixed", 1, 0, dynamic_batching={"max_queue_delay_us": 0})
    # Each test that stalls a model on purpose gets its own: the stall teaches the controller
    # that the model is slow, which would change what the next test sees.
    _model(root, "patient", logs / "patient", 1, 0, slo={"p99_ms": 3000})
    _model(root, "deadline", logs / "deadline", 20, 4, slo={"p99_ms": OBJECTIVE_MS})
    _model(root, "early", logs / "early", 20, 4, slo={"p99_ms": OBJECTIVE_MS})
    server = start_server(root, tmp_path_factory.mktemp("slo-server"))
    yield server, logs
    server.stop()


def _body(x: float, **params: object) -> bytes:
    return json.dumps(infer_body("X", [x], [1, 1], **params)).encode()


def _grpc_request(model: str, x: float) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="X", datatype="FP32", shape=[1, 1])
    tensor.contents.fp32_contents.append(x)
    return request


def _request(port: int, model: str, body: bytes) -> bytes:
    return (
        f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


def _server_total_ms(headers: dict[str, str]) -> float:
    found = re.search(r"total;dur=([\d.]+)", headers.get("server-timing", ""))
    assert found, headers
    return float(found.group(1))


async def _open_loop(
    port: int, model: str, rate: float, seconds: float, bodies: list[bytes], connections: int = 48
) -> list[tuple[int, int, dict[str, str]]]:
    """Poisson arrivals at ``rate``/s for ``seconds``; (body index, status, headers) each.
    A request waits in the client for a free connection; every one is answered or fails."""
    rng = np.random.default_rng(11)
    offsets = np.cumsum(rng.exponential(1 / rate, size=int(rate * seconds * 1.3) + 8))
    offsets = offsets[offsets < seconds]
    todo: asyncio.Queue[tuple[int, float]] = asyncio.Queue()
    results: list[tuple[int, int, dict[str, str]]] = []
    start = time.perf_counter()

    async def feed() -> None:
        for i, t in enumerate(offsets):
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            todo.put_nowait((i, t))
        for _ in range(connections):
            todo.put_nowait((-1, 0.0))

    async def worker() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            i, _ = await todo.get()
            if i < 0:
                break
            writer.write(_request(port, model, bodies[i % len(bodies)]))
            status, headers, _ = await _read_response(reader)
            results.append((i, status, headers))
        writer.close()

    await asyncio.gather(feed(), *(worker() for _ in range(connections)))
    assert len(results) == len(offsets)
    return results


def _metrics(server: RunningServer) -> str:
    return httpx.get(f"{server.base}/metrics", timeout=10).text


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _logged(logs: Path, model: str) -> list[float]:
    path = logs / model
    return [float(v) for v in path.read_text().split()] if path.exists() else []


def _release(logs: Path, model: str) -> None:
    """Let the stalling batch of ``_stall`` finish."""
    (logs / f"{model}.go").touch()


async def _stall(client: httpx.AsyncClient, logs: Path, model: str) -> asyncio.Future:
    """Start a batch that holds the model's only instance until ``_release``; return once
    it runs."""
    before = _logged(logs, model).count(-1.0)
    busy = asyncio.ensure_future(client.post(f"/v2/models/{model}/infer", content=_body(-1)))
    deadline = time.monotonic() + 5
    while _logged(logs, model).count(-1.0) == before:
        assert time.monotonic() < deadline, "the stalling batch never started"
        await asyncio.sleep(0.005)
    return busy


async def _queued(server: RunningServer, model: str, depth: int) -> None:
    """Wait until the model's queue holds ``depth`` requests."""
    deadline = time.monotonic() + 5
    async with httpx.AsyncClient(timeout=5) as client:
        while True:
            text = (await client.get(f"{server.base}/metrics")).text
            if _metric(text, "rtserve_queue_depth", model=model) >= depth:
                return
            assert time.monotonic() < deadline, f"{model}: queue never reached {depth}"
            await asyncio.sleep(0.005)


# ---------------------------------------------------------------------------- overload
def test_under_3x_overload_admitted_requests_meet_the_objective_and_none_is_lost(
    slo_server: tuple[RunningServer, Path],
) -> None:
    server, _ = slo_server
    results = asyncio.run(_open_loop(server.http_port, "sleepy", 3 * CAPACITY, 2, [_body(1.0)]))
    ok = [h for _, s, h in results if s == 200]
    refused = [h for _, s, h in results if s == 429]
    assert len(ok) + len(refused) == len(results), {s for _, s, _ in results}
    assert refused and ok
    for h in refused:
        assert int(h["retry-after"]) >= 1
    totals = sorted(_server_total_ms(h) for h in ok)
    # Nearly all admitted answers are within the objective, and none waits in a growing queue
    # (a fixed window here answers in seconds). Not a strict p99: answers come in batches
    # of 8, so one batch stalled by the shared 2-core machine (seen: a 52 ms sleep taking
    # 215 ms) is already ~3% of ~300 answers.
    late = [t for t in totals if t > OBJECTIVE_MS]
    assert len(late) <= 0.05 * len(totals), f"{len(late)} of {len(totals)} late"
    assert totals[-1] <= 2 * OBJECTIVE_MS, totals[-10:]
    # The model was kept busy: most of its capacity went to admitted requests.
    assert len(ok) >= 0.6 * CAPACITY * 2, (len(ok), len(refused))
    text = _metrics(server)
    assert _metric(text, "rtserve_shed_requests_total", model="sleepy", reason="objective") >= len(
        refused
    )
    assert _metric(text, "rtserve_slo_goodput_requests_total", model="sleepy") >= 0.95 * len(ok)
    assert _metric(text, "rtserve_slo_target_batch_rows", model="sleepy") >= 1
    assert 0.25 <= _metric(text, "rtserve_slo_budget_factor", model="sleepy") <= 1.0
    assert _metric(text, "rtserve_slo_predicted_seconds_count", model="sleepy") >= len(ok)
    assert _metric(text, "rtserve_slo_observed_seconds_count", model="sleepy") >= len(ok)


def test_refusal_is_429_with_retry_after_and_grpc_resource_exhausted(
    slo_server: tuple[RunningServer, Path],
) -> None:
    server, _ = slo_server

    async def scenario() -> None:
        # A burst far beyond what the objective can hold: some are refused at once.
        async with httpx.AsyncClient(base_url=server.base, timeout=30) as client:
            start = time.perf_counter()

            async def one(i: int) -> tuple[float, httpx.Response]:
                r = await client.post("/v2/models/sleepy/infer", content=_body(float(i)))
                return time.perf_counter() - start, r

            results = await asyncio.gather(*(one(i) for i in range(60)))
        refused = [(t, r) for t, r in results if r.status_code == 429]
        assert refused, [r.status_code for _, r in results]
        for _, r in refused:
            assert "latency objective" in r.json()["error"]
            assert r.headers["retry-after"] == "1"
        channel = grpc.aio.insecure_channel(server.grpc)
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        calls = [stub.ModelInfer(_grpc_request("sleepy", float(i))) for i in range(60)]
        codes = []
        for c in calls:
            try:
                await c
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    # When to retry: gRPC's retry pushback (ms) and the HTTP header's seconds.
                    trailers = dict(exc.trailing_metadata() or ())
                    assert 1 <= int(trailers["grpc-retry-pushback-ms"]) < 1500, trailers
                    assert trailers["retry-after"] == "1", trailers
        await channel.close()
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}

    asyncio.run(scenario())


def test_a_deadline_the_queue_cannot_meet_is_refused_at_once(
    slo_server: tuple[RunningServer, Path],
) -> None:
    server, logs = slo_server

    async def scenario() -> tuple[int, str, float]:
        async with httpx.AsyncClient(base_url=server.base, timeout=30) as client:
            busy = await _stall(client, logs, "deadline")
            ahead = [
                asyncio.ensure_future(
                    client.post("/v2/models/deadline/infer", content=_body(100.0 + i))
                )
                for i in range(5)
            ]
            await _queued(server, "deadline", 5)
            start = time.perf_counter()
            # 40 ms: one request's batch fits (24 ms), not one behind five queued (44 ms).
            r = await client.post("/v2/models/deadline/infer", content=_body(31.0, timeout=40_000))
            took = time.perf_counter() - start
            _release(logs, "deadline")
            assert (await busy).status_code == 200
            assert [x.status_code for x in await asyncio.gather(*ahead)] == [200] * 5
            return r.status_code, r.text, took

    status, text, took = asyncio.run(scenario())
    assert status == 429 and "deadline" in text, text
    assert took < 0.3
    assert 31.0 not in _logged(logs, "deadline")


def test_an_overloaded_model_refuses_before_decoding(
    slo_server: tuple[RunningServer, Path],
) -> None:
    """Once admission refuses every request, a request is refused before its body is
    decoded: a malformed one gets the same 429 (HTTP) / RESOURCE_EXHAUSTED (gRPC) as a valid
    one, because decoding it would cost what refusing saves. The admitted requests are all
    answered, and once the queue drains the same malformed request gets its 400."""
    server, logs = slo_server
    malformed = b'{"inputs": [{"name": "X", "shape": [1, 1], "datatype": "FP32", "data": ['

    def bad_grpc() -> pb.ModelInferRequest:
        req = pb.ModelInferRequest(model_name="early")
        req.inputs.add(name="X", datatype="FP32", shape=[1, 1])  # no contents
        return req

    async def grpc_code(channel: grpc.aio.Channel) -> grpc.StatusCode:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        try:
            await stub.ModelInfer(bad_grpc())
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    async def scenario() -> None:
        limits = httpx.Limits(max_connections=200)
        channel = grpc.aio.insecure_channel(server.grpc)
        async with httpx.AsyncClient(base_url=server.base, timeout=30, limits=limits) as client:
            busy = await _stall(client, logs, "early")
            admitted = []
            for i in range(120):  # one at a time, until admission refuses one
                post = asyncio.ensure_future(
                    client.post("/v2/models/early/infer", content=_body(200.0 + i))
                )
                # An admitted request waits behind the stalled batch; a refusal comes at
                # once (0.3 s leaves room for a loaded machine).
                done, _ = await asyncio.wait([post], timeout=0.3)
                if done:
                    r = post.result()
                    assert r.status_code == 429, r.text
                    break
                admitted.append(post)
            else:
                raise AssertionError("admission never refused")
            counted = sample_value(
                (await client.get("/metrics")).text,
                "rtserve_requests_total",
                model="early",
                outcome="overloaded",
            )
            # Twice (the second is most often a refusal the scheduler holds, answered as
            # encoded for the first): each echoes its own request id and is counted.
            for request_id in ("first", "second"):
                r = await client.post(
                    "/v2/models/early/infer",
                    content=malformed,
                    headers={"x-request-id": request_id},
                )
                assert r.status_code == 429 and "latency objective" in r.json()["error"], r.text
                assert r.headers["retry-after"] == "1", r.headers
                assert r.headers["x-request-id"] == request_id, r.headers
            metrics = (await client.get("/metrics")).text
            assert (
                sample_value(metrics, "rtserve_requests_total", model="early", outcome="overloaded")
                == counted + 2
            )
            # An HTTP/1.0 client (keep-alive asked for or not) gets its own framing, not the
            # answer encoded for keep-alive HTTP/1.1.
            for extra, connection in (("Connection: keep-alive\r\n", "keep-alive"), ("", "close")):
                reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
                head = _request(server.http_port, "early", malformed).replace(
                    b"HTTP/1.1\r\n", f"HTTP/1.0\r\n{extra}".encode(), 1
                )
                writer.write(head)
                status, headers, _ = await _read_response(reader)
                assert status == 429 and headers.get("connection") == connection, headers
                writer.close()
            assert await grpc_code(channel) == grpc.StatusCode.RESOURCE_EXHAUSTED
            _release(logs, "early")
            assert (await busy).status_code == 200
            codes = [a.status_code for a in await asyncio.gather(*admitted)]
            # A refusal slower than the 50 ms above (a loaded machine) was taken for queued
            # work; any such one is the last posted before the refusal that ended the loop.
            while codes and codes[-1] == 429:
                codes.pop()
            assert codes and codes == [200] * len(codes), codes
            r = await client.post("/v2/models/early/infer", content=malformed)
            assert r.status_code == 400, r.text
            assert await grpc_code(channel) == grpc.StatusCode.INVALID_ARGUMENT
        await channel.close()

    asyncio.run(scenario())


# ---------------------------------------------------------------------------- cancellation
async def _abandon(server: RunningServer, model: str, x: float, reset: bool = True) -> None:
    """Send a request, wait until it is queued, drop the connection before the answer:
    reset (as a killed process or a proxy giving up does) or closed cleanly (as a client
    whose timeout fired does: the server sees the end of input)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
    writer.write(_request(server.http_port, model, _body(x)))
    await writer.drain()
    await _queued(server, model, 1)
    if reset:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()


@pytest.mark.parametrize("reset", [True, False], ids=["reset", "closed"])
@pytest.mark.parametrize("model", ["fixed", "patient"], ids=["fixed-window", "slo"])
def test_disconnected_clients_work_is_not_computed(
    slo_server: tuple[RunningServer, Path], model: str, reset: bool
) -> None:
    server, logs = slo_server
    before = _metric(
        _metrics(server), "rtserve_shed_requests_total", model=model, reason="cancelled"
    )

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.base, timeout=30) as client:
            busy = await _stall(client, logs, model)
            await _abandon(server, model, 42.0, reset)
            await asyncio.sleep(0.1)  # the reset or end of input reaches the server
            _release(logs, model)
            assert (await busy).status_code == 200
            after = await client.post(f"/v2/models/{model}/infer", content=_body(7.0))
            assert after.status_code == 200 and after.json()["outputs"][0]["data"] == [14.0]

    asyncio.run(scenario())
    computed = _logged(logs, model)
    assert 7.0 in computed
    assert 42.0 not in computed
    after = _metric(
        _metrics(server), "rtserve_shed_requests_total", model=model, reason="cancelled"
    )
    assert after == before + 1


def test_cancelled_grpc_call_is_not_computed(slo_server: tuple[RunningServer, Path]) -> None:
    server, logs = slo_server

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(server.grpc) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)

            async with httpx.AsyncClient(base_url=server.base, timeout=30) as client:
                busy = await _stall(client, logs, "patient")
                doomed = stub.ModelInfer(_grpc_request("patient", 43.0))
                await _queued(server, "patient", 1)
                doomed.cancel()
                await asyncio.sleep(0.1)  # the cancellation reaches the server
                _release(logs, "patient")
                assert (await busy).status_code == 200
            await stub.ModelInfer(_grpc_request("patient", 8.0))

    asyncio.run(scenario())
    computed = _logged(logs, "patient")
    assert 8.0 in computed and 43.0 not in computed


# ---------------------------------------------------------------------------- priorities
def test_higher_priority_runs_first(slo_server: tuple[RunningServer, Path]) -> None:
    server, logs = slo_server

    async def scenario() -> list[int]:
        async with httpx.AsyncClient(base_url=server.base, timeout=30) as client:
            busy = await _stall(client, logs, "ordered")
            low = [
                asyncio.ensure_future(
                    client.post("/v2/models/ordered/infer", content=_body(20 + i, priority=2))
                )
                for i in range(3)
            ]
            await _queued(server, "ordered", 3)
            high = [
                asyncio.ensure_future(
                    client.post("/v2/models/ordered/infer", content=_body(10 + i, priority=1))
                )
                for i in range(3)
            ]
            await _queued(server, "ordered", 6)
            _release(logs, "ordered")
            responses = await asyncio.gather(busy, *low, *high)
            return [r.status_code for r in responses]

    assert asyncio.run(scenario()) == [200] * 7
    order = _logged(logs, "ordered")
    first_low = min(order.index(v) for v in (20.0, 21.0, 22.0))
    last_high = max(order.index(v) for v in (10.0, 11.0, 12.0))
    assert last_high < first_low, order


def test_bad_priority_is_a_400_naming_the_field(slo_server: tuple[RunningServer, Path]) -> None:
    server, _ = slo_server
    r = httpx.post(
        f"{server.base}/v2/models/ranked/infer", content=_body(1.0, priority=5), timeout=10
    )
    assert r.status_code == 400
    assert "parameters.priority: expected an integer from 0 (default) to 2" in r.json()["error"]


def test_under_overload_lower_priority_is_shed_first(
    slo_server: tuple[RunningServer, Path],
) -> None:
    server, _ = slo_server
    bodies = [_body(1.0, priority=1), _body(2.0, priority=2)]
    results = asyncio.run(_open_loop(server.http_port, "ranked", 3 * CAPACITY, 2, bodies))
    served = {1: 0, 2: 0}
    offered = {1: 0, 2: 0}
    for i, status, _ in results:
        level = 1 + i % 2
        offered[level] += 1
        assert status in (200, 429)
        served[level] += status == 200
    high, low = served[1] / offered[1], served[2] / offered[2]
    assert high > 1.5 * low, (served, offered)
    text = _metrics(server)
    shed_low = _metric(text, "rtserve_shed_requests_total", model="ranked", priority="2")
    shed_high = _metric(text, "rtserve_shed_requests_total", model="ranked", priority="1")
    assert shed_low > shed_high


def test_the_objective_and_priority_levels_show_in_the_model_config(
    slo_server: tuple[RunningServer, Path],
) -> None:
    """Triton's model configuration, read with tritonclient over HTTP and gRPC: priority
    levels in ``dynamic_batching`` (Triton's fields) and the objective in ``parameters``;
    a model without them reports neither."""
    import tritonclient.grpc as tgrpc
    import tritonclient.http as thttp

    server, _ = slo_server
    http = thttp.InferenceServerClient(server.http)
    ranked = http.get_model_config("ranked")
    assert ranked["dynamic_batching"]["priority_levels"] == 2
    assert ranked["dynamic_batching"]["default_priority_level"] == 2
    assert ranked["parameters"] == {"slo_p99_ms": {"string_value": str(OBJECTIVE_MS)}}
    fixed = http.get_model_config("fixed")
    assert "priority_levels" not in fixed["dynamic_batching"] and "parameters" not in fixed
    rpc = tgrpc.InferenceServerClient(server.grpc)
    config = rpc.get_model_config("ranked").config
    assert config.dynamic_batching.priority_levels == 2
    assert config.dynamic_batching.default_priority_level == 2
    assert config.parameters["slo_p99_ms"].string_value == str(OBJECTIVE_MS)
    plain = rpc.get_model_config("fixed").config
    assert plain.dynamic_batching.priority_levels == 0 and not plain.parameters
    rpc.close()
