"""The application: a call in, a reply out, for every entry, with no socket.

``Application.reply(call, peer)`` routes a call through the one route table
(``api/routes.py``) and returns its reply: whole, streamed, or pending. The HTTP/1.1 server
takes one shortcut on the hot path: inference is answered straight onto its connection
(``infer(call, responder)``: no task, no coroutine; see ``core/dataplane.py``). Every entry
applies the same keys and rate limit (``check_credentials``) before a route runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial

from rtserve.api import checks, routes
from rtserve.api.call import Call, Headers, Reply, Responder
from rtserve.api.context import error_reply, infer_headers, read_headers
from rtserve.api.v2 import infer_target
from rtserve.config import ServerConfig
from rtserve.core.control import ModelControl
from rtserve.core.dataplane import DataPlane
from rtserve.core.model import ModelVersion
from rtserve.errors import InvalidInput, RTServeError, as_error
from rtserve.protocol.http_codec import (
    decode_infer_request,
    encode_infer_response,
    json_header_length,
)
from rtserve.protocol.shared_memory import SharedMemoryRegions
from rtserve.protocol.types import InferRequest, InferResponse, Timings
from rtserve.server.errors import http_error
from rtserve.server.generative import GenerativeRoutes
from rtserve.server.security import Guard

_now = time.perf_counter_ns


class Application:
    def __init__(
        self,
        dataplane: DataPlane,
        max_request_bytes: int,
        control: ModelControl | None = None,
        guard: Guard | None = None,
        max_decompressed_bytes: int = 64 * 1024 * 1024,
        shm: SharedMemoryRegions | None = None,
        control_refusal: RTServeError | None = None,
    ) -> None:
        """``guard``: keys and rate limits (None: open, as by default); ``shm``: the system
        shared memory regions (None: the extension is off); ``control_refusal``: the
        answer to model control when this entry offers none (``control`` None)."""
        self.dataplane = dataplane
        self.max_request_bytes = max_request_bytes
        self.max_decompressed_bytes = max_decompressed_bytes
        self.control = control
        self.control_refusal = control_refusal
        self.guard = guard
        self.shm = shm
        self.generative = GenerativeRoutes(dataplane, guard, self.decompress)
        # Set by a transport that can send pre-encoded answers (HTTP/1.1): encodes an error
        # answer once for the refusals given back to back under overload.
        self.encode_answer: Callable[[int, bytes, Headers], bytes] | None = None
        # The last early refusal and its answer: (refusal, status, body, headers, encoded).
        self._refusal: tuple[RTServeError, int, bytes, Headers, bytes | None] | None = None

    @classmethod
    def for_adapter(
        cls, dataplane: DataPlane, config: ServerConfig, entry: str, front: str, **kw: object
    ) -> Application:
        """The application with the configured keys and rate limit, as ``rtserve serve``
        builds it, for ``entry`` behind ``front``; raises ``ConfigError`` (naming the
        setting) for what ``entry`` cannot honour or an auth file that cannot be read. Call
        before loading models: a bad setting fails fast."""
        checks.refuse_unhonoured(config, entry, front)
        return cls(
            dataplane,
            config.max_request_bytes,
            guard=Guard.from_config(config),
            max_decompressed_bytes=config.max_decompressed_bytes,
            **kw,  # type: ignore[arg-type]
        )

    # ------------------------------------------------------------------ every call
    def check_credentials(self, peer: str, path: str, headers: dict[bytes, bytes]) -> None:
        """The guard's check (keys, rate limit) of a request from ``peer`` (the client's
        address) to ``path`` (canonical), as every entry applies it. An inference refused
        is recorded as every other request is: counted under its model and access-logged."""
        if self.guard is None:
            return
        try:
            self.guard.http(path, headers, peer)
        except RTServeError as exc:
            if path.endswith("/infer"):
                try:
                    name, version = infer_target(path)
                except RTServeError:
                    name = version = ""
                self.dataplane.record_refusal(Timings(received=_now()), exc, name, version)
            raise

    def check_head(
        self, method: bytes, path: str, headers: dict[bytes, bytes], peer: str
    ) -> int | None:
        """Decide from the head what needs no body, before the body is read: the key and
        rate limit, the route, the model (unknown: 404; not ready: 503). Returns the largest
        body the route reads (None: ``max_request_bytes``)."""
        if self.guard is not None:
            self.check_credentials(peer, path, headers)
        if method != b"POST":
            return None
        route = routes.find(method, path)
        return route.head(self, path) if route.head is not None else None

    def resolve_infer(self, path: str) -> None:
        """Refuse an inference to an unknown or unready model from its path."""
        name, version = infer_target(path)
        self.dataplane.resolve(name, version, Timings(received=_now()))

    def reply(self, call: Call, peer: str) -> Reply:
        """The reply to ``call`` from ``peer`` (the client's address): the keys and rate
        limit unless ``call.checked``, then its route's."""
        try:
            if not call.checked:
                self.check_credentials(peer, call.path, call.headers)
            route = routes.find(call.method, call.path)
        except Exception as exc:
            return error_reply(call.path, exc)
        return route.handler(self, call, peer)

    def decompress(self, body: bytes, encoding: bytes) -> bytes:
        return checks.decompress(body, encoding, self.max_decompressed_bytes)

    # ------------------------------------------------------------------ infer (hot path)
    def infer(self, call: Call, out: Responder, body: bytes | None = None) -> None:
        """Hand an inference to the dataplane, which decodes it with ``_decode`` once the
        model is known; its answer is sent on ``out``. ``body``: the already decompressed
        body."""
        timings = Timings(received=call.received_ns)
        sink = partial(self.answer, out)
        try:
            read_headers(timings, call.headers)
            name, version = infer_target(call.path)
        except Exception as exc:
            self.dataplane.refuse(sink, timings, as_error(exc, "inference request"))
            return
        decode = partial(self._decode, out, call, body, name, version)
        out.on_lost = self.dataplane.submit(name, version, timings, decode, sink)

    def _decode(
        self,
        out: Responder,
        call: Call,
        body: bytes | None,
        name: str,
        version: str,
        mv: ModelVersion,
    ) -> InferRequest | None:
        """The V2 request in ``call`` (JSON or binary tensors), within the model's limits;
        None while a compressed body is decompressed on a thread."""
        headers = call.headers
        if body is None:
            body = call.body
            encoding = headers.get(b"content-encoding")
            if encoding is not None and encoding.lower() != b"identity":
                # Decompression (up to max_decompressed_bytes) runs on a thread: a
                # compression bomb must not stall every other client on the loop.
                self._start_decompress(out, call, encoding.lower())
                return None
        return decode_infer_request(
            body,
            json_header_length(headers.get(b"inference-header-content-length")),
            name,
            version,
            mv.decode_limits,
            self.shm,
        )

    def _start_decompress(self, out: Responder, call: Call, encoding: bytes) -> None:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(None, self.decompress, call.body, encoding)
        future.add_done_callback(partial(self._decompressed, out, call))

    def _decompressed(self, out: Responder, call: Call, future: asyncio.Future[bytes]) -> None:
        error = future.exception()
        if error is not None:
            timings = read_headers(Timings(received=call.received_ns), call.headers)
            self.dataplane.refuse(partial(self.answer, out), timings, as_error(error))
            return
        self.infer(call, out, future.result())

    def answer(
        self,
        out: Responder,
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
                out.respond(200, body, infer_headers(timings, json_length))
                return None
            self._respond_error(out, timings, error)
            return error
        assert error is not None
        self._respond_error(out, timings, error)
        return None

    def _respond_error(self, out: Responder, timings: Timings, error: RTServeError) -> None:
        """Send an error. Refusals under overload come by the thousand, and the scheduler
        gives those back to back the same object (never raised: no traceback to hold): its
        answer is encoded once."""
        cached = self._refusal
        if cached is not None and cached[0] is error:
            _, status, body, headers, encoded = cached
        else:
            status, body, headers = http_error(error)
            encode = self.encode_answer
            encoded = encode(status, body, headers) if encode is not None else None
            if error.__traceback__ is None:
                self._refusal = (error, status, body, headers, encoded)
        if not timings.request_id:
            out.respond(status, body, headers, encoded)
        else:
            request_id = timings.request_id.encode("latin-1")
            out.respond(status, body, [*headers, (b"x-request-id", request_id)])
