"""A lean HTTP/1.1 server: httptools parses, uvloop's transports carry the bytes.

Why not a general ASGI server: on a 2-core machine the HTTP layer is most of a small
model's budget. ASGI costs a task, several message dicts and two socket writes per
request; here a request is parsed in place, handed to a plain callback, and its response
goes out in one write. Keep-alive, pipelining (answers in order), chunked request bodies,
``Expect: 100-continue``, HTTP/1.0 and HEAD are handled. A route may answer with a body
that arrives in pieces (``respond_stream``: server-sent events of generated tokens), sent
with chunked transfer encoding as the transport's buffer drains; if the client goes away,
the body's iterator is closed at once (its generation stops).

The pieces: ``h1_parse`` (the request being parsed, within the client's limits),
``h1_limits`` (the limits and their refusals), ``h1_flow`` (reading and writing paused),
``h1_stream`` (a streamed answer). This module is the connection (transport events,
pipelining, answers, refusals, timeouts) and the server.

A client is bounded by ``HttpLimits``: URL, header count, header and head sizes, body size,
idle / header / body timeouts and a cap on open connections; each refusal names the limit.
What a connection holds is freed by reference counting alone (the server makes cyclic GC
rare): the parser is dropped when the connection closes, buffers when a request ends.
Timeouts are checked by one periodic sweep, never by a timer per request. Reading pauses
while answers pile up (pipelining) or the peer does not read them (write backpressure).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from http import HTTPStatus
from typing import Any

import httptools

from rtserve.errors import InferenceFailed, InvalidInput, Overloaded, RTServeError
from rtserve.server.accept import TlsAcceptor
from rtserve.server.errors import http_error
from rtserve.server.h1_flow import FlowControl
from rtserve.server.h1_limits import HttpLimits, raise_fd_limit
from rtserve.server.h1_parse import BODY, HEAD, IDLE, Request, RequestReader
from rtserve.server.h1_stream import LAST_CHUNK, close_soon, pump

__all__ = [
    "MAX_PIPELINED",
    "Connection",
    "Handler",
    "HeadCheck",
    "HttpLimits",
    "HttpServer",
    "Request",
    "error_answer",
    "raise_fd_limit",
    "response_bytes",
]

log = logging.getLogger(__name__)

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# Parsed requests waiting behind the one being answered before reading pauses.
MAX_PIPELINED = 32
# Reads larger than this are parsed a slice at a time (reading can pause between slices).
_SLICE = 32 * 1024
# Accept-queue length (the kernel caps it at net.core.somaxconn): clients that open a
# connection per request must not be reset while the loop is busy.
_BACKLOG = 65535
# After a refusal the connection reads (and drops) what the client still sends for this
# long, so that the client sees the answer instead of a reset, then closes.
_LINGER_S = 2.0
# Connections over the cap that may linger like that; beyond it they are closed at once.
_REFUSED_LINGERING = 256
_now = time.perf_counter_ns


def error_answer(exc: RTServeError) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    """(status, body, headers) of the transport's own refusals, mapped like every other
    HTTP error (``server.errors.http_error``)."""
    return http_error(exc)


Handler = Callable[["Connection", Request], None]
# Checks a request from its head (method, canonical path, headers), before a large or chunked
# body is read; raises an ``RTServeError`` to refuse it, or returns a lower body limit for it.
HeadCheck = Callable[["Connection", bytes, str, dict[bytes, bytes]], int | None]


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

    __slots__ = (
        "server",
        "limits",
        "transport",
        "reader",
        "flow",
        "current",
        "on_lost",
        "pipeline",
        "closing",
        "last_active",
        "rejected",
        "_held",
        "_feeding",
        "_dispatching",
        "_final",
        "_unparsed",
    )

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.limits = server.limits
        self.transport: asyncio.Transport | None = None
        self.reader = RequestReader(self)
        self.flow = FlowControl()
        self.current: Request | None = None
        # Set by the handler while the current request waits for its answer: called if the
        # connection closes first (the request is dropped from its queue, not computed).
        self.on_lost: Callable[[], object] | None = None
        self.pipeline: deque[Request] = deque()
        self.closing = False
        self.last_active = time.monotonic()
        self.rejected = False  # refused (or the client left): input is dropped from now on
        self._held = False  # parse no more: answers pile up or the peer does not read them
        self._feeding = False  # inside _feed_slices
        self._dispatching = False  # inside the loop that hands requests to the handler
        self._final: bytes | None = None  # a refusal to write once earlier answers are out
        self._unparsed: memoryview | None = None  # the rest of a read, held while paused

    @property
    def read_paused(self) -> bool:
        return self.flow.read_paused

    @property
    def write_paused(self) -> bool:
        return self.flow.write_paused

    # ------------------------------------------------------------------ transport events
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TCPTransport
        self.flow.transport = self.transport
        server = self.server
        if len(server.connections) >= server.max_connections:
            self._refuse_over_cap()
            return
        server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        server = self.server
        server.connections.discard(self)
        if self.current is not None:  # its answer, when ready, goes nowhere
            self.current = None
            server.busy_connections -= 1
            if self.on_lost is not None:
                self.on_lost()
        self.on_lost = None
        self.pipeline.clear()
        self.closing = True
        self.transport = None
        self.flow.transport = None
        self.rejected = True
        # The parser holds the reader's bound methods, the reader this connection: cut both
        # so that the connection (and what it buffered: a partial upload, the last request)
        # is freed by refcount.
        reader = self.reader
        reader.clear()
        del reader.parser
        del reader.conn
        del reader.deliver
        self._final = None
        self._unparsed = None

    def pause_writing(self) -> None:
        self.flow.pause_writing(time.monotonic())
        self._pause_reading()

    def resume_writing(self) -> None:
        self.flow.resume_writing()
        if self.current is None and self.pipeline and not self._dispatching:
            self._run(self.pipeline.popleft())
        self._maybe_resume_reading()

    def eof_received(self) -> bool:
        """The client closed its side: treated as gone, as a reset is. A client that closes
        while waiting has given up (its timeout fired, it exited); what it sent and is still
        queued would be computed for nobody, so the transport closes and ``connection_lost``
        cancels it. (Clients that half-close and read on are rare in HTTP/1.1; most servers
        and proxies treat the end of input the same way.)"""
        self.rejected = True
        return False

    def data_received(self, data: bytes | memoryview) -> None:
        if self.rejected:  # refused: dropped, and the linger is not extended
            return
        if len(data) > _SLICE:
            self._feed_slices(memoryview(data))
            if self._held:  # answers may have drained while it was parsed
                self._maybe_resume_reading()
            return
        self.last_active = self.server.clock
        reader = self.reader
        state = reader.state
        gen = reader.gen
        try:
            reader.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            # No local may hold the callback's exception: its traceback holds this frame.
            self._refuse_raised(exc.__context__)
            return
        except httptools.HttpParserUpgrade:
            # An Upgrade the server ignores (e.g. h2c; WebSocket and CONNECT were refused in
            # on_headers_complete): answered as usual without keep-alive, later input dropped.
            return
        except httptools.HttpParserError as exc:
            self.refuse(InvalidInput(f"malformed HTTP request: {exc}"))
            return
        if state == reader.state != BODY and gen == reader.gen:
            # The whole read continued one unfinished head (or junk between requests): the
            # parser buffers a header that arrives in pieces, so bound what it may gather.
            reader.head_raw += len(data)
            if reader.head_raw > self.limits.max_head_bytes:
                self.refuse(self.limits.head_too_large())

    def _feed_slices(self, view: memoryview) -> None:
        """Parse a large read a slice at a time; once reading pauses (answers pile up), keep
        the rest unparsed until they drain: a read of tiny pipelined requests must not turn
        into thousands of parsed requests at once."""
        self._feeding = True
        try:
            for start in range(0, len(view), _SLICE):
                if self.rejected:
                    return
                if self._held:
                    self._unparsed = view[start:]
                    return
                self.data_received(view[start : start + _SLICE])
        finally:
            self._feeding = False

    # ------------------------------------------------------------------ from the reader
    def received(self, request: Request) -> None:
        """A whole request: answered now, or queued behind the one being answered."""
        if self.current is not None or self._dispatching or self.flow.write_paused:
            self.pipeline.append(request)
            if len(self.pipeline) >= MAX_PIPELINED:
                self._pause_reading()
            return
        self._run(request)

    def continue_(self) -> None:
        """Send the interim answer to ``Expect: 100-continue``; never ahead of the answers
        to earlier requests (the client then sends its body without it)."""
        transport = self.transport
        if transport is not None and self.current is None and not self.pipeline:
            transport.write(_CONTINUE)

    # ------------------------------------------------------------------ answering
    def _run(self, request: Request) -> None:
        """Hand requests to the handler one after another. A loop, not recursion: many
        pipelined requests answered synchronously (e.g. health checks) must not nest."""
        server = self.server
        self._dispatching = True
        try:
            while True:
                self.current = request
                server.busy_connections += 1
                try:
                    server.handler(self, request)
                except Exception as exc:  # a bug must still produce an answer
                    log.error("error answering %r %s", request.method, request.path, exc_info=exc)
                    if self.current is request:
                        self.respond(*error_answer(InferenceFailed("internal error")))
                if (
                    self.current is not None
                    or not self.pipeline
                    or self.flow.write_paused
                    or self.transport is None
                ):
                    return
                request = self.pipeline.popleft()
                if self._held:
                    self._maybe_resume_reading()
        finally:
            self._dispatching = False
            if self.current is None and not self.pipeline and self._final is not None:
                self._write_final()

    def respond(
        self,
        status: int,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        encoded: bytes | None = None,
    ) -> None:
        """Answer the current request; then start the next pipelined one. ``encoded``: the
        same answer already encoded as ``response_bytes`` does for a keep-alive HTTP/1.1
        request (what most requests are), sent as is when this request is one."""
        request = self.current
        if request is None:
            return
        self.current = None
        self.on_lost = None
        server = self.server
        server.busy_connections -= 1
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        keep_alive = request.keep_alive and not server.draining
        if encoded is None or not keep_alive or request.http10 or request.method == b"HEAD":
            if request.method == b"HEAD":
                body = b""
            encoded = response_bytes(status, body, headers, keep_alive, request.http10)
        transport.write(encoded)
        self.last_active = server.clock
        if not keep_alive:
            transport.close()
            return
        if self.pipeline:
            if not self._dispatching and not self.flow.write_paused:
                self._run(self.pipeline.popleft())
        elif self._final is not None:
            if not self._dispatching:
                self._write_final()
        elif server.draining:
            transport.close()
        if self._held:
            self._maybe_resume_reading()

    def respond_stream(
        self, status: int, headers: list[tuple[bytes, bytes]], body: AsyncIterator[bytes]
    ) -> None:
        """Answer the current request with a body that arrives in pieces: each is sent as it
        comes (chunked; without keep-alive, or to HTTP/1.0, delimited by the close), no
        faster than the peer reads. If the client goes away the iterator is closed
        (``aclose``), so whatever produces it stops; later pipelined requests wait."""
        request = self.current
        transport = self.transport
        if request is None or transport is None or transport.is_closing():
            close_soon(body)
            return
        keep_alive = request.keep_alive and not self.server.draining and not request.http10
        head = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b""))]
        head.extend(b"%s: %s\r\n" % (name, value) for name, value in headers)
        head.append(
            b"transfer-encoding: chunked\r\n\r\n" if keep_alive else b"connection: close\r\n\r\n"
        )
        transport.write(b"".join(head))
        self.last_active = self.server.clock
        task = asyncio.get_running_loop().create_task(pump(self, request, body, keep_alive))
        self.on_lost = task.cancel

    def end_stream(self, request: Request, chunked: bool, ok: bool) -> None:
        """A streamed answer's body ended (``ok``: whole; else it is cut short)."""
        transport = self.transport
        if self.current is not request or transport is None:
            return  # the connection was lost
        if ok and chunked and request.method != b"HEAD" and not self.server.draining:
            # The last chunk, sent as a keep-alive answer is: the next pipelined request runs.
            self.respond(200, b"", [], LAST_CHUNK)
            return
        self.current = None
        self.on_lost = None
        self.server.busy_connections -= 1
        if not ok:  # the client must not take a cut body for a whole one
            transport.abort()
            return
        if chunked and request.method != b"HEAD":
            transport.write(LAST_CHUNK)
        transport.close()  # a body delimited by the close, or the server is draining

    # ------------------------------------------------------------------ refusals
    def refuse(self, exc: RTServeError) -> None:
        """Answer a request the parser or a limit refused (after the answers to the requests
        before it), then close the connection. Later input is dropped."""
        self.rejected = True
        self.reader.clear()
        self._unparsed = None
        status, body, headers = error_answer(exc)
        self._final = response_bytes(status, body, headers, False, False)
        if self.current is None and not self.pipeline and not self._dispatching:
            self._write_final()
        else:
            self._pause_reading()

    def _refuse_raised(self, exc: BaseException | None) -> None:
        if isinstance(exc, RTServeError):
            self.refuse(exc)
        else:  # a bug in a callback
            log.error("error parsing an HTTP request", exc_info=exc)
            self.refuse(InferenceFailed("internal error parsing the request"))

    def _write_final(self) -> None:
        final, self._final = self._final, None
        transport = self.transport
        if final is None or transport is None or transport.is_closing():
            return
        transport.write(final)
        self.last_active = time.monotonic()
        self.flow.resume_reading()
        # Half-close and keep reading (dropping it) for a moment: closing with unread input
        # would reset the connection and could destroy the answer before the client reads it.
        if transport.can_write_eof():
            transport.write_eof()
        else:  # TLS cannot half-close
            transport.close()

    def _refuse_over_cap(self) -> None:
        server = self.server
        self.rejected = True
        self.reader.state = IDLE
        exc = Overloaded(
            f"the server is at its limit of {server.max_connections} open HTTP connections "
            "(http_max_connections); retry later"
        )
        status, body, headers = error_answer(exc)
        self._final = response_bytes(status, body, headers, False, False)
        if len(server.connections) < server.max_connections + _REFUSED_LINGERING:
            server.connections.add(self)  # swept away after lingering
            self._write_final()
        else:
            transport = self.transport
            assert transport is not None
            transport.write(self._final)
            transport.close()

    # ------------------------------------------------------------------ flow control
    def _pause_reading(self) -> None:
        """Parse no more (answers pile up, or the peer does not read them) and stop reading."""
        self._held = True
        self.flow.pause_reading()

    def _maybe_resume_reading(self) -> None:
        """Once the answers waiting have drained: parse what was held back, then read again.
        Called by every answer while held, so that no pipelined request is left unread. From
        inside a parse it does nothing: the parse in progress holds the rest and retries."""
        flow = self.flow
        while (
            self._held
            and not self._feeding
            and not flow.write_paused
            and len(self.pipeline) < MAX_PIPELINED // 2
            and self._final is None
            and self.transport is not None
        ):
            self._held = False
            unparsed, self._unparsed = self._unparsed, None
            if unparsed is not None:
                self._feed_slices(unparsed)
        if not self._held and not self._feeding:
            flow.resume_reading()

    # ------------------------------------------------------------------ timeouts
    def expire(self, now: float, now_ns: int, lag: float) -> None:
        """Close the connection if it has been waiting on its client for too long (called by
        the server's periodic sweep; ``last_active`` may lag true time by up to ``lag``)."""
        transport = self.transport
        if transport is None:
            return
        now -= lag
        limits = self.limits
        flow = self.flow
        if flow.write_paused:  # the peer does not read its answers
            if now - flow.write_paused_at > limits.body_timeout_s:
                transport.abort()
            return
        if self.current is not None or self.pipeline:
            return  # being answered: the server's own work, bounded elsewhere
        if self.rejected:
            if now - self.last_active > _LINGER_S:
                transport.abort()
            return
        reader = self.reader
        state = reader.state
        if state == IDLE:
            if now - self.last_active > limits.idle_timeout_s:
                transport.close()
        elif state == HEAD:
            if now_ns - reader.started > limits.header_timeout_s * 1e9:
                if reader.gen == 0:  # nothing was ever sent
                    transport.close()
                else:
                    self.refuse(limits.head_timeout())
        elif now - self.last_active > limits.body_timeout_s:
            self.refuse(limits.body_timeout())

    @property
    def idle(self) -> bool:
        return self.current is None and not self.pipeline

    @property
    def stuck(self) -> bool:
        """Answers wait on a peer that does not read them: no progress is possible."""
        return self.flow.write_paused


class HttpServer:
    def __init__(
        self,
        handler: Handler,
        max_body: int,
        idle_timeout_s: float | None = None,
        limits: HttpLimits | None = None,
        ssl: Any = None,
        head: HeadCheck | None = None,
    ) -> None:
        """``ssl``: an ``ssl.SSLContext`` to serve HTTPS (None: plain HTTP). ``head``: checks
        a request whose body is large or chunked before that body is read; a refusal is
        answered at once and the connection closed, the body never buffered."""
        self.ssl = ssl
        self.handler = handler
        self.head = head
        self.max_body = max_body
        limits = limits or HttpLimits()
        if idle_timeout_s is not None:
            limits = dataclasses.replace(limits, idle_timeout_s=idle_timeout_s)
        self.limits = limits
        self.idle_timeout_s = limits.idle_timeout_s
        self.max_connections = limits.max_connections
        # Coarse time (updated by the sweep) for a connection's last activity: the timeouts
        # need no better, and reading it is cheaper than a clock call per request.
        self.clock = time.monotonic()
        self.connections: set[Connection] = set()
        self.busy_connections = 0  # connections with a request being answered
        self.handshaking: set[TlsAcceptor] = set()  # TLS handshakes in progress
        self.draining = False
        self._server: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int, sock: socket.socket | None = None) -> int:
        """Listen on ``host:port``, or on an already bound socket (shared by worker processes)."""
        soft = raise_fd_limit()
        # Keep a quarter of the descriptors for gRPC, models, files and the refusals.
        room = max(16, soft * 3 // 4 - 64)
        if self.max_connections > room:
            log.warning(
                "http_max_connections %d lowered to %d: the descriptor limit is %d",
                self.max_connections,
                room,
                soft,
            )
            self.max_connections = room
        loop = asyncio.get_running_loop()
        if sock is not None:
            self._server = await loop.create_server(self._accepted, sock=sock, backlog=_BACKLOG)
        else:
            self._server = await loop.create_server(
                self._accepted, host, port, reuse_address=True, backlog=_BACKLOG
            )
        self._sweeper = loop.create_task(self._sweep())
        sock = self._server.sockets[0]
        return int(sock.getsockname()[1])

    def _accepted(self) -> asyncio.Protocol:
        """A new connection's protocol. Plain connections past ``max_connections`` get
        their 503 in ``connection_made``; under TLS the handshakes in progress count too,
        and past the cap a connection is closed before its handshake (``server.accept``)."""
        if self.ssl is None:
            return Connection(self)
        return TlsAcceptor(
            self.ssl, min(10.0, self.limits.header_timeout_s), lambda: Connection(self),
            self.handshaking, self._room,
        )  # fmt: skip

    def _room(self) -> bool:
        return len(self.connections) + len(self.handshaking) < self.max_connections

    @property
    def busy(self) -> bool:
        """Whether an accepted request is still being answered (a peer that does not read
        its answers is not waited for)."""
        return any(not c.idle and not c.stuck for c in self.connections)

    @property
    def idle_connections(self) -> int:
        """Open connections with no request in progress: clients that may send one soon."""
        return len(self.connections) - self.busy_connections

    async def _sweep(self) -> None:
        limits = self.limits
        shortest = min(limits.idle_timeout_s, limits.header_timeout_s, limits.body_timeout_s)
        interval = min(1.0, max(0.05, shortest / 4))
        while True:
            await asyncio.sleep(interval)
            now, now_ns = time.monotonic(), _now()
            self.clock = now
            for conn in list(self.connections):
                try:
                    conn.expire(now, now_ns, interval)
                except Exception as exc:  # one connection must not end every timeout
                    log.error("error expiring an HTTP connection; aborting it", exc_info=exc)
                    if conn.transport is not None:
                        conn.transport.abort()

    def begin_drain(self) -> None:
        """Answer what was accepted; close connections as they fall idle."""
        self.draining = True
        for conn in list(self.connections):
            if conn.transport is None:
                continue
            if conn.stuck:
                conn.transport.abort()
            elif conn.idle:
                conn.transport.close()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            transport = conn.transport
            if transport is None:
                continue
            if transport.get_write_buffer_size() or conn.stuck:
                transport.abort()  # a peer that does not read would hold the close forever
            else:
                transport.close()
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 5.0)
