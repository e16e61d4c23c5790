"""Every entry into the application behaves the same: ``rtserve serve`` over HTTP/1.1, its
gRPC service on both transports (rtserve's HTTP/2 and grpcio), the Ray deployment's ASGI
side (called with a real ASGI call, and through a real Ray proxy: slow), and the Lambda
handler (real function URL events). Each is asked the same inferences with a client trace
context and a request id; each must continue the client's trace (spans at a real OTLP
receiver), echo the request id, mark a cached answer, time its stages in Server-Timing,
and refuse an unknown model with the same error."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest

from rtserve.protocol import grpc_service_pb2 as pb
from tests.conftest import start_server
from tests.models import build_scale
from tests.ray_serve_entry import ray_serve_base
from tests.test_observability import OtlpReceiver

CLIENT_SPAN = "00f067aa0ba902b7"
ROW = [1.0, 2.0, 3.0, 4.0]
HTTP_STATUS = {"NOT_FOUND": 404}


@dataclass
class Result:
    """One inference's answer as any entry gives it: ``status`` HTTP's (gRPC's code mapped),
    ``headers`` (gRPC: trailing metadata) by lower-case name, ``values`` or ``error``."""

    status: int
    headers: dict[str, str]
    values: list[float] | None = None
    error: str | None = None


# ---------------------------------------------------------------------- the entries
def _json_body(model_input: list[float]) -> bytes:
    doc = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": model_input}]}
    return json.dumps(doc).encode()


def _from_http(status: int, headers: dict[str, str], body: bytes) -> Result:
    headers = {k.lower(): v for k, v in headers.items()}
    doc = json.loads(body)
    if status != 200:
        return Result(status, headers, error=doc["error"])
    return Result(status, headers, values=doc["outputs"][0]["data"])


class HttpEntry:
    def __init__(self, base: str) -> None:
        self.base = base
        self.client = httpx.Client(timeout=60)

    def infer(self, model: str, row: list[float], headers: dict[str, str]) -> Result:
        r = self.client.post(
            f"{self.base}/v2/models/{model}/infer", content=_json_body(row), headers=headers
        )
        return _from_http(r.status_code, dict(r.headers), r.content)

    def close(self) -> None:
        self.client.close()


class GrpcEntry:
    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.call = self.channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )

    def infer(self, model: str, row: list[float], headers: dict[str, str]) -> Result:
        request = pb.ModelInferRequest(model_name=model)
        tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
        tensor.contents.fp32_contents.extend(row)
        try:
            response, call = self.call.with_call(request, metadata=tuple(headers.items()))
        except grpc.RpcError as exc:
            trailers = {k: str(v) for k, v in exc.trailing_metadata() or ()}
            return Result(HTTP_STATUS[exc.code().name], trailers, error=exc.details())
        trailers = {k: str(v) for k, v in call.trailing_metadata() or ()}
        values = np.frombuffer(response.raw_output_contents[0], np.float32).tolist()
        return Result(200, trailers, values=values)

    def close(self) -> None:
        self.channel.close()


class LambdaEntry:
    """The handler called in-process with function URL (payload 2.0) events."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def infer(self, model: str, row: list[float], headers: dict[str, str]) -> Result:
        path = f"/v2/models/{model}/infer"
        event = {
            "version": "2.0", "routeKey": "$default", "rawPath": path, "rawQueryString": "",
            "headers": {"content-type": "application/json", **headers},
            "requestContext": {
                "http": {"method": "POST", "path": path, "protocol": "HTTP/1.1",
                         "sourceIp": "127.0.0.1", "userAgent": "test"},
                "requestId": "id", "stage": "$default",
            },
            "body": _json_body(row).decode(), "isBase64Encoded": False,
        }  # fmt: skip
        out = self.module.handler(event, None)
        raw = out["body"].encode()
        body = base64.b64decode(raw) if out["isBase64Encoded"] else raw
        return _from_http(out["statusCode"], out["headers"], body)

    def close(self) -> None:
        self.module.shutdown()


class AsgiEntry:
    """The Ray deployment's request side (``rtserve.ray.AsgiEntry``) over an Engine,
    called as an ASGI server calls an application: a scope, ``receive`` and ``send``."""

    def __init__(self, repo: Path, config: Path) -> None:
        from rtserve.api.application import Application
        from rtserve.config import load_server_config
        from rtserve.engine import Engine
        from rtserve.ray import ENTRY, FRONT, NO_CONTROL
        from rtserve.ray import AsgiEntry as RayAsgi

        cfg = load_server_config(config, model_repository=repo)
        engine = Engine(cfg)
        app = Application.for_adapter(
            engine.dataplane, cfg, ENTRY, FRONT, control_refusal=NO_CONTROL
        )
        self.engine = engine.sync().start()
        self.entry = RayAsgi(app, cfg, "replica-1")

    async def _asgi(self, path: str, headers: dict[str, str], body: bytes) -> tuple[Any, ...]:
        from starlette.requests import Request

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
            "root_path": "", "query_string": b"", "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8000),
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        }  # fmt: skip
        chunks = [{"type": "http.request", "body": body, "more_body": False}]
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            if chunks:
                return chunks.pop(0)
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        response = await self.entry(Request(scope, receive))
        await response(scope, receive, send)
        start = sent[0]
        out = {k.decode(): v.decode() for k, v in start["headers"]}
        return start["status"], out, b"".join(m.get("body", b"") for m in sent[1:])

    def infer(self, model: str, row: list[float], headers: dict[str, str]) -> Result:
        body = _json_body(row)
        sent = {"content-type": "application/json", "content-length": str(len(body)), **headers}
        status, out, content = self.engine.run(self._asgi(f"/v2/models/{model}/infer", sent, body))
        return _from_http(status, out, content)

    def close(self) -> None:
        self.engine.stop()


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver) -> tuple[Path, Path]:
    """A repository (a: y = 2x, with an in-process response cache) and the server config
    every entry is given (traces to the receiver)."""
    base = tmp_path_factory.mktemp("api")
    repo = base / "repo"
    build_scale(repo / "a" / "1" / "model.onnx", 2.0)
    (repo / "a" / "config.yaml").write_text(
        "max_batch_size: 4\nresponse_cache:\n  memory: {max_bytes: 1000000, ttl_s: 600}\n"
    )
    config = base / "server.yaml"
    config.write_text(f"trace_endpoint: {receiver.url}\ntrace_sample_ratio: 0.0\n")
    return repo, config


class Servers:
    """``rtserve serve`` processes by gRPC transport, started when first asked for (the
    HTTP/1.1 and the HTTP/2 gRPC entries share one)."""

    def __init__(self, repo: Path, config: Path, work: Path) -> None:
        self.repo, self.config, self.work = repo, config, work
        self.running: dict[str, Any] = {}

    def get(self, grpc_server: str) -> Any:
        if grpc_server not in self.running:
            self.running[grpc_server] = start_server(
                self.repo, self.work / grpc_server, "--config", str(self.config),
                "--grpc-server", grpc_server,
            )  # fmt: skip
        return self.running[grpc_server]

    def stop(self) -> None:
        for server in self.running.values():
            server.stop()


@pytest.fixture(scope="module")
def servers(
    setup: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Servers]:
    s = Servers(*setup, tmp_path_factory.mktemp("servers"))
    yield s
    s.stop()


def _http(repo: Path, config: Path, servers: Servers) -> Iterator[Any]:
    yield HttpEntry(servers.get("rtserve").base)


def _grpc_h2(repo: Path, config: Path, servers: Servers) -> Iterator[Any]:
    yield GrpcEntry(servers.get("rtserve").grpc)


def _grpcio(repo: Path, config: Path, servers: Servers) -> Iterator[Any]:
    yield GrpcEntry(servers.get("grpcio").grpc)


def _lambda(repo: Path, config: Path, servers: Servers) -> Iterator[Any]:
    import rtserve.serverless as module

    module.shutdown()
    with pytest.MonkeyPatch.context() as env:
        env.setenv(module.ENV_REPOSITORY, str(repo))
        env.setenv(module.ENV_CONFIG, str(config))
        yield LambdaEntry(module)


def _asgi(repo: Path, config: Path, servers: Servers) -> Iterator[Any]:
    pytest.importorskip("starlette")
    pytest.importorskip("ray")  # (rtserve.ray imports Ray Serve's types)
    yield AsgiEntry(repo, config)


def _ray(repo: Path, config: Path, servers: Servers) -> Iterator[Any]:
    with ray_serve_base(repo, config) as base:
        yield HttpEntry(base)


ENTRIES: dict[str, Callable[[Path, Path, Servers], Iterator[Any]]] = {
    "http": _http,
    "grpc-h2": _grpc_h2,
    "grpcio": _grpcio,
    "lambda": _lambda,
    "asgi": _asgi,
    "ray": _ray,
}


@pytest.fixture(
    scope="module",
    params=[
        "http",
        "grpc-h2",
        "grpcio",
        "lambda",
        "asgi",
        pytest.param("ray", marks=pytest.mark.slow),
    ],
)
def entry(
    request: pytest.FixtureRequest,
    setup: tuple[Path, Path],
    servers: Servers,
) -> Iterator[tuple[str, Any]]:
    repo, config = setup
    made = ENTRIES[request.param](repo, config, servers)
    way_in = next(made)
    try:
        yield request.param, way_in
    finally:
        way_in.close()
        next(made, None)


# ---------------------------------------------------------------------- the behaviour
def _trace_id(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:32]


def _row(name: str, test: int) -> list[float]:
    """An input row of its own for each entry and test (the response cache keys on it)."""
    seed = int(hashlib.sha256(name.encode()).hexdigest()[:6], 16)
    return [float(seed % 1000 + test * 1000 + i) for i in range(4)]


def _timing_names(value: str) -> list[str]:
    return [part.strip().split(";")[0] for part in value.split(",")]


def test_every_entry_continues_the_clients_trace_and_echoes_its_request_id(
    entry: tuple[str, Any], receiver: OtlpReceiver
) -> None:
    name, way_in = entry
    trace_id = _trace_id(name)
    headers = {"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01", "x-request-id": f"id-{name}"}
    row = _row(name, 1)
    result = way_in.infer("a", row, headers)
    assert (result.status, result.values) == (200, [2 * v for v in row])
    # Ray's proxy echoes the id itself, so the replica leaves the header to it
    assert result.headers.get("x-request-id") == (None if name == "asgi" else f"id-{name}")
    timing = _timing_names(result.headers["server-timing"])
    assert timing == ["queue", "compute", "batch", "cache", "total"]
    assert result.headers.get("x-rtserve-cache") == "miss"
    deadline = time.monotonic() + 30  # (spans are exported in batches, every few seconds)
    while time.monotonic() < deadline:
        spans = [s for s in list(receiver.spans) if s.trace_id.hex() == trace_id]
        roots = [s for s in spans if s.parent_span_id.hex() == CLIENT_SPAN]
        if roots:
            break
        time.sleep(0.2)
    assert [s.name for s in roots] == ["infer a"], f"{name}: no span continues the trace"


def test_every_entry_marks_a_cached_answer(entry: tuple[str, Any]) -> None:
    name, way_in = entry
    row = _row(name, 2)  # (entries that share a server do not share a row)
    first = way_in.infer("a", row, {})
    again = way_in.infer("a", row, {})
    assert first.values == again.values == [2 * v for v in row]
    assert (first.headers.get("x-rtserve-cache"), again.headers.get("x-rtserve-cache")) == (
        "miss",
        "memory",
    )
    assert _timing_names(again.headers["server-timing"]) == ["cache", "total"]


def test_every_entry_refuses_an_unknown_model_with_the_same_error(
    entry: tuple[str, Any],
) -> None:
    name, way_in = entry
    result = way_in.infer("no-such-model", ROW, {"x-request-id": "lost-1"})
    assert result.status == 404
    assert result.error is not None and "no-such-model" in result.error
    _ERRORS[name] = result.error
    assert len(set(_ERRORS.values())) == 1, _ERRORS
    assert result.headers.get("x-request-id") == (None if name == "asgi" else "lost-1")


_ERRORS: dict[str, str] = {}
