"""The V2 HTTP/REST frontend on the lean HTTP server (``server/http1.py``).

Thin: route, decode into an ``InferRequest``, call the dataplane, encode its answer. The
inference route runs with no task and no coroutine (see ``core/dataplane.py``); other
routes are synchronous. Every error is answered through ``server.errors.http_error``.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from functools import partial
from importlib import resources
from typing import Any

import orjson

from rtserve.core.control import ModelControl
from rtserve.core.dataplane import DataPlane
from rtserve.core.info import ModelConfigInfo, ModelInfo
from rtserve.core.model import ModelVersion
from rtserve.errors import (
    InvalidInput,
    PayloadTooLarge,
    RouteNotFound,
    RTServeError,
    as_error,
)
from rtserve.observability.logs import checked_request_id
from rtserve.observability.metrics import server_timing
from rtserve.protocol.http_codec import (
    decode_infer_request,
    encode_infer_response,
    json_header_length,
)
from rtserve.protocol.load_request import MAX_LOAD_BODY_BYTES, config_from_body
from rtserve.protocol.shared_memory import (
    Region,
    SharedMemoryRegions,
    cuda_refusal,
    disabled,
)
from rtserve.protocol.types import InferRequest, InferResponse, Timings
from rtserve.server.errors import JSON_TYPE, http_error
from rtserve.server.generative import GenerativeRoutes, is_generative_route
from rtserve.server.http1 import Connection, Request, response_bytes
from rtserve.server.openai import error_answer
from rtserve.server.security import Guard
from rtserve.server.stats import statistics_json

Headers = list[tuple[bytes, bytes]]
_OCTET = (b"content-type", b"application/octet-stream")
_now = time.perf_counter_ns
# The shared memory extensions' routes: /v2/{kind}/[region/{name}/]{action}.
_SHM_KINDS = ("systemsharedmemory", "cudasharedmemory")
_SHM_ACTIONS = {"status": b"GET", "register": b"POST", "unregister": b"POST"}
_SHM_BODY_BYTES = 64 * 1024  # a register request's {"key", "offset", "byte_size"}


def _json(status: int, doc: Any) -> tuple[int, bytes, Headers]:
    return status, orjson.dumps(doc), [JSON_TYPE]


def _infer_target(path: str) -> tuple[str, str]:
    """(model, version) of ``/v2/models/{m}[/versions/{v}]/infer`` (a canonical path)."""
    parts = path.split("/")
    n = len(parts)
    if n == 5 and parts[1] == "v2" and parts[2] == "models":
        return parts[3], ""
    if n == 7 and parts[1] == "v2" and parts[2] == "models" and parts[4] == "versions":
        return parts[3], parts[5]
    raise RouteNotFound(f"no route for POST {path[:200]}")


def _peer(conn: Connection) -> str:
    peer = conn.transport.get_extra_info("peername") if conn.transport is not None else None
    return str(peer[0]) if peer else "?"


def _ready_only(body: bytes) -> bool:
    """The repository index request's ``{"ready": true}``."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise InvalidInput("repository index body: not valid JSON") from None
    return isinstance(doc, dict) and doc.get("ready") is True


def _config_override(body: bytes) -> dict[str, Any] | None:
    """The config given in a load request's body, if any (checked: size, fields, bounds)."""
    return config_from_body(body)


def _tensors(tensors: Any) -> list[dict[str, Any]]:
    return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in tensors]


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


def _cuda_shared_memory(action: str, name: str) -> tuple[int, bytes, Headers]:
    """CUDA shared memory (``shared_memory.cuda_refusal``): status lists no region."""
    refusal = cuda_refusal(action, name)
    if refusal is not None:
        raise refusal
    return _json(200, []) if action == "status" else (200, b"", [JSON_TYPE])


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


class HttpFrontend:
    def __init__(
        self,
        dataplane: DataPlane,
        max_request_bytes: int,
        control: ModelControl | None = None,
        guard: Guard | None = None,
        max_decompressed_bytes: int = 64 * 1024 * 1024,
        shm: SharedMemoryRegions | None = None,
    ) -> None:
        """``guard``: authentication and rate limits (None: open, as by default); ``shm``:
        the system shared memory regions (None: the extension is off, as by default)."""
        self.guard = guard
        self.shm = shm
        self.dataplane = dataplane
        self.max_request_bytes = max_request_bytes
        self.max_decompressed_bytes = max_decompressed_bytes
        self.control = control
        self.generative = GenerativeRoutes(dataplane, guard, self._decompress)
        self._tasks: set[asyncio.Task[None]] = set()
        # The last early refusal and its answer: (refusal, status, body, headers, and all of
        # it encoded for a keep-alive HTTP/1.1 request).
        self._refusal: tuple[RTServeError, int, bytes, Headers, bytes] | None = None

    def check_head(
        self, conn: Connection, method: bytes, path: str, headers: dict[bytes, bytes]
    ) -> int | None:
        """Decide from the head what needs no body, before a large or chunked body is read:
        the key and rate limit, the route, the model (unknown: 404; not ready: 503). The
        server answers a refusal at once and closes, so a refused client cannot make it
        buffer an upload."""
        if self.guard is not None:
            self._guarded(conn, path, headers)
        if method != b"POST":
            return None
        if path.endswith("/infer"):
            name, version = _infer_target(path)
            self.dataplane.resolve(name, version, Timings(received=_now()))
            return None
        if path.startswith("/v2/repository/models/"):
            return MAX_LOAD_BODY_BYTES  # a load body has a config file's size limit
        if is_generative_route(path):
            return self.generative.body_limit()  # (from the models' max_model_len)
        if path.startswith(("/v2/systemsharedmemory/", "/v2/cudasharedmemory/")):
            return _SHM_BODY_BYTES
        if not path.startswith("/v2/repository/"):
            raise RouteNotFound(f"no route for POST {path[:200]}")
        return None

    def _guarded(self, conn: Connection, path: str, headers: dict[bytes, bytes]) -> None:
        self.check_credentials(_peer(conn), path, headers)

    def check_credentials(self, peer: str, path: str, headers: dict[bytes, bytes]) -> None:
        """The guard's check (keys, rate limit) of a request from ``peer`` (the client's
        address) to ``path`` (canonical), as every entry applies it: this server, the Lambda
        handler, the Ray deployment. An inference refused (no key, a rate limit) is recorded
        as every other request is: counted under its model and access-logged."""
        if self.guard is None:
            return
        try:
            self.guard.http(path, headers, peer)
        except RTServeError as exc:
            if path.endswith("/infer"):
                try:
                    name, version = _infer_target(path)
                except RTServeError:
                    name = version = ""
                self.dataplane.record_refusal(Timings(received=_now()), exc, name, version)
            raise

    def handle(self, conn: Connection, request: Request) -> None:
        if self.guard is not None and not request.checked:
            try:
                self._guarded(conn, request.path, request.headers)
            except Exception as exc:
                v1 = request.path.startswith("/v1/")  # the OpenAI API's own error shape
                status, body, headers = error_answer(exc) if v1 else http_error(exc)
                conn.respond(status, body, headers)
                return
        if request.method == b"POST" and request.path.endswith("/infer"):
            self._infer(conn, request)
            return
        if is_generative_route(request.path):
            self.generative.handle(conn, request)
            return
        if request.method == b"POST" and request.path.startswith("/v2/repository/models/"):
            task = asyncio.get_running_loop().create_task(self._model_control(conn, request))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        try:
            status, body, headers = self._route(request)
        except Exception as exc:
            status, body, headers = http_error(exc)
        conn.respond(status, body, headers)

    # ------------------------------------------------------------------ infer (hot path)
    def _infer(self, conn: Connection, raw: Request, body: bytes | None = None) -> None:
        """Read the route and the request's headers, then hand it to the dataplane, which
        decodes it with ``_decode`` once the model is known. ``body``: the already
        decompressed body."""
        timings = Timings(received=raw.received_ns)
        headers = raw.headers
        sink = partial(self.answer, conn)
        try:
            request_id = headers.get(b"x-request-id")
            if request_id is not None:
                timings.request_id = checked_request_id(request_id.decode("latin-1"))
            traceparent = headers.get(b"traceparent")
            if traceparent is not None:
                timings.traceparent = traceparent[:128].decode("latin-1")
            name, version = _infer_target(raw.path)
        except Exception as exc:
            self.dataplane.refuse(sink, timings, as_error(exc, "inference request"))
            return
        decode = partial(self._decode, conn, raw, body, name, version)
        conn.on_lost = self.dataplane.submit(name, version, timings, decode, sink)

    def _decode(
        self,
        conn: Connection,
        raw: Request,
        body: bytes | None,
        name: str,
        version: str,
        mv: ModelVersion,
    ) -> InferRequest | None:
        """The V2 request in ``raw`` (JSON or binary tensors), within the model's limits;
        None while a compressed body is decompressed on a thread."""
        headers = raw.headers
        if body is None:
            body = raw.body
            encoding = headers.get(b"content-encoding")
            if encoding is not None and encoding.lower() != b"identity":
                # Decompression (up to max_decompressed_bytes) runs on a thread: a
                # compression bomb must not stall every other client on the loop.
                self._start_decompress(conn, raw, encoding.lower())
                return None
        return decode_infer_request(
            body,
            json_header_length(headers.get(b"inference-header-content-length")),
            name,
            version,
            mv.decode_limits,
            self.shm,
        )

    def _start_decompress(self, conn: Connection, raw: Request, encoding: bytes) -> None:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(None, self._decompress, raw.body, encoding)
        future.add_done_callback(partial(self._decompressed, conn, raw))

    def _decompressed(self, conn: Connection, raw: Request, future: asyncio.Future[bytes]) -> None:
        error = future.exception()
        if error is not None:
            timings = Timings(received=raw.received_ns)
            self.dataplane.refuse(partial(self.answer, conn), timings, as_error(error))
            return
        self._infer(conn, raw, future.result())

    def answer(
        self,
        conn: Connection,
        request: InferRequest,
        mv: ModelVersion | None,
        response: InferResponse | None,
        error: RTServeError | None,
        final: bool = True,
    ) -> RTServeError | None:
        """The request's sink: encode and send its answer (V2 inference answers once, final);
        returns the error met encoding a response (the dataplane then records the request
        as failed)."""
        timings = request.timings
        if response is not None:
            try:
                in_shm = None
                if self.shm is not None and request.outputs:
                    in_shm = self.shm.write_outputs(request.outputs, response.outputs)
                body, json_length = encode_infer_response(response, request, in_shm)
            except (TypeError, ValueError) as exc:
                error = InvalidInput(f"could not encode the response: {exc}")
            except RTServeError as exc:
                error = exc
            else:
                timing = (b"server-timing", server_timing(timings, _now()).encode())
                if json_length is None:
                    headers = [JSON_TYPE, timing]
                else:
                    headers = [
                        _OCTET,
                        (b"inference-header-content-length", b"%d" % json_length),
                        timing,
                    ]
                if timings.cache:
                    headers.append((b"x-rtserve-cache", timings.cache.encode()))
                if timings.request_id:
                    headers.append((b"x-request-id", timings.request_id.encode("latin-1")))
                conn.respond(200, body, headers)
                return None
            self._respond_error(conn, timings, error)
            return error
        assert error is not None
        self._respond_error(conn, timings, error)
        return None

    def _respond_error(self, conn: Connection, timings: Timings, error: RTServeError) -> None:
        """Send an error. Refusals under overload come by the thousand, and the scheduler
        gives those back to back the same object (never raised: no traceback to hold): its
        answer is encoded once."""
        cached = self._refusal
        if cached is not None and cached[0] is error:
            _, status, body, headers, encoded = cached
        else:
            status, body, headers = http_error(error)
            encoded = response_bytes(status, body, headers, True, False)
            if error.__traceback__ is None:
                self._refusal = (error, status, body, headers, encoded)
        if not timings.request_id:
            conn.respond(status, body, headers, encoded)
        else:
            request_id = timings.request_id.encode("latin-1")
            conn.respond(status, body, [*headers, (b"x-request-id", request_id)])

    def _decompress(self, body: bytes, encoding: bytes) -> bytes:
        if encoding not in (b"gzip", b"deflate"):
            raise InvalidInput(
                f"Content-Encoding: {encoding[:40].decode(errors='replace')!r} is not supported "
                "(expected gzip, deflate or identity)"
            )
        d = zlib.decompressobj(31 if encoding == b"gzip" else 15)
        limit = self.max_decompressed_bytes
        try:
            out = d.decompress(body, limit + 1)
        except zlib.error as exc:
            raise InvalidInput(
                f"Content-Encoding {encoding.decode()}: corrupt body: {exc}"
            ) from None
        if len(out) > limit or d.unconsumed_tail:
            raise PayloadTooLarge(
                f"decompressed body exceeds the limit of {limit} bytes (max_decompressed_bytes)"
            )
        return out

    # ------------------------------------------------------------------ model control
    async def _model_control(self, conn: Connection, request: Request) -> None:
        """``POST /v2/repository/models/{m}/load`` (optional body: ``{"parameters":
        {"config": <mapping or JSON string>}}``, merged over config.yaml; see
        ``protocol/load_request.py``) and ``.../unload``."""
        try:
            parts = request.path.split("/")
            if len(parts) != 6 or parts[5] not in ("load", "unload") or not parts[4]:
                raise RouteNotFound(f"no route for POST {request.path[:200]}")
            if self.control is None:
                raise InvalidInput("model control is not available")
            name, action = parts[4], parts[5]
            if action == "load":
                await self.control.load(name, _config_override(request.body))
            else:
                await self.control.unload(name)
            status, body, headers = 200, b"", [JSON_TYPE]
        except Exception as exc:
            status, body, headers = http_error(exc)
        conn.respond(status, body, headers)

    # ------------------------------------------------------------------ shared memory
    def _shared_memory(
        self, method: bytes, rest: list[str], body: bytes
    ) -> tuple[int, bytes, Headers] | None:
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
        shm = self.shm
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

    # ------------------------------------------------------------------ other routes
    def _route(self, request: Request) -> tuple[int, bytes, Headers]:
        method = request.method
        if method == b"HEAD":
            method = b"GET"
        path = request.path
        dp = self.dataplane
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
            return _json(
                200,
                {"name": meta.name, "version": meta.version, "extensions": list(meta.extensions)},
            )
        if method == b"GET" and rest == ["health", "live"]:
            return _json(200, {"live": True})
        if method == b"GET" and rest == ["health", "ready"]:
            ready = dp.ready()
            return _json(200 if ready else 503, {"ready": ready})
        if method == b"POST" and rest == ["repository", "index"]:
            ready_only = b'"ready"' in request.body and _ready_only(request.body)
            return _json(
                200,
                [
                    {"name": e.name, "version": e.version, "state": e.state, "reason": e.reason}
                    for e in dp.repository_index()
                    if not ready_only or e.state == "READY"
                ],
            )
        if method == b"GET" and rest == ["models", "stats"]:
            return _json(200, {"model_stats": statistics_json(dp.statistics(None))})
        if rest and rest[0] in _SHM_KINDS:
            answer = self._shared_memory(method, rest, request.body)
            if answer is not None:
                return answer
        if len(rest) >= 2 and rest[0] == "models":
            name = rest[1]
            tail = rest[2:]
            version = ""
            if len(tail) >= 2 and tail[0] == "versions":
                version, tail = tail[1], tail[2:]
            if method == b"GET" and not tail:
                return _json(200, metadata_json(dp.model_metadata(name, version)))
            if method == b"GET" and tail == ["ready"]:
                ready = dp.model_ready(name, version)
                return _json(200 if ready else 503, {"name": name, "ready": ready})
            if method == b"GET" and tail == ["config"]:
                return _json(200, config_json(dp.model_config(name, version)))
            if method == b"GET" and tail == ["stats"]:
                return _json(200, {"model_stats": statistics_json(dp.statistics(name, version))})
        raise RouteNotFound(f"no route for {method.decode()} {path[:200]}")
