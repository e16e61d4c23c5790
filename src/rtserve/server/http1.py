"""A lean HTTP/1.1 server: httptools parses, uvloop's transports carry the bytes.

Why not a general ASGI server: on a 2-core machine the HTTP layer is most of a small
model's budget. ASGI costs a task, several message dicts and two socket writes per
request; here a request is parsed in place, handed to a plain callback, and its response
goes out in one write. Keep-alive, pipelining (answers in order), chunked request bodies,
``Expect: 100-continue``, HTTP/1.0 and HEAD are handled. A route may answer with a body
that arrives in pieces (``respond_stream``: server-sent events of generated tokens), sent
with chunked transfer encoding as the transport's buffer drains; if the client goes away,
the body's iterator is closed at once (its generation stops).

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
import resource
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import httptools

from rtserve.errors import (
    ConfigError,
    HeaderTooLarge,
    InferenceFailed,
    InvalidInput,
    NotSupported,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    RTServeError,
    UriTooLong,
)
from rtserve.server.accept import TlsAcceptor
from rtserve.server.errors import http_error
from rtserve.server.paths import canonical_path

log = logging.getLogger(__name__)

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_LAST_CHUNK = b"0\r\n\r\n"  # ends a chunked body
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
# Bodies up to this size are read before their request is checked (reading them costs less
# than a refusal that closes the connection); larger or chunked ones are checked at the head.
_READ_FIRST = 64 * 1024
# What a chunk of a chunked body costs beyond its payload (a parser callback, a copy), charged
# against the body limit: 2-byte chunks cannot make the server parse 32 million of them.
_CHUNK_COST = 64
# Credential headers: one of each per request (a second is refused, never one of them read).
_CREDENTIAL_HEADERS = (b"authorization", b"x-api-key")
_now = time.perf_counter_ns

# Where a connection's parser is: between requests, inside a request's head, in its body.
_IDLE, _HEAD, _BODY = 0, 1, 2


@dataclass(frozen=True)
class HttpLimits:
    """What one client may send; each limit is named (by its config field) in its refusal."""

    max_url_bytes: int = 8 * 1024  # the request target (414)
    max_headers: int = 100  # header lines per request (431)
    max_header_bytes: int = 16 * 1024  # one header, name + value (431)
    max_head_bytes: int = 64 * 1024  # request line + all headers (431)
    idle_timeout_s: float = 75.0  # keep-alive with no request in progress: closed
    header_timeout_s: float = 20.0  # from a request's first byte to the end of its head (408)
    body_timeout_s: float = 30.0  # silence while a body arrives, or while answers wait (408)
    max_connections: int = 10_000  # open HTTP connections; more are refused with 503

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigError(f"http_{name}: expected a number > 0, got {value!r}")

    @classmethod
    def from_config(cls, config: Any) -> HttpLimits:
        """The limits from a ``ServerConfig`` (its ``http_*`` fields; defaults where absent)."""
        kwargs = {}
        for name in cls.__dataclass_fields__:
            value = getattr(config, f"http_{name}", None)
            if value is not None:
                kwargs[name] = value
        return cls(**kwargs)


def error_answer(exc: RTServeError) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    """(status, body, headers) of the transport's own refusals, mapped like every other
    HTTP error (``server.errors.http_error``)."""
    return http_error(exc)


def raise_fd_limit() -> int:
    """Raise the soft descriptor limit to the hard one; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # pragma: no cover - a restricted sandbox
            log.warning("could not raise the descriptor limit from %d to %d: %s", soft, hard, exc)
    return soft


class Request:
    __slots__ = (
        "method",
        "path",
        "query",
        "headers",
        "body",
        "keep_alive",
        "received_ns",
        "http10",
        "checked",
    )

    def __init__(
        self,
        method: bytes,
        path: str,
        query: str,
        headers: dict[bytes, bytes],
        body: bytes,
        keep_alive: bool,
        received_ns: int,
        http10: bool = False,
        checked: bool = False,
    ) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.received_ns = received_ns
        self.http10 = http10
        self.checked = checked  # passed the server's head check before its body was read


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
        "parser",
        "current",
        "on_lost",
        "pipeline",
        "closing",
        "last_active",
        "state",
        "read_paused",
        "write_paused",
        "_held",
        "_feeding",
        "_write_paused_at",
        "_dispatching",
        "_rejected",
        "_final",
        "_unparsed",
        "_gen",
        "_url",
        "_url_size",
        "_path",
        "_query",
        "_headers",
        "_header_count",
        "_head_size",
        "_head_raw",
        "_body",
        "_size",
        "_started",
        "_checked",
        "_limit",
        "_chunk_cost",
        "_drained",
    )

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.limits = server.limits
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.current: Request | None = None
        # Set by the handler while the current request waits for its answer: called if the
        # connection closes first (the request is dropped from its queue, not computed).
        self.on_lost: Callable[[], object] | None = None
        self.pipeline: deque[Request] = deque()
        self.closing = False
        self.last_active = time.monotonic()
        # A new connection is waiting for its first head: the header timeout applies.
        self.state = _HEAD
        self.read_paused = False  # the transport's reads, paused by us
        self._held = False  # parse no more: answers pile up or the peer does not read them
        self._feeding = False  # inside _feed_slices
        self.write_paused = False  # by the transport: its buffer is above the high-water mark
        self._write_paused_at = 0.0
        self._dispatching = False  # inside the loop that hands requests to the handler
        self._rejected = False  # refused: input is dropped from now on
        self._final: bytes | None = None  # a refusal to write once earlier answers are out
        self._unparsed: memoryview | None = None  # the rest of a read, held while paused
        self._gen = 0  # requests begun on this connection
        self._url: list[bytes] = []
        self._url_size = 0
        self._path = "/"  # the current request's canonical path (server/paths.py)
        self._query = ""
        self._headers: dict[bytes, bytes] = {}
        self._header_count = 0
        self._head_size = 0  # URL + headers, counted exactly as the parser reports them
        self._head_raw = 0  # bytes of reads that fell wholly inside the current head
        # The body so far: the first piece as received (most bodies come in one), then a
        # bytearray that later pieces are appended to in place.
        self._body: bytes | bytearray = b""
        self._size = 0
        self._started = _now()
        self._checked = False
        self._limit = self.server.max_body  # this request's body limit (a route may lower it)
        self._chunk_cost = 0
        self._drained: asyncio.Future[None] | None = None  # a stream waits for the peer to read

    # ------------------------------------------------------------------ transport events
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TCPTransport
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
        self._rejected = True
        # The parser holds this connection's bound methods: drop it so that the connection
        # (and what it buffered: a partial upload, the last request) is freed by refcount.
        del self.parser
        self._url = []
        self._headers = {}
        self._body = b""
        self._final = None
        self._unparsed = None

    def pause_writing(self) -> None:
        self.write_paused = True
        self._write_paused_at = time.monotonic()
        self._pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        drained = self._drained
        if drained is not None:
            self._drained = None
            if not drained.done():
                drained.set_result(None)
        if self.current is None and self.pipeline and not self._dispatching:
            self._run(self.pipeline.popleft())
        self._maybe_resume_reading()

    def eof_received(self) -> bool:
        """The client closed its side: treated as gone, as a reset is. A client that closes
        while waiting has given up (its timeout fired, it exited); what it sent and is still
        queued would be computed for nobody, so the transport closes and ``connection_lost``
        cancels it. (Clients that half-close and read on are rare in HTTP/1.1; most servers
        and proxies treat the end of input the same way.)"""
        self._rejected = True
        return False

    def data_received(self, data: bytes | memoryview) -> None:
        if self._rejected:  # refused: dropped, and the linger is not extended
            return
        if len(data) > _SLICE:
            self._feed_slices(memoryview(data))
            if self._held:  # answers may have drained while it was parsed
                self._maybe_resume_reading()
            return
        self.last_active = self.server.clock
        state = self.state
        gen = self._gen
        try:
            self.parser.feed_data(data)
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
        if state == self.state != _BODY and gen == self._gen:
            # The whole read continued one unfinished head (or junk between requests): the
            # parser buffers a header that arrives in pieces, so bound what it may gather.
            self._head_raw += len(data)
            if self._head_raw > self.limits.max_head_bytes:
                self.refuse(self._head_too_large())

    def _feed_slices(self, view: memoryview) -> None:
        """Parse a large read a slice at a time; once reading pauses (answers pile up), keep
        the rest unparsed until they drain: a read of tiny pipelined requests must not turn
        into thousands of parsed requests at once."""
        self._feeding = True
        try:
            for start in range(0, len(view), _SLICE):
                if self._rejected:
                    return
                if self._held:
                    self._unparsed = view[start:]
                    return
                self.data_received(view[start : start + _SLICE])
        finally:
            self._feeding = False

    # ------------------------------------------------------------------ parser callbacks
    def on_message_begin(self) -> None:
        self.state = _HEAD
        self._gen += 1
        self._url_size = 0
        self._header_count = 0
        self._head_size = 0
        self._head_raw = 0
        self._size = 0
        self._started = _now()
        self._checked = False
        self._limit = self.server.max_body  # this request's body limit (a route may lower it)
        self._chunk_cost = 0

    def on_url(self, url: bytes) -> None:
        self._url.append(url)
        self._url_size += len(url)
        if self._url_size > self.limits.max_url_bytes:
            raise UriTooLong(
                f"the request URL exceeds the limit of {self.limits.max_url_bytes} bytes "
                "(http_max_url_bytes)"
            )

    def on_header(self, name: bytes, value: bytes) -> None:
        limits = self.limits
        size = len(name) + len(value)
        self._header_count += 1
        self._head_size += size + 4
        if (
            size > limits.max_header_bytes
            or self._header_count > limits.max_headers
            or self._head_size > limits.max_head_bytes
        ):
            raise self._header_error(name, size)
        key = name.lower()
        if key in _CREDENTIAL_HEADERS and key in self._headers:
            # Two keys: a proxy, a log and the guard could each read a different one.
            raise InvalidInput(f"{key.decode()}: expected one such header, got several")
        self._headers[key] = value

    def on_headers_complete(self) -> None:
        self.state = _BODY
        parts = self._url
        url = parts[0] if len(parts) == 1 else b"".join(parts)
        self._url = []
        parser = self.parser
        if parser.get_method() == b"CONNECT":  # its target is host:port, not a path
            raise NotSupported("CONNECT is not supported: this is not a proxy")
        path, _, query = url.partition(b"?")
        self._query = query.decode("latin-1")
        self._path = canonical_path(path)
        if parser.should_upgrade():
            protocol = self._headers.get(b"upgrade", b"").decode("latin-1")
            if "websocket" in protocol.lower():
                raise NotSupported(
                    f"Upgrade to {protocol!r} is not supported (plain requests only)"
                )
            self._rejected = True  # another protocol (e.g. h2c): answered as usual, then closed
        headers = self._headers
        server = self.server
        declared = headers.get(b"content-length")
        length = int(declared) if declared is not None and declared.isdigit() else 0
        if length > server.max_body:
            raise PayloadTooLarge(
                f"request body of {length} bytes exceeds the limit of "
                f"{server.max_body} bytes (max_request_bytes)"
            )
        chunked = b"transfer-encoding" in headers
        if chunked:
            self._chunk_cost = _CHUNK_COST
        if server.head is not None and (length > _READ_FIRST or chunked):
            limit = server.head(self, parser.get_method(), self._path, headers)
            self._checked = True
            if limit is not None and limit < self._limit:
                self._limit = limit
                if length > limit:
                    raise PayloadTooLarge(
                        f"request body of {length} bytes exceeds the limit of {limit} bytes "
                        f"for {self._path[:100]}"
                    )
        if (
            headers.get(b"expect", b"").lower() == b"100-continue"
            and self.transport is not None
            and self.current is None  # an interim answer must not overtake earlier answers
            and not self.pipeline
        ):
            self.transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        """Gather the body. A piece is appended to one buffer, so that a body of many tiny
        chunks costs its size, not an object per chunk."""
        self._size += len(body) + self._chunk_cost
        if self._size > self._limit:
            raise self._body_too_large()
        held = self._body
        if isinstance(held, bytearray):
            held += body
        elif held:
            self._body = bytearray(held) + body
        else:
            self._body = body

    def _body_too_large(self) -> PayloadTooLarge:
        limit = self._limit
        name = "max_request_bytes" if limit == self.server.max_body else self._path[:100]
        extra = f"; each chunk counts {_CHUNK_COST} bytes more" if self._chunk_cost else ""
        return PayloadTooLarge(f"request body exceeds the limit of {limit} bytes ({name}{extra})")

    def on_message_complete(self) -> None:
        self.state = _IDLE
        parser = self.parser
        body = self._body
        if isinstance(body, bytearray):
            body = bytes(body)
        # The request owns these now; the connection keeps no reference to them.
        headers = self._headers
        self._headers = {}
        self._body = b""
        keep_alive = parser.should_keep_alive() and not self.server.draining and not self._rejected
        request = Request(
            parser.get_method(),
            self._path,
            self._query,
            headers,
            body,
            keep_alive,
            self._started,
            # Only an HTTP/1.0 client that asked for keep-alive is told it got it.
            keep_alive and b"connection" in headers and parser.get_http_version() == "1.0",
            self._checked,
        )
        if self.current is not None or self._dispatching or self.write_paused:
            self.pipeline.append(request)
            if len(self.pipeline) >= MAX_PIPELINED:
                self._pause_reading()
            return
        self._run(request)

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
                    or self.write_paused
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
        self.server.busy_connections -= 1
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        keep_alive = request.keep_alive and not self.server.draining
        if encoded is None or not keep_alive or request.http10 or request.method == b"HEAD":
            if request.method == b"HEAD":
                body = b""
            encoded = response_bytes(status, body, headers, keep_alive, request.http10)
        transport.write(encoded)
        self.last_active = self.server.clock
        if not keep_alive:
            transport.close()
            return
        if self.pipeline:
            if not self._dispatching and not self.write_paused:
                self._run(self.pipeline.popleft())
        elif self._final is not None:
            if not self._dispatching:
                self._write_final()
        elif self.server.draining:
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
        loop = asyncio.get_running_loop()
        if request is None or transport is None or transport.is_closing():
            closing = loop.create_task(_close_quietly(body))
            _CLOSING.add(closing)
            closing.add_done_callback(_CLOSING.discard)
            return
        keep_alive = request.keep_alive and not self.server.draining and not request.http10
        head = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b""))]
        head.extend(b"%s: %s\r\n" % (name, value) for name, value in headers)
        head.append(
            b"transfer-encoding: chunked\r\n\r\n" if keep_alive else b"connection: close\r\n\r\n"
        )
        transport.write(b"".join(head))
        self.last_active = self.server.clock
        task = loop.create_task(self._pump(request, body, keep_alive))
        self.on_lost = task.cancel

    async def _pump(self, request: Request, body: AsyncIterator[bytes], chunked: bool) -> None:
        """Send ``body``'s pieces while the connection lives (cancelled when it is lost)."""
        ok = False
        try:
            if request.method != b"HEAD":
                async for piece in body:
                    transport = self.transport
                    if transport is None or transport.is_closing():
                        return
                    if piece:
                        transport.write(b"%x\r\n%b\r\n" % (len(piece), piece) if chunked else piece)
                        self.last_active = self.server.clock
                    if self.write_paused:
                        self._drained = asyncio.get_running_loop().create_future()
                        await self._drained
            ok = True
        except Exception as exc:  # the body failed after its head went out: cut it short
            log.error("error streaming %r %s", request.method, request.path, exc_info=exc)
        finally:
            await _close_quietly(body)
        self._end_stream(request, chunked, ok)

    def _end_stream(self, request: Request, chunked: bool, ok: bool) -> None:
        transport = self.transport
        if self.current is not request or transport is None:
            return  # the connection was lost
        if ok and chunked and request.method != b"HEAD" and not self.server.draining:
            # The last chunk, sent as a keep-alive answer is: the next pipelined request runs.
            self.respond(200, b"", [], _LAST_CHUNK)
            return
        self.current = None
        self.on_lost = None
        self.server.busy_connections -= 1
        if not ok:  # the client must not take a cut body for a whole one
            transport.abort()
            return
        if chunked and request.method != b"HEAD":
            transport.write(_LAST_CHUNK)
        transport.close()  # a body delimited by the close, or the server is draining

    def refuse(self, exc: RTServeError) -> None:
        """Answer a request the parser or a limit refused (after the answers to the requests
        before it), then close the connection. Later input is dropped."""
        self._rejected = True
        self.state = _IDLE
        self._unparsed = None
        self._url = []
        self._headers = {}
        self._body = b""
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
        if self.read_paused:
            transport.resume_reading()
            self.read_paused = False
        # Half-close and keep reading (dropping it) for a moment: closing with unread input
        # would reset the connection and could destroy the answer before the client reads it.
        if transport.can_write_eof():
            transport.write_eof()
        else:  # TLS cannot half-close
            transport.close()

    def _refuse_over_cap(self) -> None:
        server = self.server
        self._rejected = True
        self.state = _IDLE
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

    def _pause_reading(self) -> None:
        """Parse no more (answers pile up, or the peer does not read them) and stop reading."""
        self._held = True
        if not self.read_paused and self.transport is not None:
            self.transport.pause_reading()
            self.read_paused = True

    def _maybe_resume_reading(self) -> None:
        """Once the answers waiting have drained: parse what was held back, then read again.
        Called by every answer while held, so that no pipelined request is left unread. From
        inside a parse it does nothing: the parse in progress holds the rest and retries."""
        while (
            self._held
            and not self._feeding
            and not self.write_paused
            and len(self.pipeline) < MAX_PIPELINED // 2
            and self._final is None
            and self.transport is not None
        ):
            self._held = False
            unparsed, self._unparsed = self._unparsed, None
            if unparsed is not None:
                self._feed_slices(unparsed)
        transport = self.transport
        if self.read_paused and not self._held and not self._feeding and transport is not None:
            transport.resume_reading()
            self.read_paused = False

    def _header_error(self, name: bytes, size: int) -> HeaderTooLarge:
        limits = self.limits
        if size > limits.max_header_bytes:
            shown = name[:64].decode("latin-1")
            return HeaderTooLarge(
                f"header {shown!r} of {size} bytes exceeds the limit of "
                f"{limits.max_header_bytes} bytes per header (http_max_header_bytes)"
            )
        if self._header_count > limits.max_headers:
            return HeaderTooLarge(
                f"more than {limits.max_headers} request headers (http_max_headers)"
            )
        return self._head_too_large()

    def _head_too_large(self) -> HeaderTooLarge:
        return HeaderTooLarge(
            f"the request headers exceed the limit of {self.limits.max_head_bytes} bytes "
            "in all (http_max_head_bytes)"
        )

    # ------------------------------------------------------------------ timeouts
    def expire(self, now: float, now_ns: int, lag: float) -> None:
        """Close the connection if it has been waiting on its client for too long (called by
        the server's periodic sweep; ``last_active`` may lag true time by up to ``lag``)."""
        transport = self.transport
        if transport is None:
            return
        now -= lag
        limits = self.limits
        if self.write_paused:  # the peer does not read its answers
            if now - self._write_paused_at > limits.body_timeout_s:
                transport.abort()
            return
        if self.current is not None or self.pipeline:
            return  # being answered: the server's own work, bounded elsewhere
        if self._rejected:
            if now - self.last_active > _LINGER_S:
                transport.abort()
            return
        state = self.state
        if state == _IDLE:
            if now - self.last_active > limits.idle_timeout_s:
                transport.close()
        elif state == _HEAD:
            if now_ns - self._started > limits.header_timeout_s * 1e9:
                if self._gen == 0:  # nothing was ever sent
                    transport.close()
                else:
                    self.refuse(
                        RequestTimeout(
                            f"the request head did not arrive within {limits.header_timeout_s:g} s"
                            " (http_header_timeout_s)"
                        )
                    )
        elif now - self.last_active > limits.body_timeout_s:
            self.refuse(
                RequestTimeout(
                    f"no part of the request body arrived for {limits.body_timeout_s:g} s "
                    "(http_body_timeout_s)"
                )
            )

    @property
    def idle(self) -> bool:
        return self.current is None and not self.pipeline

    @property
    def stuck(self) -> bool:
        """Answers wait on a peer that does not read them: no progress is possible."""
        return self.write_paused


_CLOSING: set[asyncio.Task[None]] = set()  # bodies being closed, held until they are


async def _close_quietly(body: AsyncIterator[bytes]) -> None:
    """Close a streamed body's iterator (an async generator's ``aclose``); a failure while
    it cleans up is logged, never raised into the transport."""
    aclose = getattr(body, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception as exc:
        log.error("error closing a streamed body", exc_info=exc)


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
