"""A lean HTTP/1.1 server: httptools parses, uvloop's transports carry the bytes.

Why not a general ASGI server: on a 2-core machine the HTTP layer is most of a small
model's budget. ASGI costs a task, several message dicts and two socket writes per
request; here a request is parsed in place, handed to a plain callback, and its response
goes out in one write. Keep-alive, pipelining (answers in order), chunked request bodies,
``Expect: 100-continue``, a body-size limit, idle timeouts and a graceful close are
handled; anything else malformed is answered with 400 and the connection closed.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from collections.abc import Callable
from http import HTTPStatus

import httptools

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
MAX_PIPELINED = 32
# Accept-queue length (the kernel caps it at net.core.somaxconn): clients that open a
# connection per request must not be reset while the loop is busy.
_BACKLOG = 65535
_now = time.perf_counter_ns


class Request:
    __slots__ = ("method", "path", "query", "headers", "body", "keep_alive", "received_ns")

    def __init__(
        self,
        method: bytes,
        path: str,
        query: str,
        headers: dict[bytes, bytes],
        body: bytes,
        keep_alive: bool,
        received_ns: int,
    ) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.received_ns = received_ns


Handler = Callable[["Connection", Request], None]


def response_bytes(
    status: int, body: bytes, headers: list[tuple[bytes, bytes]], keep_alive: bool, http10: bool
) -> bytes:
    head = [
        b"HTTP/1.1 %d %s\r\ncontent-length: %d\r\n" % (status, _REASONS.get(status, b""), len(body))
    ]
    for name, value in headers:
        head.append(b"%s: %s\r\n" % (name, value))
    if not keep_alive:
        head.append(b"connection: close\r\n")
    elif http10:
        head.append(b"connection: keep-alive\r\n")
    head.append(b"\r\n")
    head.append(body)
    return b"".join(head)


class Connection(asyncio.Protocol):
    """One client connection: parses requests and writes their answers in order."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.current: Request | None = None
        self.pipeline: deque[Request] = deque()
        self.paused = False
        self.closing = False
        self.last_active = time.monotonic()
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._size = 0
        self._started = 0
        self._rejected = False

    # ------------------------------------------------------------------ transport events
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TCPTransport
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        if self.current is not None:  # its answer, when ready, goes nowhere
            self.current = None
            self.server.busy_connections -= 1
        self.pipeline.clear()
        self.closing = True
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.last_active = time.monotonic()
        if self._rejected:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.fail(400, b"protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            self.fail(400, f"malformed HTTP request: {exc}".encode())

    # ------------------------------------------------------------------ parser callbacks
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._body = []
        self._size = 0
        self._started = _now()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        declared = self._headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.server.max_body:
            self.fail(
                413,
                b"request body of %s bytes exceeds the limit of %d bytes"
                % (declared, self.server.max_body),
            )
            return
        if self._headers.get(b"expect", b"").lower() == b"100-continue" and self.transport:
            self.transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self.server.max_body:
            self.fail(413, b"request body exceeds the limit of %d bytes" % self.server.max_body)
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._rejected:
            return
        url = self._url
        path, _, query = url.partition(b"?")
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = Request(
            self.parser.get_method(),
            path.decode("utf-8", "replace"),
            query.decode("latin-1"),
            self._headers,
            body,
            self.parser.should_keep_alive() and not self.server.draining,
            self._started,
        )
        if self.current is not None:
            self.pipeline.append(request)
            if len(self.pipeline) >= MAX_PIPELINED and self.transport and not self.paused:
                self.transport.pause_reading()
                self.paused = True
            return
        self.current = request
        self.server.busy_connections += 1
        self.server.handler(self, request)

    # ------------------------------------------------------------------ answering
    def respond(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        """Answer the current request; then start the next pipelined one."""
        request = self.current
        if request is None:
            return
        self.current = None
        self.server.busy_connections -= 1
        if self.transport is None or self.transport.is_closing():
            return
        keep_alive = request.keep_alive and not self.server.draining
        http10 = self.parser.get_http_version() == "1.0"
        if request.method == b"HEAD":
            body = b""
        self.transport.write(response_bytes(status, body, headers, keep_alive, http10))
        self.last_active = time.monotonic()
        if not keep_alive:
            self.transport.close()
            return
        if self.pipeline:
            nxt = self.pipeline.popleft()
            if self.paused and len(self.pipeline) < MAX_PIPELINED // 2:
                self.transport.resume_reading()
                self.paused = False
            self.current = nxt
            self.server.busy_connections += 1
            self.server.handler(self, nxt)
        elif self.server.draining:
            self.transport.close()

    def fail(self, status: int, message: bytes) -> None:
        """Answer a request the parser or the limits refused, then close the connection."""
        self._rejected = True
        if self.transport is not None and not self.transport.is_closing():
            body = b'{"error":"%s"}' % message.replace(b"\\", b"\\\\").replace(b'"', b'\\"')
            headers = [(b"content-type", b"application/json")]
            self.transport.write(response_bytes(status, body, headers, False, False))
            self.transport.close()

    @property
    def idle(self) -> bool:
        return self.current is None and not self.pipeline


class HttpServer:
    def __init__(self, handler: Handler, max_body: int, idle_timeout_s: float = 75.0) -> None:
        self.handler = handler
        self.max_body = max_body
        self.idle_timeout_s = idle_timeout_s
        self.connections: set[Connection] = set()
        self.busy_connections = 0  # connections with a request being answered
        self.draining = False
        self._server: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int, sock: socket.socket | None = None) -> int:
        """Listen on ``host:port``, or on an already bound socket (shared by worker processes)."""
        loop = asyncio.get_running_loop()
        if sock is not None:
            self._server = await loop.create_server(
                lambda: Connection(self), sock=sock, backlog=_BACKLOG
            )
        else:
            self._server = await loop.create_server(
                lambda: Connection(self), host, port, reuse_address=True, backlog=_BACKLOG
            )
        self._sweeper = loop.create_task(self._sweep_idle())
        sock = self._server.sockets[0]
        return int(sock.getsockname()[1])

    @property
    def busy(self) -> bool:
        return any(not c.idle for c in self.connections)

    @property
    def idle_connections(self) -> int:
        """Open connections with no request in progress: clients that may send one soon."""
        return len(self.connections) - self.busy_connections

    async def _sweep_idle(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            cutoff = time.monotonic() - self.idle_timeout_s
            for conn in list(self.connections):
                if conn.idle and conn.last_active < cutoff and conn.transport is not None:
                    conn.transport.close()

    def begin_drain(self) -> None:
        """Answer what was accepted; close connections as they fall idle."""
        self.draining = True
        for conn in list(self.connections):
            if conn.idle and conn.transport is not None:
                conn.transport.close()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        if self._server is not None:
            await self._server.wait_closed()
