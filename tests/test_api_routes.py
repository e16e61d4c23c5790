"""The application without sockets: the route table's order, and calls answered by an
``Application`` over a real Engine (a real ONNX model), as any adapter would make them; the
gRPC service's table (``GRPC_ROUTES``), which both gRPC transports dispatch through, and a
call answered through it with no transport."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from rtserve.api import routes, v2
from rtserve.api.application import Application
from rtserve.api.call import CallData, Pending, settle
from rtserve.api.grpc_service import GRPC_ROUTES, SERVICE, GrpcFrontend, bind_routes
from rtserve.config import load_server_config
from rtserve.engine import Engine, SyncEngine
from rtserve.errors import RouteNotFound
from rtserve.protocol import grpc_service_pb2 as pb
from rtserve.protocol.load_request import MAX_LOAD_BODY_BYTES
from rtserve.server import grpc_h2
from rtserve.server.grpc import _generic_handler
from rtserve.server.h2_call import Abort, Call
from tests.models import build_scale


def _kind(route: routes.Route) -> str:
    if route is routes.INFER:
        return "infer"
    if route.handler is v2.model_control:
        return "control"
    return "rest" if route is routes.ROUTES[-1] else "generative"


@pytest.mark.parametrize(
    ("method", "path", "kind"),
    [
        (b"POST", "/v2/models/a/infer", "infer"),
        (b"POST", "/v2/models/a/versions/1/infer", "infer"),
        (b"POST", "/v2/repository/models/a/load", "control"),
        (b"POST", "/v2/repository/models/generate", "control"),
        (b"POST", "/v1/chat/completions", "generative"),
        (b"HEAD", "/v1/models", "generative"),
        (b"POST", "/v1/no-such-route", "generative"),
        (b"GET", "/v2/models/a/generate", "generative"),
        (b"POST", "/v2/models/a/generate_stream", "generative"),
        (b"GET", "/v2/models/a/infer", "rest"),
        (b"GET", "/v2/health/ready", "rest"),
        (b"POST", "/v2/repository/index", "rest"),
    ],
)
def test_a_request_takes_the_first_route_that_matches(method: bytes, path: str, kind: str) -> None:
    assert _kind(routes.find(method, path)) == kind


def test_the_head_check_gives_each_routes_body_limit() -> None:
    load = routes.find(b"POST", "/v2/repository/models/a/load")
    assert load.head is not None and load.head(None, "/v2/repository/models/a/load") == (  # type: ignore[arg-type]
        MAX_LOAD_BODY_BYTES
    )
    other = routes.find(b"POST", "/v2/systemsharedmemory/region/r/register")
    assert other.head is not None
    assert other.head(None, "/v2/systemsharedmemory/region/r/register") == v2.SHM_BODY_BYTES  # type: ignore[arg-type]
    with pytest.raises(RouteNotFound, match="no route for POST /nowhere"):
        other.head(None, "/nowhere")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Application, SyncEngine]]:
    repo = tmp_path_factory.mktemp("api-routes") / "repo"
    build_scale(repo / "a" / "1" / "model.onnx", 3.0)
    (repo / "a" / "config.yaml").write_text("max_batch_size: 4\n")
    config = load_server_config(None, model_repository=repo)
    engine = Engine(config)
    application = Application(engine.dataplane, config.max_request_bytes)
    sync = engine.sync().start()
    try:
        yield application, sync
    finally:
        sync.stop()


def _call(method: bytes, path: str, body: bytes = b"", **headers: str) -> CallData:
    pairs = {k.replace("_", "-").encode(): v.encode() for k, v in headers.items()}
    return CallData(method, path, pairs, body, time.perf_counter_ns(), checked=False)


def test_an_inference_call_is_a_pending_reply_with_the_v2_headers(
    app: tuple[Application, SyncEngine],
) -> None:
    application, engine = app
    body = json.dumps(
        {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    ).encode()
    reply = application.reply(_call(b"POST", "/v2/models/a/infer", body, x_request_id="r-1"), "?")
    assert isinstance(reply, Pending)
    status, out, headers = engine.run(settle(reply))  # type: ignore[misc]
    named = dict(headers)
    assert status == 200 and json.loads(out)["outputs"][0]["data"] == [3, 6, 9, 12]
    assert named[b"content-type"] == b"application/json"
    assert named[b"x-request-id"] == b"r-1"
    assert named[b"server-timing"].startswith(b"queue;dur=")


def test_errors_keep_each_apis_shape_and_the_request_id(
    app: tuple[Application, SyncEngine],
) -> None:
    application, engine = app
    reply = application.reply(
        _call(b"POST", "/v2/models/nope/infer", b"{}", x_request_id="r-2"), "?"
    )
    status, out, headers = engine.run(settle(reply))  # type: ignore[misc]
    assert status == 404 and "nope" in json.loads(out)["error"]
    assert dict(headers)[b"x-request-id"] == b"r-2"
    status, out, _ = application.reply(_call(b"GET", "/v1/nowhere"), "?")  # type: ignore[misc]
    assert status == 404 and json.loads(out)["error"]["type"] == "not_found_error"
    status, out, _ = application.reply(_call(b"GET", "/v2/nowhere"), "?")  # type: ignore[misc]
    assert (status, json.loads(out)) == (404, {"error": "no route for GET /v2/nowhere"})


def test_model_control_without_a_controller_is_refused_as_the_entry_says(
    app: tuple[Application, SyncEngine],
) -> None:
    application, engine = app
    reply = application.reply(_call(b"POST", "/v2/repository/models/a/unload"), "?")
    assert isinstance(reply, Pending) and not reply.abort_on_lost
    status, out, _ = engine.run(settle(reply))  # type: ignore[misc]
    assert status == 400 and "model control is not available" in json.loads(out)["error"]


def _frontend(application: Application) -> GrpcFrontend:
    return GrpcFrontend(application.dataplane, 1 << 20)


def test_every_grpc_method_is_one_route_both_transports_dispatch_through(
    app: tuple[Application, SyncEngine],
) -> None:
    paths = {f"/inference.GRPCInferenceService/{m.name}" for m in SERVICE.methods}
    assert set(GRPC_ROUTES) == paths
    assert [p for p, r in GRPC_ROUTES.items() if r.streaming] == [
        "/inference.GRPCInferenceService/ModelStreamInfer"
    ]
    frontend = _frontend(app[0])
    # Our HTTP/2 transport: the table by :path, each handler bound to the frontend.
    h2 = grpc_h2._methods(frontend)
    assert set(h2) == {p.encode() for p in paths}
    for path, route in GRPC_ROUTES.items():
        method = h2[path.encode()]
        assert method.fn.__func__ is route.handler and method.fn.__self__ is frontend
        assert (method.parse, method.streaming) == (route.parse, route.streaming)
    # grpcio: the same table, by the method path grpcio hands its generic handler.
    generic = _generic_handler(frontend)

    class Details(grpc.HandlerCallDetails):  # type: ignore[misc]
        def __init__(self, method: str) -> None:
            self.method, self.invocation_metadata = method, ()

    for path, route in GRPC_ROUTES.items():
        handler = generic.service(Details(path))
        fn = handler.stream_stream if route.streaming else handler.unary_unary
        assert fn.__func__ is route.handler and fn.__self__ is frontend
    assert generic.service(Details("/inference.GRPCInferenceService/Nope")) is None


def _run_route(
    engine: SyncEngine, frontend: GrpcFrontend, name: str, data: bytes, call: Call
) -> Any:
    """A unary call as a transport makes it: the route's parse, its bound handler with the
    call's context, its serializer (read back for the test)."""
    path = f"/inference.GRPCInferenceService/{name}"
    route, method = GRPC_ROUTES[path], bind_routes(frontend)[path]
    answer = engine.run(method.fn(route.parse(data), call))
    return pb.__dict__[f"{name}Response"].FromString(route.serialize(answer))


def test_a_grpc_call_is_answered_through_the_table_without_a_transport(
    app: tuple[Application, SyncEngine],
) -> None:
    application, engine = app
    frontend = _frontend(application)
    request = pb.ModelInferRequest(model_name="a", id="q")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(np.arange(1, 5, dtype=np.float32).tobytes())
    call = Call([("x-request-id", "g-1")], "ipv4:127.0.0.1:1", None)
    answer = _run_route(engine, frontend, "ModelInfer", request.SerializeToString(), call)
    assert answer.id == "q" and answer.outputs[0].name == "y"
    out = np.frombuffer(answer.raw_output_contents[0], dtype=np.float32)
    assert out.tolist() == [3, 6, 9, 12]
    trailers = dict(call.trailers)
    assert trailers["x-request-id"] == "g-1" and trailers["server-timing"].startswith("queue;")
    ready = _run_route(
        engine, frontend, "ModelReady", pb.ModelReadyRequest(name="a").SerializeToString(), call
    )
    assert ready.ready is True
    # A malformed message and an unknown model: refused by the handler, with their status.
    with pytest.raises(Abort) as malformed:
        _run_route(engine, frontend, "ModelInfer", b"\xff\xff", call)
    assert malformed.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(Abort) as unknown:
        data = pb.ModelMetadataRequest(name="nope").SerializeToString()
        _run_route(engine, frontend, "ModelMetadata", data, call)
    assert unknown.value.code == grpc.StatusCode.NOT_FOUND and "nope" in unknown.value.details
