"""The V2 gRPC service on rtserve's own HTTP/2 framing, over the event loop's transport.

grpcio's server spends about 150 µs of its one core per call in its own machinery (a
completion-queue hop per call step); this transport serves the same ``GrpcFrontend``
handlers with a few Python frames per call (docs/deploy.md has the figures). HPACK decoding
comes from the ``hpack`` library; frames, flow control and gRPC's length-prefixed messages
are here. Answers are encoded without HPACK's dynamic table (literals, never indexed), so
they need no encoder state and the constant header block is built once.

Bounds (a client is hostile), each decided before its cost is paid: a call is authenticated
from its headers, before its message is read or inflated; streams per connection
(``MAX_STREAMS``), calls in progress (``MAX_CALLS``, ``MAX_CALLS_PER_ADDRESS``), header
blocks (``MAX_HEADER_BYTES``), messages (``max_message_bytes``, checked from the 5-byte
prefix before the body is buffered); requests received and not yet taken by a handler, per
connection and per server (``CONN_BUFFER``, ``SERVER_BUFFER``: past them a partial message
gets no more window); a request that makes no progress for ``REQUEST_STALL_S`` is ended;
frames that make no progress (pings, priorities, settings, window updates that unblock
nothing, empty data, resets) spend a per-connection budget (``CALM_BURST``, ``CALM_RATE``)
that calls and answers refill, and past it the connection gets GOAWAY ``ENHANCE_YOUR_CALM``.
Answers waiting for window are woken in proportion to what can be sent. Idle connections
and ones that never finish the preface are closed.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import resource
import ssl
import struct
import time
import zlib
from collections import deque
from collections.abc import Callable
from contextlib import aclosing
from typing import Any, NoReturn
from urllib.parse import quote

import grpc
from hpack import Decoder, HPACKError
from hpack.hpack import encode_integer

from rtserve.errors import RTServeError
from rtserve.server.accept import TlsAcceptor
from rtserve.server.errors import grpc_error, grpc_trailers
from rtserve.server.grpc import SERVICE, GrpcFrontend, Method, check_call_headers, service_methods

log = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE = range(9)
CONTINUATION = 9
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0, 1, 2, 3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 5, 6, 7, 8, 9
ENHANCE_YOUR_CALM = 11

MAX_STREAMS = 1024  # concurrent streams per connection (SETTINGS_MAX_CONCURRENT_STREAMS)
MAX_CALLS = 10_000  # calls in progress in this process; more are RESOURCE_EXHAUSTED
MAX_CONNECTIONS = 10_000  # open connections (at most an eighth of the descriptor limit)
MAX_CALLS_PER_ADDRESS = MAX_CALLS // 4  # calls in progress from one client address
MAX_RESETS = 10_000  # streams reset per SWEEP_S (by the client or for its errors), then GOAWAY
# What one stream may send ahead of its handler: INITIAL_WINDOW (SETTINGS), and STREAM_WINDOW
# for the connection's one partial message let through (``Connection.leader``).
INITIAL_WINDOW = 64 << 10
STREAM_WINDOW = 1 << 20
CONN_WINDOW = 16 << 20  # granted once a call on the connection passed authentication
# Requests received and not yet taken by a handler (partial and whole messages): past
# CONN_BUFFER on a connection only its leader is given more window (the others wait their
# turn); past SERVER_BUFFER (at least twice the message limit) for all connections, none is.
CONN_BUFFER = 4 << 20


def _env_bytes(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit():
        raise RTServeError(
            f"{name} must be a number of bytes (a non-negative integer), got {value!r}"
        )
    return int(value)


SERVER_BUFFER = _env_bytes("RTSERVE_H2_SERVER_BUFFER", 256 << 20)  # (the variable: tests, tuning)
REQUEST_STALL_S = 5.0  # a request (headers, or a partial message) without progress is ended
WINDOW_STALL_S = 30.0  # the same while it has no window to send in (the budgets hold it)
# Frames without progress (PING, PRIORITY, SETTINGS, WINDOW_UPDATE, RST_STREAM, GOAWAY,
# CONTINUATION, empty or tiny DATA, refused calls) spend a connection's budget: CALM_BURST at
# once, CALM_RATE more per second; each accepted call earns CALL_CREDIT, each answer frame one.
# A call reset before its answer (by the client, or for its errors) gives its credit back.
CALM_BURST = 1000
CALM_RATE = 100.0
CALL_CREDIT = 4
MIN_SEND = 512  # an answer waits for this much window, unless the window holds all of it
TINY_DATA = 64  # a DATA frame this small that completes no message is no progress
MAX_HEADER_BYTES = 16 << 10  # one header block, and the decoded header list
MAX_FRAME = 16384  # the largest frame we accept (the protocol's default)
MAX_OUT_PENDING = 1 << 20  # answer bytes a stream handler may queue before it waits
IDLE_S = 300.0
PREFACE_S = 10.0
SWEEP_S = 5.0
TICK_S = 1.0  # how often stalled requests are looked for

_FRAME = struct.Struct(">BHBBL")
_U32 = struct.Struct(">L")
_GRPC_PREFIX = struct.Struct(">BL")
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_NOT_METADATA = frozenset(
    {b"te", b"content-type", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding"}
)
# Request messages may be compressed (answers never are, as gRPC allows): zlib wbits.
_ENCODINGS = {b"identity": 0, b"gzip": 16 + zlib.MAX_WBITS, b"deflate": zlib.MAX_WBITS}
_ACCEPTED = b"identity,deflate,gzip"
_MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _FRAME.pack(n >> 16, n & 0xFFFF, kind, flags, stream_id) + payload


def _literal(name: bytes, value: bytes) -> bytes:
    """One header as an HPACK literal, never indexed, with a literal name: no encoder state."""
    return b"".join(
        (b"\x10", encode_integer(len(name), 7), name, encode_integer(len(value), 7), value)
    )


def header_block(headers: list[tuple[bytes, bytes]]) -> bytes:
    return b"".join(_literal(k, v) for k, v in headers)


_TABLE_SIZE_ZERO = b"\x20"  # dynamic table size update to 0: this encoder never indexes
_RESPONSE_HEAD = b"\x88" + header_block(
    [(b"content-type", b"application/grpc"), (b"grpc-accept-encoding", _ACCEPTED)]
)
_OK = _literal(b"grpc-status", b"0")


def _status_block(code: int, details: str, metadata: list[tuple[bytes, bytes]]) -> bytes:
    headers = [(b"grpc-status", str(code).encode())]
    if details:
        headers.append((b"grpc-message", quote(details[:4096], safe=_MESSAGE_SAFE).encode()))
    return header_block(headers + metadata)


def _metadata_bytes(metadata: Any) -> list[tuple[bytes, bytes]]:
    out = []
    for key, value in metadata or ():
        k = str(key).lower().encode("latin-1")
        if k.endswith(b"-bin"):
            raw = value if isinstance(value, bytes) else str(value).encode("latin-1")
            out.append((k, base64.b64encode(raw).rstrip(b"=")))
        else:
            v = value if isinstance(value, bytes) else str(value).encode("latin-1", "replace")
            out.append((k, v.replace(b"\r", b" ").replace(b"\n", b" ")))
    return out


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, metadata: Any = None) -> None:
        self.code, self.details, self.metadata = code, details, metadata


class _Compressed(bytes):
    """A request message as it came, compressed with the call's grpc-encoding."""


def _inflate(data: bytes, wbits: int, limit: int) -> bytes:
    """``data`` decompressed, at most ``limit`` bytes; raises ``_Abort`` as grpcio fails
    the call (RESOURCE_EXHAUSTED if larger, INTERNAL if not valid)."""
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(data, limit + 1)
    except zlib.error:
        raise _Abort(grpc.StatusCode.INTERNAL, "could not decompress the message") from None
    if len(out) > limit:
        details = f"Received message larger than max (over {limit} bytes decompressed)"
        raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, details)
    if not d.eof:
        raise _Abort(grpc.StatusCode.INTERNAL, "could not decompress the message")
    return out


class Call:
    """What a handler sees of its call: grpc.aio's servicer context, as far as rtserve uses it."""

    __slots__ = ("_metadata", "_peer", "deadline", "trailers")

    def __init__(self, metadata: list[tuple[str, str | bytes]], peer: str, deadline: float | None):
        self._metadata = metadata
        self._peer = peer
        self.deadline = deadline
        self.trailers: Any = ()

    def invocation_metadata(self) -> list[tuple[str, str | bytes]]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def set_trailing_metadata(self, metadata: Any) -> None:
        self.trailers = metadata

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> NoReturn:
        raise _Abort(code, details, trailing_metadata)


def _methods(frontend: GrpcFrontend) -> dict[bytes, Method]:
    """The service's methods by HTTP/2 ``:path``."""
    return {f"/{SERVICE.full_name}/{m.name}".encode(): m for m in service_methods(frontend)}


class _Stream:
    __slots__ = (
        "id", "method", "call", "task", "buf", "message", "queue", "held", "waiter",
        "recv_window", "send_window", "remote_closed", "local_closed", "pending",
        "pending_bytes", "drained", "timer", "encoding", "buffered", "unreleased", "since",
        "queued", "waits",
    )  # fmt: skip

    def __init__(self, stream_id: int, send_window: int) -> None:
        self.id = stream_id
        self.method: Method | None = None
        self.call: Call | None = None
        self.task: asyncio.Task[None] | None = None
        self.buf = bytearray()
        self.message: bytes | None = None  # a unary call's request
        self.queue: deque[bytes] = deque()  # a streaming call's requests not yet taken
        self.held = 0  # bytes in queue
        self.waiter: asyncio.Future[None] | None = None
        self.recv_window = INITIAL_WINDOW
        self.send_window = send_window
        self.remote_closed = False
        self.local_closed = False
        self.pending: deque[tuple[bool, bytes, bool]] = deque()  # (is data, bytes, ends)
        self.pending_bytes = 0
        self.drained: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.encoding = 0  # zlib wbits of the request's grpc-encoding (0: identity)
        self.buffered = 0  # request bytes held for the handler (buf, message, queue)
        self.unreleased = 0  # bytes received, not yet given back to the connection's window
        self.since = 0.0  # loop time of the request's last progress
        self.queued = False  # in Connection.ready
        self.waits = False  # in Connection.waiting


class _Requests:
    """A streaming call's requests, as the handler's async iterator; taking one gives its
    bytes back to the client's window."""

    def __init__(self, conn: Connection, st: _Stream, parse: Callable[[bytes], Any]) -> None:
        self.conn, self.st, self.parse = conn, st, parse

    def __aiter__(self) -> _Requests:
        return self

    async def __anext__(self) -> Any:
        st = self.st
        while not st.queue:
            if st.remote_closed:
                raise StopAsyncIteration
            st.waiter = asyncio.get_running_loop().create_future()
            await st.waiter
        data = st.queue.popleft()
        self.conn.taken(st, len(data) + 5)
        return self.parse(await self.conn.message(st, data))


class ConnectionError_(Exception):
    """A connection error: GOAWAY with ``code``, then close."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class Connection(asyncio.Protocol):
    def __init__(self, server: GrpcH2Server) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.preface_ok = False
        self.decoder = Decoder(max_header_list_size=MAX_HEADER_BYTES)
        self.streams: dict[int, _Stream] = {}
        self.last_stream = 0
        self.peer = ""
        self.out: list[bytes] = []
        self.flushing = False
        self.closed = False
        self.going_away = False
        self.table_reset = False  # sent the dynamic table size update
        self.peer_window = 65535  # the peer's initial stream window (SETTINGS)
        self.peer_max_frame = 16384
        self.send_window = 65535  # connection-level, what the peer lets us send
        self.recv_unacked = 0
        self.recv_window = 65535
        self.update_at = 32768  # given back in WINDOW_UPDATEs of at least this much
        self.granted = False  # CONN_WINDOW granted
        self.buffered = 0  # request bytes held for handlers (_Stream.buffered, summed)
        self.leader: _Stream | None = None  # the partial message let past CONN_BUFFER
        self.waiting: deque[_Stream] = deque()  # partial messages waiting for room, in turn
        self.blocked: set[_Stream] = set()  # streams with answer data waiting for window
        self.ready: deque[_Stream] = deque()  # of those, the ones the connection's window holds
        self.hdr: tuple[int, int, bytearray] | None = None  # a header block being continued
        self.resets = 0  # streams reset (by the client or for its errors) since the last sweep
        self.address = ""  # the client's IP address
        self.now = self.created = self.active = self.calm_at = self.loop.time()
        self.calm: float = CALM_BURST  # frames without progress still allowed

    # ------------------------------------------------------------------ transport
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if len(self.server.connections) >= self.server.max_connections:
            transport.abort()  # type: ignore[attr-defined]  # past the cap: closed at once
            self.closed = True
            return
        self.server.connections.add(self)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and peer:
            host = self.address = str(peer[0])
            self.peer = f"ipv6:[{host}]:{peer[1]}" if ":" in host else f"ipv4:{host}:{peer[1]}"
        settings = b"".join(
            struct.pack(">HL", k, v)
            for k, v in ((3, MAX_STREAMS), (4, INITIAL_WINDOW), (6, MAX_HEADER_BYTES))
        )
        self.send(frame(SETTINGS, 0, 0, settings))
        if not self.server.authenticating:
            self._grant()

    def _grant(self) -> None:
        """The connection's full window: at once without keys, else after a call passed them
        (until then a client has the protocol's 64 KiB)."""
        self.granted = True
        self.update_at = CONN_WINDOW // 4
        self.recv_window += CONN_WINDOW - 65535
        self.send(frame(WINDOW_UPDATE, 0, 0, _U32.pack(CONN_WINDOW - 65535)))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self.server.held.pop(self, None)
        for st in list(self.streams.values()):
            self._drop(st)
        self.streams.clear()
        self.blocked.clear()
        self.ready.clear()

    def pause_writing(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def send(self, data: bytes) -> None:
        self.out.append(data)
        if not self.flushing:
            self.flushing = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self.flushing = False
        if self.out and not self.closed and self.transport is not None:
            self.transport.write(b"".join(self.out))
        self.out.clear()

    def close(self, code: int, reason: str = "") -> None:
        if self.closed:
            return
        payload = _U32.pack(self.last_stream) + _U32.pack(code) + reason.encode()[:256]
        self.send(frame(GOAWAY, 0, 0, payload))
        self._flush()
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def go_away(self) -> None:
        """Graceful: no new streams; the connection closes once its streams are done."""
        if not self.going_away and not self.closed:
            self.going_away = True
            self.send(frame(GOAWAY, 0, 0, _U32.pack(self.last_stream) + _U32.pack(NO_ERROR)))
            if not self.streams:
                self.close(NO_ERROR)

    # ------------------------------------------------------------------ reading frames
    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.now = self.loop.time()
        buf = self.buf
        buf += data
        try:
            if not self.preface_ok:
                if len(buf) < 24:
                    if not PREFACE.startswith(bytes(buf)):
                        raise ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 preface")
                    return
                if buf[:24] != PREFACE:
                    raise ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 preface")
                self.preface_ok = True
                del buf[:24]
            view = memoryview(buf)
            pos, end = 0, len(buf)
            try:
                while end - pos >= 9:
                    hi, lo, kind, flags, sid = _FRAME.unpack_from(view, pos)
                    length = hi << 16 | lo
                    if length > MAX_FRAME:
                        raise ConnectionError_(FRAME_SIZE_ERROR, "frame larger than allowed")
                    if end - pos - 9 < length:
                        break
                    payload = view[pos + 9 : pos + 9 + length]
                    pos += 9 + length
                    try:
                        self._frame(kind, flags, sid & 0x7FFFFFFF, payload)
                    finally:
                        payload.release()
                    if self.closed:
                        return
            finally:
                view.release()
            del buf[:pos]
        except ConnectionError_ as exc:
            self.close(exc.code, str(exc))

    def _frame(self, kind: int, flags: int, sid: int, payload: memoryview) -> None:
        if self.hdr is not None and (kind != CONTINUATION or sid != self.hdr[0]):
            raise ConnectionError_(PROTOCOL_ERROR, "expected CONTINUATION")
        if kind == DATA:
            self._data(flags, sid, payload)
        elif kind == HEADERS:
            self._headers(flags, sid, payload)
        elif kind == CONTINUATION:
            self._continuation(flags, sid, payload)
        elif kind == SETTINGS:
            self._settings(flags, sid, payload)
        elif kind == WINDOW_UPDATE:
            self._idle_frame()  # (the answer frames it lets out earn it back)
            self._window_update(sid, payload)
        elif kind == PING:
            self._idle_frame()
            if len(payload) != 8 or sid:
                raise ConnectionError_(FRAME_SIZE_ERROR, "bad PING")
            if not flags & ACK:
                self.send(frame(PING, ACK, 0, bytes(payload)))
        elif kind == RST_STREAM:
            self._idle_frame()
            if len(payload) != 4 or not sid:
                raise ConnectionError_(PROTOCOL_ERROR, "bad RST_STREAM")
            st = self.streams.pop(sid, None)
            if st is not None:
                unanswered = not st.local_closed
                self._drop(st)
                self._count_reset()
                if unanswered:  # a call cancelled before its answer gives back its credit
                    self._idle_frame(CALL_CREDIT)
        elif kind == GOAWAY:
            self._idle_frame()
            self.go_away()
        elif kind == PUSH_PROMISE:
            raise ConnectionError_(PROTOCOL_ERROR, "a client may not push")
        else:  # PRIORITY, and frame types to ignore
            self._idle_frame()
            if kind == PRIORITY and (len(payload) != 5 or not sid):
                raise ConnectionError_(PROTOCOL_ERROR, "bad PRIORITY")

    def _idle_frame(self, cost: float = 1.0) -> None:
        """A frame that makes no progress: spend the budget, refilled at CALM_RATE."""
        self.calm -= cost
        if self.calm < 0:
            now = self.loop.time()
            self.calm = min(CALM_BURST, self.calm + (now - self.calm_at) * CALM_RATE)
            self.calm_at = now
            if self.calm < 0:
                raise ConnectionError_(ENHANCE_YOUR_CALM, "too many frames without progress")

    def _count_reset(self) -> None:
        self.resets += 1
        if self.resets > MAX_RESETS:  # "rapid reset", and "made you reset"
            raise ConnectionError_(ENHANCE_YOUR_CALM, "too many reset streams")

    @staticmethod
    def _unpad(flags: int, payload: memoryview) -> memoryview:
        if flags & PADDED:
            if not payload:
                raise ConnectionError_(PROTOCOL_ERROR, "bad padding")
            pad = payload[0]
            if pad >= len(payload):
                raise ConnectionError_(PROTOCOL_ERROR, "padding longer than the frame")
            return payload[1 : len(payload) - pad]
        return payload

    def _settings(self, flags: int, sid: int, payload: memoryview) -> None:
        if sid:
            raise ConnectionError_(PROTOCOL_ERROR, "SETTINGS on a stream")
        self._idle_frame()
        if flags & ACK:
            return
        if len(payload) % 6:
            raise ConnectionError_(FRAME_SIZE_ERROR, "bad SETTINGS length")
        grown = False
        for i in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HL", payload, i)
            if key == 1:
                self.table_reset = False  # say again that we do not index
            elif key == 4:
                if value > 0x7FFFFFFF:
                    raise ConnectionError_(FLOW_CONTROL_ERROR, "window too large")
                delta = value - self.peer_window
                self.peer_window = value
                self._idle_frame(len(self.streams) / 64)  # (a walk over every stream)
                for st in self.streams.values():
                    st.send_window += delta
                grown = delta > 0
            elif key == 5:
                if not 16384 <= value <= 16777215:
                    raise ConnectionError_(PROTOCOL_ERROR, "bad MAX_FRAME_SIZE")
                self.peer_max_frame = value
        self.send(frame(SETTINGS, ACK, 0))
        if grown:
            for st in list(self.blocked):
                if not st.queued:
                    self._drain(st)

    def _window_update(self, sid: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise ConnectionError_(FRAME_SIZE_ERROR, "bad WINDOW_UPDATE")
        increment = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if sid == 0:
            if not increment:
                raise ConnectionError_(PROTOCOL_ERROR, "zero window increment")
            self.send_window += increment
            if self.send_window > 0x7FFFFFFF:
                raise ConnectionError_(FLOW_CONTROL_ERROR, "window too large")
            if self.ready:
                self._pump()
        else:
            st = self.streams.get(sid)
            if st is None:
                return
            st.send_window += increment
            if not increment or st.send_window > 0x7FFFFFFF:
                self._reset(st, PROTOCOL_ERROR if not increment else FLOW_CONTROL_ERROR)
                return
            if st.pending and not st.queued:
                self._drain(st)  # only this stream can have been unblocked

    def _headers(self, flags: int, sid: int, payload: memoryview) -> None:
        if not sid or not sid & 1:
            raise ConnectionError_(PROTOCOL_ERROR, "HEADERS on an invalid stream id")
        block = self._unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            block = block[5:]
        if flags & END_HEADERS:
            self._header_block(sid, flags, block)
        else:
            self.hdr = (sid, flags, bytearray(block))

    def _continuation(self, flags: int, sid: int, payload: memoryview) -> None:
        self._idle_frame()  # (an empty one would otherwise never reach MAX_HEADER_BYTES)
        if self.hdr is None:
            raise ConnectionError_(PROTOCOL_ERROR, "CONTINUATION without HEADERS")
        _, first_flags, block = self.hdr
        block += payload
        if len(block) > MAX_HEADER_BYTES:
            raise ConnectionError_(ENHANCE_YOUR_CALM, "header block too large")
        if flags & END_HEADERS:
            self.hdr = None
            self._header_block(sid, first_flags, memoryview(block))

    def _header_block(self, sid: int, flags: int, block: memoryview) -> None:
        try:
            headers = list(self.decoder.decode(bytes(block), raw=True))
        except HPACKError as exc:
            reason = f"header block: {type(exc).__name__}"
            raise ConnectionError_(COMPRESSION_ERROR, reason) from None
        st = self.streams.get(sid)
        if st is not None:  # trailers from the client: they must end the request, once
            self._idle_frame()
            if st.remote_closed:
                self._reset(st, STREAM_CLOSED)
            elif not flags & END_STREAM:
                self._reset(st, PROTOCOL_ERROR)
            else:
                self._remote_end(st)
            return
        if sid <= self.last_stream:
            self._idle_frame()
            return  # a stream we already closed (reset): ignore what was in flight
        self.last_stream = sid
        st = _Stream(sid, self.peer_window)
        if self.going_away or len(self.streams) >= MAX_STREAMS:
            self._idle_frame()
            self.send(frame(RST_STREAM, 0, sid, _U32.pack(REFUSED_STREAM)))
            return
        self.streams[sid] = st
        self._start(st, headers, bool(flags & END_STREAM))

    def _data(self, flags: int, sid: int, payload: memoryview) -> None:
        n = len(payload)
        self.recv_window -= n
        if self.recv_window < 0:
            raise ConnectionError_(FLOW_CONTROL_ERROR, "connection window exceeded")
        ended = flags & END_STREAM
        st = self.streams.get(sid)
        if st is None or st.remote_closed:
            if sid > self.last_stream or not sid:
                raise ConnectionError_(PROTOCOL_ERROR, "DATA on an idle stream")
            if not n:
                self._idle_frame()
            self._conn_credit(n)  # a stream closed or reset while the client was sending
            return
        st.recv_window -= n
        st.unreleased += n
        if st.recv_window < 0:
            self._reset(st, FLOW_CONTROL_ERROR)
            return
        body = self._unpad(flags, payload)
        if st.local_closed:  # answered early (an error): discard the rest
            self._release(st, n)
            if ended:
                self._remote_end(st)
            return
        if body:
            st.since = self.active = self.now
        method = st.method
        if (  # a unary call's one message in one frame, as clients send it: not buffered
            not st.buf
            and st.message is None
            and len(body) >= 5
            and method is not None
            and not method.streaming
        ):
            compressed, size = _GRPC_PREFIX.unpack_from(body)
            if len(body) == size + 5 and not compressed and size <= self.server.max_message:
                st.message = bytes(body[5:])
                if ended:
                    self._remote_end(st)
                else:
                    self._buffer(st, size)
                return
        size = len(body)
        st.buf += body
        self._buffer(st, size)
        taken = self._messages(st)
        if taken < 0:
            return
        if not taken and not ended and size < TINY_DATA:
            self._idle_frame()
        if ended:
            self._remote_end(st)
        elif not st.local_closed:
            self.credit(st)
            if self.waiting and self.leader is st and not st.buf:
                self._promote()  # its message is whole: another may lead

    def _messages(self, st: _Stream) -> int:
        """Take whole messages out of the stream's buffer: how many, -1 if the call failed."""
        buf = st.buf
        taken = 0
        while len(buf) >= 5:
            compressed, size = _GRPC_PREFIX.unpack_from(buf)
            if compressed and not st.encoding:
                details = "a compressed message without grpc-encoding"
                self._status(st, grpc.StatusCode.INTERNAL, details)
                return -1
            if size > self.server.max_message:
                limit = self.server.max_message
                details = f"Received message larger than max ({size} vs. {limit})"
                self._status(st, grpc.StatusCode.RESOURCE_EXHAUSTED, details)
                return -1
            if len(buf) < size + 5:
                break
            data = bytes(buf[5 : size + 5])
            del buf[: size + 5]
            taken += 1
            if compressed:  # inflated by the handler's task, on a thread (a bomb takes time)
                data = _Compressed(data)
            assert st.method is not None
            if st.method.streaming:
                st.queue.append(data)
                st.held += size + 5
                self._wake(st)
            elif st.message is not None:
                self._status(st, grpc.StatusCode.UNIMPLEMENTED, "expected one request message")
                return -1
            else:
                st.message = data
                self._buffer(st, -5)  # (the prefix, no longer held)
        return taken

    async def message(self, st: _Stream, data: bytes) -> bytes:
        """A request message as the handler parses it: a compressed one inflated on a
        thread (a bomb takes time), within the message limit."""
        if isinstance(data, _Compressed):
            return await asyncio.to_thread(_inflate, data, st.encoding, self.server.max_message)
        return data

    # ------------------------------------------------------------------ receive budgets
    def _buffer(self, st: _Stream, n: int) -> None:
        """``n`` more (or fewer) request bytes held for ``st``'s handler."""
        st.buffered += n
        self.buffered += n
        server = self.server
        server.buffered += n
        if n < 0 and server.held and server.buffered <= server.max_buffered:
            server.wake()

    def _room(self, st: _Stream) -> bool:
        """Whether ``st``'s partial message may be given more window: as the connection's
        one message let through (the leader, with STREAM_WINDOW), or within CONN_BUFFER;
        never past SERVER_BUFFER."""
        server = self.server
        if server.buffered > server.max_buffered:
            server.held[self] = None  # woken when room is made (GrpcH2Server.wake)
            return False
        leader = self.leader
        if leader is None or not leader.buf or leader.remote_closed or leader.local_closed:
            self.leader = leader = st
        return leader is st or self.buffered <= CONN_BUFFER

    def credit(self, st: _Stream) -> None:
        """Give the client back the window of what the handler took (and of partial
        messages, within the budgets), never of requests still queued. Only the leader's
        window grows past INITIAL_WINDOW: other streams' partial messages hold little."""
        if st.remote_closed or st.local_closed:
            return
        partial = st.buffered - st.held
        room = not partial or self._room(st)
        target = STREAM_WINDOW if room and self.leader is st else INITIAL_WINDOW
        give = target - st.held - st.recv_window
        if not room:
            give -= partial  # the partial message waits for room
            if not st.waits:
                st.waits = True
                self.waiting.append(st)
        if give >= target // 4 or (give > 0 and st.held == 0 and st.buf):
            st.recv_window += give
            self.send(frame(WINDOW_UPDATE, 0, st.id, _U32.pack(give)))
            self._release(st, give)

    def taken(self, st: _Stream, n: int) -> None:
        """A streaming call's handler took a message of ``n`` bytes (with its prefix)."""
        st.held -= n
        st.since = self.loop.time()  # (the client may send again)
        self._buffer(st, -n)
        if st.remote_closed or st.local_closed:
            self._release(st, n)
        else:
            self.credit(st)
        if self.waiting:
            self._promote()

    def _promote(self) -> None:
        """Room was made: the partial messages that wait for it get window, in turn, until
        one still finds none (a leader is chosen among them)."""
        waiting = self.waiting
        while waiting and not self.closed:
            st = waiting.popleft()
            st.waits = False
            if st.id in self.streams and st.buf and not (st.remote_closed or st.local_closed):
                self.credit(st)
                if st.waits:
                    break

    def _release(self, st: _Stream, n: int) -> None:
        """Give the connection's window back for ``n`` of the bytes received on ``st``."""
        n = min(n, st.unreleased)
        st.unreleased -= n
        self._conn_credit(n)

    def _conn_credit(self, n: int) -> None:
        if n < 0 or self.closed:
            return
        self.recv_unacked += n
        if self.recv_unacked >= self.update_at:
            self.send(frame(WINDOW_UPDATE, 0, 0, _U32.pack(self.recv_unacked)))
            self.recv_window += self.recv_unacked
            self.recv_unacked = 0

    def stalled(self, now: float) -> None:
        """End the calls whose request made no progress for REQUEST_STALL_S: headers and
        no whole unary message, or a partial message (not while whole ones wait for the
        handler: then the server holds the client); WINDOW_STALL_S while the stream or the
        connection has no window left (the budgets hold the client)."""
        open_window = self.recv_window > 0
        for st in list(self.streams.values()):
            method = st.method
            if st.remote_closed or st.local_closed or method is None or st.held:
                continue
            if not method.streaming or st.buf:
                if open_window and st.recv_window > 0:
                    limit, name = REQUEST_STALL_S, "REQUEST_STALL_S"
                else:
                    limit, name = WINDOW_STALL_S, "WINDOW_STALL_S"
                if now - st.since <= limit:
                    continue
                details = f"no request data for {limit:g} s ({name})"
                self._status(st, grpc.StatusCode.RESOURCE_EXHAUSTED, details)
                if st.task is not None:
                    st.task.cancel()

    def busy(self) -> bool:
        """Whether a unary call's handler is running (its answer will come)."""
        return any(
            st.task is not None
            and not st.task.done()
            and st.method is not None
            and not st.method.streaming
            for st in self.streams.values()
        )

    def _remote_end(self, st: _Stream) -> None:
        st.remote_closed = True
        if st.local_closed:
            self._forget(st)
            return
        method = st.method
        if method is None:
            return
        if method.streaming:
            self._wake(st)
        elif st.buf:
            self._status(st, grpc.StatusCode.INTERNAL, "incomplete request message")
        elif st.message is None:
            self._status(st, grpc.StatusCode.UNIMPLEMENTED, "expected one request message")
        else:
            message, st.message = st.message, None
            if st.buffered:
                self._buffer(st, -st.buffered)
            n = st.unreleased  # (the connection's window back: _release, inline)
            if n:
                st.unreleased = 0
                self.recv_unacked += n
                if self.recv_unacked >= self.update_at:
                    self._conn_credit(0)
            st.task = self.loop.create_task(self._unary(st, method, message))
            if self.waiting:
                self._promote()

    @staticmethod
    def _wake(st: _Stream) -> None:
        if st.waiter is not None and not st.waiter.done():
            st.waiter.set_result(None)

    # ------------------------------------------------------------------ calls
    def _start(self, st: _Stream, headers: list[Any], ended: bool) -> None:
        path = ctype = timeout = encoding = None
        method_ok = False
        metadata: list[tuple[str, str | bytes]] = []
        for name, value in headers:
            if name[:1] == b":":
                if name == b":path":
                    path = value
                elif name == b":method":
                    method_ok = value == b"POST"
            elif name == b"content-type":
                ctype = value
            elif name == b"grpc-timeout":
                timeout = value
            elif name == b"grpc-encoding":
                encoding = value
            elif name not in _NOT_METADATA:
                if name.endswith(b"-bin"):
                    metadata.append((name.decode("latin-1"), _unbase64(value)))
                else:
                    metadata.append((name.decode("latin-1"), value.decode("latin-1")))
        st.remote_closed = ended  # an error below answers a complete request
        if not method_ok or ctype is None or not ctype.startswith(b"application/grpc"):
            self._idle_frame(2)
            self._http_refusal(st, b"415" if method_ok else b"405")
            return
        server = self.server
        method = server.methods.get(path or b"")
        if server.authenticating:  # before anything of the message is read
            try:
                check_call_headers(server.guard, method.name if method else None, metadata)
            except RTServeError as exc:
                self._idle_frame(2)
                self._status(st, *grpc_error(exc))
                return
        if not self.granted:
            self._grant()
        if method is None:
            self._idle_frame(2)
            where = (path or b"").decode("latin-1", "replace")[:200]
            self._status(st, grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {where}")
            return
        if server.calls >= server.max_calls:
            self._status(st, grpc.StatusCode.RESOURCE_EXHAUSTED, "too many calls in progress")
            return
        from_address = server.by_address.get(self.address, 0)
        if from_address >= server.max_address_calls:
            details = "too many calls in progress from this address"
            self._status(st, grpc.StatusCode.RESOURCE_EXHAUSTED, details)
            return
        if encoding is not None:
            wbits = _ENCODINGS.get(encoding.strip().lower())
            if wbits is None:
                self._idle_frame(2)
                name = encoding.decode("latin-1", "replace")[:40]
                details = f"grpc-encoding {name!r}: not supported (identity, deflate, gzip)"
                self._status(st, grpc.StatusCode.UNIMPLEMENTED, details)
                return
            st.encoding = wbits
        deadline = None
        if timeout is not None:
            seconds = _timeout(timeout)
            if seconds is None:
                self._idle_frame(2)
                self._status(st, grpc.StatusCode.INTERNAL, "malformed grpc-timeout")
                return
            deadline = time.monotonic() + seconds
            st.timer = self.loop.call_later(seconds, self._expire, st)
        st.method = method
        st.call = Call(metadata, self.peer, deadline)
        server.calls += 1
        server.by_address[self.address] = from_address + 1
        st.since = self.active = self.now
        calm = self.calm + CALL_CREDIT
        self.calm = calm if calm < CALM_BURST else CALM_BURST
        st.remote_closed = False
        if method.streaming:
            st.task = self.loop.create_task(self._streaming(st, method))
        if ended:
            self._remote_end(st)

    async def _unary(self, st: _Stream, method: Method, data: bytes) -> None:
        call = st.call
        if call is None or st.local_closed:  # ended before its handler ran
            return
        try:
            reply = await method.fn(method.parse(await self.message(st, data)), call)
            body = method.serialize(reply)
        except _Abort as exc:
            self._status(st, exc.code, exc.details, exc.metadata)
            return
        except asyncio.CancelledError:
            return
        except Exception as exc:
            log.exception("gRPC call failed")
            self._status(st, *grpc_error(exc), grpc_trailers(exc))
            return
        if st.local_closed:
            return
        if len(body) > self.server.max_message:
            details = f"response larger than max ({len(body)} vs. {self.server.max_message})"
            self._status(st, grpc.StatusCode.RESOURCE_EXHAUSTED, details)
            return
        self._head(st)
        self._data_out(st, _GRPC_PREFIX.pack(0, len(body)) + body)
        trailers = _OK + header_block(_metadata_bytes(call.trailers)) if call.trailers else _OK
        self._trailers(st, trailers)

    async def _streaming(self, st: _Stream, method: Method) -> None:
        call = st.call
        if call is None or st.local_closed:
            return
        started = False
        try:
            async with aclosing(method.fn(_Requests(self, st, method.parse), call)) as replies:
                async for reply in replies:
                    if st.local_closed:
                        return
                    if not started:
                        self._head(st)
                        started = True
                    body = method.serialize(reply)
                    self._data_out(st, _GRPC_PREFIX.pack(0, len(body)) + body)
                    if st.pending_bytes > MAX_OUT_PENDING:
                        st.drained = self.loop.create_future()
                        await st.drained
        except _Abort as exc:
            self._status(st, exc.code, exc.details, exc.metadata, started)
            return
        except asyncio.CancelledError:
            return
        except Exception as exc:
            log.exception("gRPC stream failed")
            self._status(st, *grpc_error(exc), grpc_trailers(exc), started)
            return
        if not st.local_closed:
            if not started:
                self._head(st)
            self._trailers(st, _OK)

    def _expire(self, st: _Stream) -> None:
        st.timer = None
        if not st.local_closed:
            self._status(st, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        if st.task is not None:
            st.task.cancel()

    # ------------------------------------------------------------------ writing answers
    def _first(self, block: bytes) -> bytes:
        """A header block to send; the connection's first also says that this encoder
        never uses the dynamic table (again after the client changes its size)."""
        if self.table_reset:
            return block
        self.table_reset = True
        return _TABLE_SIZE_ZERO + block

    def _head(self, st: _Stream) -> None:
        self._out(st, frame(HEADERS, END_HEADERS, st.id, self._first(_RESPONSE_HEAD)), False)

    def _trailers(self, st: _Stream, block: bytes) -> None:
        st.local_closed = True
        self._out(st, frame(HEADERS, END_HEADERS | END_STREAM, st.id, block), True)

    def _status(
        self,
        st: _Stream,
        code: grpc.StatusCode,
        details: str,
        metadata: Any = (),
        started: bool = False,
    ) -> None:
        """End the call with a status (a trailers-only answer if nothing was sent)."""
        if st.local_closed or self.closed:
            return
        block = _status_block(code.value[0], details, _metadata_bytes(metadata))
        if not started:
            block = self._first(_RESPONSE_HEAD) + block
        self._trailers(st, block)

    def _http_refusal(self, st: _Stream, status: bytes) -> None:
        self._trailers(st, self._first(header_block([(b":status", status)])))

    def _out(self, st: _Stream, headers: bytes, ends: bool) -> None:
        """A HEADERS frame, after the stream's answer data still waiting for window."""
        if st.pending:
            st.pending.append((False, headers, ends))
            return
        self.send(headers)
        if ends:
            self._closed_local(st)

    def _data_out(self, st: _Stream, payload: bytes) -> None:
        n = len(payload)
        self.active = self.loop.time()
        if (
            not st.pending
            and n <= st.send_window
            and n <= self.send_window
            and n <= self.peer_max_frame
        ):
            st.send_window -= n
            self.send_window -= n
            self.send(frame(DATA, 0, st.id, payload))
            if self.calm < CALM_BURST:
                self.calm += 1
            return
        st.pending.append((True, payload, False))
        st.pending_bytes += n
        self.blocked.add(st)
        if not st.queued:
            self._drain(st)

    def _drain(self, st: _Stream) -> int:
        """Send what the windows allow of ``st``'s queued answer (a DATA frame once the
        window holds MIN_SEND bytes, or all that is left); while the connection's window is
        what holds it, ``st`` waits in ``ready``. Returns the frames sent."""
        pending = st.pending
        sent = 0
        while pending and not self.closed:
            is_data, data, ends = pending[0]
            if not is_data:
                pending.popleft()
                self.send(data)
                sent += 1
                if ends:
                    self._closed_local(st)
                continue
            n = len(data)
            room = min(st.send_window, self.send_window, self.peer_max_frame, n)
            if room < n and room < MIN_SEND:
                if st.send_window >= min(n, MIN_SEND) and not st.queued:
                    st.queued = True
                    self.ready.append(st)
                break
            st.send_window -= room
            self.send_window -= room
            st.pending_bytes -= room
            self.send(frame(DATA, 0, st.id, data[:room] if room < n else data))
            sent += 1
            if room < n:
                pending[0] = (True, data[room:], False)
            else:
                pending.popleft()
        if not pending:
            self.blocked.discard(st)
        if st.drained is not None and st.pending_bytes <= MAX_OUT_PENDING // 2:
            if not st.drained.done():
                st.drained.set_result(None)
            st.drained = None
        if sent:
            self.calm = min(CALM_BURST, self.calm + sent)
        return sent

    def _pump(self) -> None:
        """The connection's window grew: send the answers that waited for it, in turn,
        until it is spent (work in proportion to the frames sent)."""
        ready = self.ready
        while ready and not self.closed:
            st = ready.popleft()
            st.queued = False
            if st.pending and st.id in self.streams and not self._drain(st):
                break  # (the window is spent; it waits again, at the back)

    def _closed_local(self, st: _Stream) -> None:
        """The answer's last frame was sent."""
        if st.remote_closed:
            self._forget(st)
        else:  # answered before the request ended: the client may stop sending
            self.send(frame(RST_STREAM, 0, st.id, _U32.pack(NO_ERROR)))
            self._forget(st)

    def _forget(self, st: _Stream) -> None:
        if self.streams.pop(st.id, None) is not None:
            self._end_call(st)
        if self.going_away and not self.streams:
            self.loop.call_soon(self.close, NO_ERROR)

    def _end_call(self, st: _Stream) -> None:
        if st.call is not None:
            st.call = None
            server = self.server
            server.calls -= 1
            left = server.by_address[self.address] - 1
            if left:
                server.by_address[self.address] = left
            else:
                del server.by_address[self.address]
        if st.timer is not None:
            st.timer.cancel()
            st.timer = None
        if st.buffered:
            self._buffer(st, -st.buffered)
        if st.unreleased:
            self._release(st, st.unreleased)
        if self.leader is st:
            self.leader = None
        self.blocked.discard(st)
        if self.waiting:
            self._promote()

    def _drop(self, st: _Stream) -> None:
        """The client reset the stream or left: stop its handler."""
        st.local_closed = st.remote_closed = True
        self._end_call(st)
        st.pending.clear()
        st.pending_bytes = 0
        if st.task is not None and not st.task.done():
            st.task.cancel()
        self._wake(st)
        if st.drained is not None and not st.drained.done():
            st.drained.set_result(None)

    def _reset(self, st: _Stream, code: int) -> None:
        """A stream error (the client broke the protocol on it): counts as a reset."""
        self.send(frame(RST_STREAM, 0, st.id, _U32.pack(code)))
        self.streams.pop(st.id, None)
        self._drop(st)
        self._count_reset()
        self._idle_frame(CALL_CREDIT)


def _unbase64(value: bytes) -> bytes:
    try:
        return base64.b64decode(value + b"=" * (-len(value) % 4))
    except ValueError:
        return value


def _timeout(value: bytes) -> float | None:
    """grpc-timeout (``1234S``: at most 8 digits and a unit) in seconds, None if malformed."""
    digits, unit = value[:-1], value[-1:]
    if not 1 <= len(digits) <= 8 or not digits.isdigit() or unit not in _TIMEOUT_UNITS:
        return None
    return int(digits) * _TIMEOUT_UNITS[unit]


class GrpcH2Server:
    """The listening socket(s) and connections of the gRPC transport; stop() drains."""

    def __init__(
        self,
        frontend: GrpcFrontend,
        ssl_context: ssl.SSLContext | None = None,
        max_calls: int = MAX_CALLS,
    ) -> None:
        self.frontend = frontend
        self.methods = _methods(frontend)
        self.max_message = frontend.max_message_bytes
        self.max_calls = max_calls
        self.max_address_calls = max(1, max_calls * MAX_CALLS_PER_ADDRESS // MAX_CALLS)
        self.ssl = ssl_context
        self.guard = frontend.guard
        self.authenticating = self.guard is not None and self.guard.auth is not None
        self.calls = 0
        self.by_address: dict[str, int] = {}  # calls in progress per client address
        self.buffered = 0  # request bytes held for handlers, all connections
        self.max_buffered = max(SERVER_BUFFER, 2 * (self.max_message + 5))
        # Connections with a partial message held by max_buffered, woken in order once
        # room is made (by a call on any connection), not only by their own traffic.
        self.held: dict[Connection, None] = {}
        self._waking = False
        self.connections: set[Connection] = set()
        # (a descriptor each; HTTP keeps three quarters of them: server.http1.HttpServer)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.max_connections = max(64, min(MAX_CONNECTIONS, soft // 8))
        self.handshaking: set[TlsAcceptor] = set()  # TLS handshakes in progress
        self.loop = asyncio.get_running_loop()
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int, reuse_port: bool = False) -> int:
        self._server = await self.loop.create_server(
            self._accepted, host, port, reuse_port=reuse_port or None, backlog=2048
        )
        self._sweeper = self.loop.create_task(self._sweep())
        return int(self._server.sockets[0].getsockname()[1])

    def _accepted(self) -> asyncio.Protocol:
        """A new connection's protocol; under TLS, one that runs the handshake first
        (``server.accept``: handshakes in progress count towards the cap)."""
        if self.ssl is None:
            return Connection(self)
        return TlsAcceptor(
            self.ssl, PREFACE_S, lambda: Connection(self), self.handshaking, self.room
        )

    def wake(self) -> None:
        """Room was made within max_buffered: the held connections get another look (soon,
        not inside the bookkeeping that made it)."""
        if not self._waking:
            self._waking = True
            self.loop.call_soon(self._wake_held)

    def _wake_held(self) -> None:
        self._waking = False
        held = self.held
        while held and self.buffered <= self.max_buffered:
            conn = next(iter(held))
            del held[conn]
            if not conn.closed and conn.waiting:
                conn._promote()  # (held again, at the back, if it still finds no room)

    def room(self) -> bool:
        """Whether one more connection fits ``max_connections``."""
        return len(self.connections) + len(self.handshaking) < self.max_connections

    async def _sweep(self) -> None:
        """End stalled requests (each TICK_S); close connections without a preface after
        PREFACE_S, or without progress for IDLE_S and no unary call running (each SWEEP_S)."""
        ticks = 0
        every = max(1, round(SWEEP_S / TICK_S))
        while True:
            await asyncio.sleep(TICK_S)
            ticks += 1
            now = self.loop.time()
            for conn in list(self.connections):
                if conn.streams:
                    conn.stalled(now)
                if ticks % every:
                    continue
                conn.resets = 0
                if not conn.preface_ok and now - conn.created > PREFACE_S:
                    conn.close(PROTOCOL_ERROR, "no preface")
                elif now - conn.active > IDLE_S and not conn.busy():
                    conn.close(NO_ERROR, "idle")

    async def stop(self, grace: float | None) -> None:
        """No new connections or streams; calls in progress get ``grace`` seconds."""
        if self._server is not None:
            self._server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        for conn in list(self.connections):
            conn.go_away()
        deadline = time.monotonic() + (grace or 0.0)
        while any(c.streams for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for conn in list(self.connections):
            conn.close(NO_ERROR)
        await asyncio.sleep(0)


async def start_grpc_h2(
    frontend: GrpcFrontend,
    host: str,
    port: int,
    reuse_port: bool = False,
    ssl_context: ssl.SSLContext | None = None,
) -> tuple[GrpcH2Server, int]:
    server = GrpcH2Server(frontend, ssl_context)
    return server, await server.start(host, port, reuse_port)
