"""The V2 (Open Inference Protocol) HTTP routes as handlers of the route table: inference
(answered on a responder; see ``Application.infer``), model control, and the rest
(health, metadata, config, statistics, the repository index, shared memory, metrics)."""

from __future__ import annotations

import asyncio
from importlib import resources
from typing import TYPE_CHECKING, Any

import orjson

from rtserve.api.call import Answer, Call, FutureResponder, Pending
from rtserve.api.context import error_reply
from rtserve.core.info import ModelConfigInfo, ModelInfo
from rtserve.errors import InvalidInput, RouteNotFound
from rtserve.protocol.limits import shown
from rtserve.protocol.load_request import body_parameters, config_from_body
from rtserve.protocol.shared_memory import Region, cuda_refusal, disabled
from rtserve.server.errors import JSON_TYPE, http_error
from rtserve.server.stats import statistics_json

if TYPE_CHECKING:
    from rtserve.api.application import Application

# The shared memory extensions' routes: /v2/{kind}/[region/{name}/]{action}.
SHM_KINDS = ("systemsharedmemory", "cudasharedmemory")
_SHM_ACTIONS = {"status": b"GET", "register": b"POST", "unregister": b"POST"}
SHM_BODY_BYTES = 64 * 1024  # a register request's {"key", "offset", "byte_size"}


def infer_target(path: str) -> tuple[str, str]:
    """(model, version) of ``/v2/models/{m}[/versions/{v}]/infer`` (a canonical path)."""
    parts = path.split("/")
    n = len(parts)
    if n == 5 and parts[1] == "v2" and parts[2] == "models":
        return parts[3], ""
    if n == 7 and parts[1] == "v2" and parts[2] == "models" and parts[4] == "versions":
        return parts[3], parts[5]
    raise RouteNotFound(f"no route for POST {path[:200]}")


# ---------------------------------------------------------------------- handlers
def infer(app: Application, call: Call, peer: str) -> Pending:
    """Inference for an entry that awaits its answer (an HTTP/1.1 connection is answered
    directly: ``Application.infer``); cancelling the wait drops the queued request."""

    async def answer() -> Answer:
        out = FutureResponder()
        app.infer(call, out)
        try:
            return await out.future
        except asyncio.CancelledError:
            if out.on_lost is not None:
                out.on_lost()
            raise

    return Pending(answer)


def model_control(app: Application, call: Call, peer: str) -> Pending:
    """``POST /v2/repository/models/{m}/load`` (optional body: ``{"parameters": {"config":
    <mapping or JSON string>}}``, merged over config.yaml; see ``protocol/load_request.py``)
    and ``.../unload``. Not cancelled when the client goes away."""

    async def answer() -> Answer:
        try:
            if app.control is None and app.control_refusal is not None:
                raise app.control_refusal
            parts = call.path.split("/")
            if len(parts) != 6 or parts[5] not in ("load", "unload") or not parts[4]:
                raise RouteNotFound(f"no route for POST {call.path[:200]}")
            if app.control is None:
                raise InvalidInput("model control is not available")
            if parts[5] == "load":
                await app.control.load(parts[4], config_from_body(call.body))
            else:
                _check_unload_body(call.body)
                await app.control.unload(parts[4])
        except Exception as exc:
            return error_reply(call.path, exc)
        return 200, b"", [JSON_TYPE]

    return Pending(answer, abort_on_lost=False)


def _check_unload_body(body: bytes) -> None:
    """An unload request's optional body, ``{"parameters": {"unload_dependents": bool}}``:
    one that says something else is refused before the model is unloaded."""
    params = body_parameters(body, "unload request", '"unload_dependents": ...', null=False)
    dependents = (params or {}).get("unload_dependents", False)
    if not isinstance(dependents, bool):
        raise InvalidInput(
            "unload request parameters.unload_dependents: expected true or false, got "
            f"{shown(repr(dependents))}"
        )


def other(app: Application, call: Call, peer: str) -> Answer:
    """Every other route, answered at once (errors in V2's shape)."""
    try:
        return _route(app, call)
    except Exception as exc:
        return http_error(exc)


def other_head(app: Application, path: str) -> int | None:
    """A POST to another route: shared memory registration has its small body limit; only
    the repository's routes take a POST besides."""
    if path.startswith(("/v2/systemsharedmemory/", "/v2/cudasharedmemory/")):
        return SHM_BODY_BYTES
    if not path.startswith("/v2/repository/"):
        raise RouteNotFound(f"no route for POST {path[:200]}")
    return None


# ---------------------------------------------------------------------- the rest
def _json(status: int, doc: Any) -> Answer:
    return status, orjson.dumps(doc), [JSON_TYPE]


def _route(app: Application, call: Call) -> Answer:
    method = b"GET" if call.method == b"HEAD" else call.method
    path = call.path
    dp = app.dataplane
    parts = [p for p in path.split("/") if p]
    if method == b"GET" and parts == ["metrics"]:
        body, content_type = dp.metrics_exposition()
        return 200, body, [(b"content-type", content_type.encode())]
    if method == b"GET" and parts == ["dashboard"]:  # the live page; it polls /metrics
        page = resources.files("rtserve.observability").joinpath("dashboard.html")
        return 200, page.read_bytes(), [(b"content-type", b"text/html; charset=utf-8")]
    if not parts or parts[0] != "v2":
        raise RouteNotFound(f"no route for {method.decode()} {path[:200]}")
    rest = parts[1:]
    if method == b"GET" and not rest:
        meta = dp.server_metadata()
        doc = {"name": meta.name, "version": meta.version, "extensions": list(meta.extensions)}
        return _json(200, doc)
    if method == b"GET" and rest == ["health", "live"]:
        return _json(200, {"live": True})
    if method == b"GET" and rest == ["health", "ready"]:
        ready = dp.ready()
        return _json(200 if ready else 503, {"ready": ready})
    if method == b"POST" and rest == ["repository", "index"]:
        return _json(200, _index(app, call.body))
    if method == b"GET" and rest == ["models", "stats"]:
        return _json(200, {"model_stats": statistics_json(dp.statistics(None))})
    if rest and rest[0] in SHM_KINDS:
        answer = _shared_memory(app, method, rest, call.body)
        if answer is not None:
            return answer
    if len(rest) >= 2 and rest[0] == "models":
        answer = _model(app, method, rest[1], rest[2:])
        if answer is not None:
            return answer
    raise RouteNotFound(f"no route for {method.decode()} {path[:200]}")


def _model(app: Application, method: bytes, name: str, tail: list[str]) -> Answer | None:
    """``/v2/models/{name}[/versions/{v}]{,/ready,/config,/stats}``."""
    dp = app.dataplane
    version = ""
    if len(tail) >= 2 and tail[0] == "versions":
        version, tail = tail[1], tail[2:]
    if method != b"GET":
        return None
    if not tail:
        return _json(200, metadata_json(dp.model_metadata(name, version)))
    if tail == ["ready"]:
        ready = dp.model_ready(name, version)
        return _json(200 if ready else 503, {"name": name, "ready": ready})
    if tail == ["config"]:
        return _json(200, config_json(dp.model_config(name, version)))
    if tail == ["stats"]:
        return _json(200, {"model_stats": statistics_json(dp.statistics(name, version))})
    return None


def _index(app: Application, body: bytes) -> list[dict[str, Any]]:
    """The repository index; ``{"ready": true}`` lists only the ready versions."""
    ready_only = _ready_only(body) if body.strip() else False
    return [
        {"name": e.name, "version": e.version, "state": e.state, "reason": e.reason}
        for e in app.dataplane.repository_index()
        if not ready_only or e.state == "READY"
    ]


def _ready_only(body: bytes) -> bool:
    """The repository index request's ``{"ready": true}`` (a body of another shape, or a
    ``ready`` that is not a boolean, is refused)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise InvalidInput("repository index body: not valid JSON") from None
    if doc is None:
        return False
    if not isinstance(doc, dict):
        raise InvalidInput(
            'repository index body: expected a JSON object such as {"ready": true}, got '
            f"{shown(repr(doc))}"
        )
    ready = doc.get("ready")
    if ready is not None and not isinstance(ready, bool):
        raise InvalidInput(f"ready: expected true or false, got {shown(repr(ready))}")
    return ready is True


# ---------------------------------------------------------------------- shared memory
def _shared_memory(app: Application, method: bytes, rest: list[str], body: bytes) -> Answer | None:
    """``/v2/{systemsharedmemory,cudasharedmemory}/[region/{name}/]{status,register,
    unregister}`` (None: no such route)."""
    kind, tail = rest[0], rest[1:]
    if len(tail) == 3 and tail[0] == "region":
        name, action = tail[1], tail[2]
    elif len(tail) == 1:
        name, action = "", tail[0]
    else:
        return None
    if _SHM_ACTIONS.get(action) != method or (action == "register" and not name):
        return None
    if kind == "cudasharedmemory":
        return _cuda_shared_memory(action, name)
    shm = app.shm
    if shm is None:
        raise disabled(f"{method.decode()} /v2/{'/'.join(rest)[:200]}")
    if action == "status":
        return _json(200, [_region_json(r) for r in shm.status(name)])
    if action == "register":
        doc = _register_body(body)
        shm.register(name, doc.get("key"), doc.get("offset", 0), doc.get("byte_size"))
    else:
        shm.unregister(name)
    return 200, b"", [JSON_TYPE]


def _cuda_shared_memory(action: str, name: str) -> Answer:
    """CUDA shared memory (``shared_memory.cuda_refusal``): status lists no region."""
    refusal = cuda_refusal(action, name)
    if refusal is not None:
        raise refusal
    return _json(200, []) if action == "status" else (200, b"", [JSON_TYPE])


def _region_json(region: Region) -> dict[str, Any]:
    return {
        "name": region.name,
        "key": region.key,
        "offset": region.offset,
        "byte_size": region.byte_size,
    }


def _register_body(body: bytes) -> dict[str, Any]:
    try:
        doc = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        doc = None
    if type(doc) is not dict:
        raise InvalidInput(
            'register request body: expected a JSON object {"key", "offset", "byte_size"}'
        )
    return doc


# ---------------------------------------------------------------------- documents
def _tensors(tensors: Any) -> list[dict[str, Any]]:
    return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in tensors]


def metadata_json(meta: ModelInfo) -> dict[str, Any]:
    return {
        "name": meta.name,
        "versions": list(meta.versions),
        "platform": meta.platform,
        "inputs": _tensors(meta.inputs),
        "outputs": _tensors(meta.outputs),
    }


def config_json(cfg: ModelConfigInfo) -> dict[str, Any]:
    def tensors(items: Any) -> list[dict[str, Any]]:
        return [{"name": t.name, "data_type": t.data_type, "dims": list(t.dims)} for t in items]

    batching: dict[str, Any] = {
        "preferred_batch_size": list(cfg.preferred_batch_sizes),
        "max_queue_delay_microseconds": cfg.max_queue_delay_us,
    }
    if cfg.priority_levels:
        batching["priority_levels"] = cfg.priority_levels
        batching["default_priority_level"] = cfg.default_priority
    out: dict[str, Any] = {
        "name": cfg.name,
        "platform": cfg.platform,
        "backend": cfg.backend,
        "max_batch_size": cfg.max_batch_size,
        "input": tensors(cfg.inputs),
        "output": tensors(cfg.outputs),
        "dynamic_batching": batching,
        "instance_group": [{"name": cfg.name, "kind": "KIND_CPU", "count": cfg.instance_count}],
    }
    if cfg.parameters:
        out["parameters"] = {k: {"string_value": v} for k, v in cfg.parameters}
    return out
