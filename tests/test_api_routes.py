"""The application without sockets: the route table's order, and calls answered by an
``Application`` over a real Engine (a real ONNX model), as any adapter would make them."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from rtserve.api import routes, v2
from rtserve.api.application import Application
from rtserve.api.call import CallData, Pending, settle
from rtserve.config import load_server_config
from rtserve.engine import Engine, SyncEngine
from rtserve.errors import RouteNotFound
from rtserve.protocol.load_request import MAX_LOAD_BODY_BYTES
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
