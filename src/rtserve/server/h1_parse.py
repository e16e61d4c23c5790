"""One HTTP/1.1 connection's requests as httptools parses them, with the client's limits.

``RequestReader`` is the parser's callback object: it holds the state of the request being
parsed (URL, headers, body so far, its limits), checks each limit as the bytes arrive, and
hands every complete ``Request`` to its connection (``received``). One reader serves every
request of a connection, reset at each request's first byte: a request costs one
``Request`` object, nothing more.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import httptools

from rtserve.errors import InvalidInput, NotSupported
from rtserve.server.h1_limits import CHUNK_COST, body_too_large, declared_too_large
from rtserve.server.paths import canonical_path

if TYPE_CHECKING:
    from rtserve.server.http1 import Connection

# Where a connection's parser is: between requests, inside a request's head, in its body.
IDLE, HEAD, BODY = 0, 1, 2
# Bodies up to this size are read before their request is checked (reading them costs less
# than a refusal that closes the connection); larger or chunked ones are checked at the head.
READ_FIRST = 64 * 1024
# Credential headers: one of each per request (a second is refused, never one of them read).
_CREDENTIAL_HEADERS = (b"authorization", b"x-api-key")
_now = time.perf_counter_ns


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


class RequestReader:
    """The request being parsed on one connection (httptools' callbacks), within limits."""

    __slots__ = (
        "conn",
        "deliver",
        "parser",
        "limits",
        "max_body",
        "state",
        "gen",
        "head_raw",
        "_url",
        "_url_size",
        "_path",
        "_query",
        "_headers",
        "_header_count",
        "_head_size",
        "_body",
        "_size",
        "started",
        "_checked",
        "_limit",
        "_chunk_cost",
    )

    def __init__(self, conn: Connection) -> None:
        server = conn.server
        self.conn = conn
        self.deliver = conn.received  # where each complete request goes
        self.parser = httptools.HttpRequestParser(self)
        self.limits = server.limits
        self.max_body = server.max_body
        # A new connection is waiting for its first head: the header timeout applies.
        self.state = HEAD
        self.gen = 0  # requests begun on this connection
        self.head_raw = 0  # bytes of reads that fell wholly inside the current head
        self._url: list[bytes] = []
        self._url_size = 0
        self._path = "/"  # the current request's canonical path (server/paths.py)
        self._query = ""
        self._headers: dict[bytes, bytes] = {}
        self._header_count = 0
        self._head_size = 0  # URL + headers, counted exactly as the parser reports them
        # The body so far: the first piece as received (most bodies come in one), then a
        # bytearray that later pieces are appended to in place.
        self._body: bytes | bytearray = b""
        self._size = 0
        self.started = _now()
        self._checked = False
        self._limit = self.max_body  # this request's body limit (a route may lower it)
        self._chunk_cost = 0

    def clear(self) -> None:
        """Drop what the request being parsed holds (it was refused, or the client left)."""
        self.state = IDLE
        self._url = []
        self._headers = {}
        self._body = b""

    # ------------------------------------------------------------------ parser callbacks
    def on_message_begin(self) -> None:
        self.state = HEAD
        self.gen += 1
        self._url_size = 0
        self._header_count = 0
        self._head_size = 0
        self.head_raw = 0
        self._size = 0
        self.started = _now()
        self._checked = False
        self._limit = self.max_body
        self._chunk_cost = 0

    def on_url(self, url: bytes) -> None:
        self._url.append(url)
        self._url_size += len(url)
        if self._url_size > self.limits.max_url_bytes:
            raise self.limits.url_too_long()

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
            raise limits.header_error(name, size, self._header_count)
        key = name.lower()
        if key in _CREDENTIAL_HEADERS and key in self._headers:
            # Two keys: a proxy, a log and the guard could each read a different one.
            raise InvalidInput(f"{key.decode()}: expected one such header, got several")
        self._headers[key] = value

    def on_headers_complete(self) -> None:
        self.state = BODY
        parts = self._url
        url = parts[0] if len(parts) == 1 else b"".join(parts)
        self._url = []
        parser = self.parser
        if parser.get_method() == b"CONNECT":  # its target is host:port, not a path
            raise NotSupported("CONNECT is not supported: this is not a proxy")
        path, _, query = url.partition(b"?")
        self._query = query.decode("latin-1")
        self._path = canonical_path(path)
        headers = self._headers
        if parser.should_upgrade():
            protocol = headers.get(b"upgrade", b"").decode("latin-1")
            if "websocket" in protocol.lower():
                raise NotSupported(
                    f"Upgrade to {protocol!r} is not supported (plain requests only)"
                )
            self.conn.rejected = True  # another protocol (e.g. h2c): answered, then closed
        declared = headers.get(b"content-length")
        length = int(declared) if declared is not None and declared.isdigit() else 0
        if length > self.max_body:
            raise declared_too_large(length, self.max_body)
        chunked = b"transfer-encoding" in headers
        if chunked:
            self._chunk_cost = CHUNK_COST
        if length > READ_FIRST or chunked:
            self._check_head(length)
        if headers.get(b"expect", b"").lower() == b"100-continue":
            self.conn.continue_()

    def _check_head(self, length: int) -> None:
        """The server's check of a large or chunked request from its head (it may refuse
        it, or lower its body limit), before the body is read."""
        conn = self.conn
        check = conn.server.head
        if check is None:
            return
        limit = check(conn, self.parser.get_method(), self._path, self._headers)
        self._checked = True
        if limit is not None and limit < self._limit:
            self._limit = limit
            if length > limit:
                raise declared_too_large(length, limit, self._path[:100])

    def on_body(self, body: bytes) -> None:
        """Gather the body. A piece is appended to one buffer, so that a body of many tiny
        chunks costs its size, not an object per chunk."""
        self._size += len(body) + self._chunk_cost
        if self._size > self._limit:
            limit = self._limit
            name = "max_request_bytes" if limit == self.max_body else self._path[:100]
            raise body_too_large(limit, name, bool(self._chunk_cost))
        held = self._body
        if isinstance(held, bytearray):
            held += body
        elif held:
            self._body = bytearray(held) + body
        else:
            self._body = body

    def on_message_complete(self) -> None:
        self.state = IDLE
        parser = self.parser
        body = self._body
        if isinstance(body, bytearray):
            body = bytes(body)
        # The request owns these now; the reader keeps no reference to them.
        headers = self._headers
        self._headers = {}
        self._body = b""
        conn = self.conn
        keep_alive = parser.should_keep_alive() and not conn.server.draining and not conn.rejected
        self.deliver(
            Request(
                parser.get_method(),
                self._path,
                self._query,
                headers,
                body,
                keep_alive,
                self.started,
                # Only an HTTP/1.0 client that asked for keep-alive is told it got it.
                keep_alive and b"connection" in headers and parser.get_http_version() == "1.0",
                self._checked,
            )
        )
