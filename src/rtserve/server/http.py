"""The V2 HTTP/REST frontend: a plain ASGI app served by uvicorn (uvloop + httptools).

The infer route is dispatched straight from the path (no router, no middleware); the other
routes are cheap and rare. Every response is one ``http.response.start`` and one body.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from rtserve.core.dataplane import DataPlane, outcome_of
from rtserve.errors import InvalidInput, Overloaded, PayloadTooLarge, RTServeError
from rtserve.observability.metrics import Metrics, server_timing
from rtserve.protocol.http_codec import decode_infer_request, encode_infer_response
from rtserve.protocol.types import InferRequest, Timings

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_JSON = (b"content-type", b"application/json")
_OCTET = (b"content-type", b"application/octet-stream")
_now = time.perf_counter_ns


def _json_response(status: int, doc: Any) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    return status, orjson.dumps(doc), [_JSON]


def _error(exc: RTServeError) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    status, body, headers = _json_response(exc.http_status, {"error": exc.message})
    if isinstance(exc, Overloaded):
        headers.append((b"retry-after", str(max(1, round(exc.retry_after_s))).encode()))
    return status, body, headers


class HttpFrontend:
    def __init__(self, dataplane: DataPlane, metrics: Metrics, max_request_bytes: int) -> None:
        self.dataplane = dataplane
        self.metrics = metrics
        self.max_request_bytes = max_request_bytes
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                await self._lifespan(receive, send)
            return
        path: str = scope["path"]
        if scope["method"] == "POST" and path.endswith("/infer"):
            await self._infer(scope, receive, send, path)
            return
        try:
            status, body, headers = await self._route(scope, receive, path)
        except RTServeError as exc:
            status, body, headers = _error(exc)
        await _send(send, status, body, headers)

    @staticmethod
    async def _lifespan(receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ------------------------------------------------------------------ infer (hot path)
    async def _infer(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        timings = Timings(received=_now())
        self.in_flight += 1
        mm = None
        try:
            parts = path.split("/")
            # /v2/models/{m}/infer or /v2/models/{m}/versions/{v}/infer
            n = len(parts)
            if n == 5 and parts[1] == "v2" and parts[2] == "models":
                name, version = parts[3], ""
            elif n == 7 and parts[1] == "v2" and parts[2] == "models" and parts[4] == "versions":
                name, version = parts[3], parts[5]
            else:
                raise _NotFound(f"no route for POST {path}")
            header_length = None
            encoding = b""
            declared = -1
            for key, value in scope["headers"]:
                if key == b"inference-header-content-length":
                    header_length = _int_header(value, "Inference-Header-Content-Length")
                elif key == b"content-length":
                    declared = _int_header(value, "Content-Length")
                elif key == b"content-encoding":
                    encoding = value.lower()
            body = await self._read_body(receive, declared)
            if encoding and encoding != b"identity":
                body = self._decompress(body, encoding)
            probe = InferRequest(name, version, [], timings=timings)
            mv = self.dataplane.resolve(probe)
            mm = mv.metrics
            request = decode_infer_request(body, header_length, name, version)
            request.timings = timings
            response = await self.dataplane.infer(request, mv)
            out, json_length = encode_infer_response(response, request)
            headers = [_OCTET if json_length is not None else _JSON]
            if json_length is not None:
                headers.append((b"inference-header-content-length", str(json_length).encode()))
            end = _now()
            headers.append((b"server-timing", server_timing(timings, end).encode()))
            if timings.cache:
                headers.append((b"x-rtserve-cache", timings.cache.encode()))
            await _send(send, 200, out, headers)
            mm.observe_success(timings, _rows(request) if mv.config.max_batch_size else 1, end)
        except RTServeError as exc:
            status, body, headers = _error(exc)
            await _send(send, status, body, headers)
            if mm is not None:
                mm.observe_failure(outcome_of(exc), timings, _now())
            else:
                self.metrics.unrouted.labels(outcome_of(exc)).inc()
        finally:
            self.in_flight -= 1

    async def _read_body(self, receive: Receive, declared: int) -> bytes:
        limit = self.max_request_bytes
        if declared > limit:
            raise PayloadTooLarge(
                f"request body of {declared} bytes exceeds the limit of {limit} bytes"
            )
        message = await receive()
        body: bytes = message.get("body", b"")
        if not message.get("more_body", False):
            return body
        chunks = [body]
        size = len(body)
        while message.get("more_body", False):
            message = await receive()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def _decompress(self, body: bytes, encoding: bytes) -> bytes:
        if encoding not in (b"gzip", b"deflate"):
            raise InvalidInput(
                f"Content-Encoding: {encoding.decode(errors='replace')!r} is not supported "
                "(expected gzip, deflate or identity)"
            )
        wbits = 31 if encoding == b"gzip" else 15
        d = zlib.decompressobj(wbits)
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
    async def _route(
        self, scope: Scope, receive: Receive, path: str
    ) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        method = scope["method"]
        dp = self.dataplane
        parts = [p for p in path.split("/") if p]
        if method == "GET" and parts == ["metrics"]:
            body, content_type = self.metrics.exposition()
            return 200, body, [(b"content-type", content_type.encode())]
        if not parts or parts[0] != "v2":
            raise _NotFound(f"no route for {method} {path}")
        rest = parts[1:]
        if method == "GET" and not rest:
            return _json_response(200, dp.server_metadata())
        if method == "GET" and rest == ["health", "live"]:
            return _json_response(200, {"live": True})
        if method == "GET" and rest == ["health", "ready"]:
            ready = dp.ready()
            return _json_response(200 if ready else 503, {"ready": ready})
        if method == "POST" and rest in (["repository", "index"], ["repository", "index", ""]):
            return _json_response(200, dp.repository_index())
        if method == "GET" and rest == ["models", "stats"]:
            return _json_response(200, {"model_stats": self._stats(None, "")})
        if len(rest) >= 2 and rest[0] == "models":
            name = rest[1]
            tail = rest[2:]
            version = ""
            if len(tail) >= 2 and tail[0] == "versions":
                version, tail = tail[1], tail[2:]
            if method == "GET" and not tail:
                return _json_response(200, dp.model_metadata(name, version))
            if method == "GET" and tail == ["ready"]:
                ready = dp.model_ready(name, version)
                return _json_response(200 if ready else 503, {"name": name, "ready": ready})
            if method == "GET" and tail == ["config"]:
                return _json_response(200, dp.model_config(name, version))
            if method == "GET" and tail == ["stats"]:
                return _json_response(200, {"model_stats": self._stats(name, version)})
        raise _NotFound(f"no route for {method} {path}")

    def _stats(self, name: str | None, version: str) -> list[dict[str, Any]]:
        from rtserve.server.stats import model_statistics

        return model_statistics(self.dataplane, name, version)


class _NotFound(RTServeError):
    http_status = 404


def _rows(request: InferRequest) -> int:
    shape = request.inputs[0].shape if request.inputs else ()
    return shape[0] if shape else 1


def _int_header(value: bytes, name: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise InvalidInput(f"{name}: expected an integer, got {value!r}") from None


async def _send(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
