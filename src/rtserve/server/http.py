"""The V2 HTTP/REST frontend on the lean HTTP server (``server/httpserver.py``).

Inference without a cache runs with no task and no coroutine: the request is decoded,
checked and queued synchronously, and the batch future's callback encodes and writes the
answer. The cache path and nothing else runs as a task. Other routes are synchronous.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from functools import partial
from typing import Any
from urllib.parse import unquote

import numpy as np
import orjson

from rtserve.core.dataplane import Checked, DataPlane, outcome_of
from rtserve.errors import (
    InferenceFailed,
    InvalidInput,
    Overloaded,
    PayloadTooLarge,
    RTServeError,
)
from rtserve.observability.metrics import Metrics, server_timing
from rtserve.protocol.http_codec import decode_infer_request, encode_infer_response
from rtserve.protocol.types import InferRequest, InferResponse, Timings
from rtserve.repository import ModelVersion
from rtserve.server.httpserver import Connection, Request

Headers = list[tuple[bytes, bytes]]
_JSON = (b"content-type", b"application/json")
_OCTET = (b"content-type", b"application/octet-stream")
_now = time.perf_counter_ns
log = logging.getLogger(__name__)


class _NotFound(RTServeError):
    http_status = 404


def _json(status: int, doc: Any) -> tuple[int, bytes, Headers]:
    return status, orjson.dumps(doc), [_JSON]


def _error(exc: RTServeError) -> tuple[int, bytes, Headers]:
    status, body, headers = _json(exc.http_status, {"error": exc.message})
    if isinstance(exc, Overloaded):
        headers.append((b"retry-after", str(max(1, round(exc.retry_after_s))).encode()))
    return status, body, headers


def _int_header(value: bytes, name: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise InvalidInput(f"{name}: expected an integer, got {value!r}") from None


def _infer_target(path: str) -> tuple[str, str]:
    """(model, version) of ``/v2/models/{m}[/versions/{v}]/infer``."""
    if "%" in path:
        path = unquote(path)
    parts = path.split("/")
    n = len(parts)
    if n == 5 and parts[1] == "v2" and parts[2] == "models":
        return parts[3], ""
    if n == 7 and parts[1] == "v2" and parts[2] == "models" and parts[4] == "versions":
        return parts[3], parts[5]
    raise _NotFound(f"no route for POST {path}")


class HttpFrontend:
    def __init__(self, dataplane: DataPlane, metrics: Metrics, max_request_bytes: int) -> None:
        self.dataplane = dataplane
        self.metrics = metrics
        self.max_request_bytes = max_request_bytes
        self._tasks: set[asyncio.Task[None]] = set()

    def handle(self, conn: Connection, request: Request) -> None:
        if request.method == b"POST" and request.path.endswith("/infer"):
            self._infer(conn, request)
            return
        try:
            status, body, headers = self._route(request)
        except RTServeError as exc:
            status, body, headers = _error(exc)
        except Exception as exc:  # a bug must still produce an answer
            log.exception("error answering %s %s", request.method, request.path)
            status, body, headers = _error(InferenceFailed(f"internal error: {exc}"))
        conn.respond(status, body, headers)

    # ------------------------------------------------------------------ infer (hot path)
    def _infer(self, conn: Connection, raw: Request) -> None:
        timings = Timings(received=raw.received_ns)
        mv: ModelVersion | None = None
        try:
            name, version = _infer_target(raw.path)
            mv = self.dataplane.resolve_name(name, version, timings)
            headers = raw.headers
            body = raw.body
            encoding = headers.get(b"content-encoding")
            if encoding is not None and encoding.lower() != b"identity":
                body = self._decompress(body, encoding.lower())
            header_length = headers.get(b"inference-header-content-length")
            request = decode_infer_request(
                body,
                None
                if header_length is None
                else _int_header(header_length, "Inference-Header-Content-Length"),
                name,
                version,
            )
            request.timings = timings
            checked = self.dataplane.check(request, mv)
            if mv.cache is not None:
                hit, key = self.dataplane.cached(request, mv)
                if hit is not None:
                    self._send(conn, request, mv, hit)
                    return
                if key is not None:
                    task = asyncio.get_running_loop().create_task(
                        self._infer_cached(conn, request, mv, checked, key)
                    )
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                    return
            future = self.dataplane.enqueue(request, mv, checked)
            wanted = checked.wanted
        except RTServeError as exc:
            self._fail(conn, exc, mv, timings)
            return
        except Exception as exc:  # a bug must still produce an answer
            log.exception("error handling an inference request")
            self._fail(conn, InferenceFailed(f"internal error: {exc}"), mv, timings)
            return
        future.add_done_callback(partial(self._complete, conn, request, mv, wanted))

    def _complete(
        self,
        conn: Connection,
        request: InferRequest,
        mv: ModelVersion,
        wanted: list[str],
        future: asyncio.Future[dict[str, np.ndarray]],
    ) -> None:
        try:
            results = future.result()
            response = self.dataplane.response(request, mv, results, wanted)
        except Exception as exc:
            self._fail_any(conn, exc, mv, request)
            return
        self._send(conn, request, mv, response)

    async def _infer_cached(
        self,
        conn: Connection,
        request: InferRequest,
        mv: ModelVersion,
        checked: Checked,
        key: bytes,
    ) -> None:
        try:
            response = await self.dataplane.fill(request, mv, checked, key)
        except Exception as exc:
            self._fail_any(conn, exc, mv, request)
            return
        self._send(conn, request, mv, response)

    def _fail_any(
        self, conn: Connection, exc: Exception, mv: ModelVersion, request: InferRequest
    ) -> None:
        """Answer a failed request; a bug (not an RTServeError) must still get an answer."""
        if not isinstance(exc, RTServeError):
            log.error("error answering an inference request", exc_info=exc)
            exc = InferenceFailed(f"internal error: {exc}")
        self._fail(conn, exc, mv, request.timings)

    def _send(
        self, conn: Connection, request: InferRequest, mv: ModelVersion, response: InferResponse
    ) -> None:
        timings = request.timings
        try:
            body, json_length = encode_infer_response(response, request)
        except (TypeError, ValueError) as exc:
            self._fail(conn, InvalidInput(f"could not encode the response: {exc}"), mv, timings)
            return
        end = _now()
        if json_length is None:
            headers = [_JSON, (b"server-timing", server_timing(timings, end).encode())]
        else:
            headers = [
                _OCTET,
                (b"inference-header-content-length", b"%d" % json_length),
                (b"server-timing", server_timing(timings, end).encode()),
            ]
        if timings.cache:
            headers.append((b"x-rtserve-cache", timings.cache.encode()))
        conn.respond(200, body, headers)
        rows = request.inputs[0].shape[0] if mv.config.max_batch_size and request.inputs else 1
        mv.metrics.observe_success(timings, rows, end)

    def _fail(
        self, conn: Connection, exc: RTServeError, mv: ModelVersion | None, timings: Timings
    ) -> None:
        status, body, headers = _error(exc)
        conn.respond(status, body, headers)
        if mv is not None:
            mv.metrics.observe_failure(outcome_of(exc), timings, _now())
        else:
            self.metrics.unrouted.labels(outcome_of(exc)).inc()

    def _decompress(self, body: bytes, encoding: bytes) -> bytes:
        if encoding not in (b"gzip", b"deflate"):
            raise InvalidInput(
                f"Content-Encoding: {encoding.decode(errors='replace')!r} is not supported "
                "(expected gzip, deflate or identity)"
            )
        d = zlib.decompressobj(31 if encoding == b"gzip" else 15)
        try:
            out = d.decompress(body, self.max_request_bytes + 1)
        except zlib.error as exc:
            raise InvalidInput(
                f"Content-Encoding {encoding.decode()}: corrupt body: {exc}"
            ) from None
        if len(out) > self.max_request_bytes or d.unconsumed_tail:
            raise PayloadTooLarge(
                f"decompressed body exceeds the limit of {self.max_request_bytes} bytes"
            )
        return out

    # ------------------------------------------------------------------ other routes
    def _route(self, request: Request) -> tuple[int, bytes, Headers]:
        method = request.method
        if method == b"HEAD":
            method = b"GET"
        path = unquote(request.path)
        dp = self.dataplane
        parts = [p for p in path.split("/") if p]
        if method == b"GET" and parts == ["metrics"]:
            body, content_type = self.metrics.exposition()
            return 200, body, [(b"content-type", content_type.encode())]
        if not parts or parts[0] != "v2":
            raise _NotFound(f"no route for {method.decode()} {path}")
        rest = parts[1:]
        if method == b"GET" and not rest:
            return _json(200, dp.server_metadata())
        if method == b"GET" and rest == ["health", "live"]:
            return _json(200, {"live": True})
        if method == b"GET" and rest == ["health", "ready"]:
            ready = dp.ready()
            return _json(200 if ready else 503, {"ready": ready})
        if method == b"POST" and rest == ["repository", "index"]:
            return _json(200, dp.repository_index())
        if method == b"GET" and rest == ["models", "stats"]:
            return _json(200, {"model_stats": self._stats(None, "")})
        if len(rest) >= 2 and rest[0] == "models":
            name = rest[1]
            tail = rest[2:]
            version = ""
            if len(tail) >= 2 and tail[0] == "versions":
                version, tail = tail[1], tail[2:]
            if method == b"GET" and not tail:
                return _json(200, dp.model_metadata(name, version))
            if method == b"GET" and tail == ["ready"]:
                ready = dp.model_ready(name, version)
                return _json(200 if ready else 503, {"name": name, "ready": ready})
            if method == b"GET" and tail == ["config"]:
                return _json(200, dp.model_config(name, version))
            if method == b"GET" and tail == ["stats"]:
                return _json(200, {"model_stats": self._stats(name, version)})
        raise _NotFound(f"no route for {method.decode()} {path}")

    def _stats(self, name: str | None, version: str) -> list[dict[str, Any]]:
        from rtserve.server.stats import model_statistics

        return model_statistics(self.dataplane, name, version)
