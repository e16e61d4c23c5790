"""The V2 gRPC service on rtserve's own HTTP/2 framing, over the event loop's transport.

grpcio's server spends about 150 µs of its one core per call in its own machinery (a
completion-queue hop per call step); this transport serves the same ``GrpcFrontend``
handlers with a few Python frames per call (docs/deploy.md has the figures). HPACK decoding
comes from the ``hpack`` library; frames, flow control and gRPC's length-prefixed messages
are here. Answers are encoded without HPACK's dynamic table (literals, never indexed), so
they need no encoder state and the constant header block is built once.

Bounds (a client is hostile): streams per connection (``MAX_STREAMS``), calls in progress
(``MAX_CALLS``), header blocks (``MAX_HEADER_BYTES``), messages (``max_message_bytes``,
checked from the 5-byte prefix before the body is buffered), and per stream the received
messages not yet taken by the handler (one stream window: HTTP/2 flow control holds the
client). Idle connections and ones that never finish the preface are closed.
"""

from __future__ import annotations

import asyncio
import base64
import logging
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

from rtserve.server.accept import TlsAcceptor
from rtserve.server.errors import grpc_error, grpc_trailers
from rtserve.server.grpc import SERVICE, GrpcFrontend, Method, service_methods

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
MAX_RESETS = 10_000  # calls a client cancels per SWEEP_S before its connection is closed
STREAM_WINDOW = 1 << 20  # what one stream may send ahead of the handler
CONN_WINDOW = 16 << 20
MAX_HEADER_BYTES = 16 << 10  # one header block, and the decoded header list
MAX_FRAME = 16384  # the largest frame we accept (the protocol's default)
MAX_OUT_PENDING = 1 << 20  # answer bytes a stream handler may queue before it waits
IDLE_S = 300.0
PREFACE_S = 10.0
SWEEP_S = 5.0

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
        "pending_bytes", "drained", "timer", "encoding",
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
        self.recv_window = STREAM_WINDOW
        self.send_window = send_window
        self.remote_closed = False
        self.local_closed = False
        self.pending: deque[tuple[bool, bytes, bool]] = deque()  # (is data, bytes, ends)
        self.pending_bytes = 0
        self.drained: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.encoding = 0  # zlib wbits of the request's grpc-encoding (0: identity)


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
        st.held -= len(data) + 5
        self.conn.credit(st)
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
        self.recv_window = CONN_WINDOW
        self.blocked: set[_Stream] = set()  # streams with data waiting for window
        self.hdr: tuple[int, int, bytearray] | None = None  # a header block being continued
        self.resets = 0  # streams the client reset since the last sweep
        self.created = self.active = time.monotonic()

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
            host = str(peer[0])
            self.peer = f"ipv6:[{host}]:{peer[1]}" if ":" in host else f"ipv4:{host}:{peer[1]}"
        settings = b"".join(
            struct.pack(">HL", k, v)
            for k, v in ((3, MAX_STREAMS), (4, STREAM_WINDOW), (6, MAX_HEADER_BYTES))
        )
        self.send(frame(SETTINGS, 0, 0, settings))
        self.send(frame(WINDOW_UPDATE, 0, 0, _U32.pack(CONN_WINDOW - 65535)))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        for st in list(self.streams.values()):
            self._drop(st)
        self.streams.clear()
        self.blocked.clear()

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
        self.active = time.monotonic()
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
            self._window_update(sid, payload)
        elif kind == PING:
            if len(payload) != 8 or sid:
                raise ConnectionError_(FRAME_SIZE_ERROR, "bad PING")
            if not flags & ACK:
                self.send(frame(PING, ACK, 0, bytes(payload)))
        elif kind == RST_STREAM:
            if len(payload) != 4 or not sid:
                raise ConnectionError_(PROTOCOL_ERROR, "bad RST_STREAM")
            st = self.streams.pop(sid, None)
            if st is not None:
                self._drop(st)
                self.resets += 1
                if self.resets > MAX_RESETS:  # "rapid reset": calls started and cancelled
                    raise ConnectionError_(ENHANCE_YOUR_CALM, "too many cancelled calls")
        elif kind == GOAWAY:
            self.go_away()
        elif kind == PUSH_PROMISE:
            raise ConnectionError_(PROTOCOL_ERROR, "a client may not push")
        elif kind == PRIORITY and (len(payload) != 5 or not sid):
            raise ConnectionError_(PROTOCOL_ERROR, "bad PRIORITY")

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
        if flags & ACK:
            return
        if len(payload) % 6:
            raise ConnectionError_(FRAME_SIZE_ERROR, "bad SETTINGS length")
        for i in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HL", payload, i)
            if key == 1:
                self.table_reset = False  # say again that we do not index
            elif key == 4:
                if value > 0x7FFFFFFF:
                    raise ConnectionError_(FLOW_CONTROL_ERROR, "window too large")
                delta = value - self.peer_window
                self.peer_window = value
                for st in self.streams.values():
                    st.send_window += delta
            elif key == 5:
                if not 16384 <= value <= 16777215:
                    raise ConnectionError_(PROTOCOL_ERROR, "bad MAX_FRAME_SIZE")
                self.peer_max_frame = value
        self.send(frame(SETTINGS, ACK, 0))
        if self.blocked:
            self._pump()

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
        else:
            st = self.streams.get(sid)
            if st is None:
                return
            st.send_window += increment
            if not increment or st.send_window > 0x7FFFFFFF:
                self._reset(st, PROTOCOL_ERROR if not increment else FLOW_CONTROL_ERROR)
                return
        if self.blocked:
            self._pump()

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
        if st is not None:  # trailers from the client: the request side ends
            if flags & END_STREAM:
                self._remote_end(st)
            return
        if sid <= self.last_stream:
            return  # a stream we already closed (reset): ignore what was in flight
        self.last_stream = sid
        st = _Stream(sid, self.peer_window)
        if self.going_away or len(self.streams) >= MAX_STREAMS:
            self.send(frame(RST_STREAM, 0, sid, _U32.pack(REFUSED_STREAM)))
            return
        self.streams[sid] = st
        self._start(st, headers, bool(flags & END_STREAM))

    def _data(self, flags: int, sid: int, payload: memoryview) -> None:
        n = len(payload)
        self.recv_window -= n
        if self.recv_window < 0:
            raise ConnectionError_(FLOW_CONTROL_ERROR, "connection window exceeded")
        self.recv_unacked += n
        if self.recv_unacked >= CONN_WINDOW // 4:
            self.send(frame(WINDOW_UPDATE, 0, 0, _U32.pack(self.recv_unacked)))
            self.recv_window += self.recv_unacked
            self.recv_unacked = 0
        st = self.streams.get(sid)
        if st is None or st.remote_closed:
            if sid > self.last_stream or not sid:
                raise ConnectionError_(PROTOCOL_ERROR, "DATA on an idle stream")
            return  # a stream closed or reset while the client was sending
        st.recv_window -= n
        if st.recv_window < 0:
            self._reset(st, FLOW_CONTROL_ERROR)
            return
        body = self._unpad(flags, payload)
        if st.local_closed:  # answered early (an error): discard the rest
            if flags & END_STREAM:
                self._remote_end(st)
            return
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
                if flags & END_STREAM:
                    self._remote_end(st)
                return
        st.buf += body
        if self._messages(st) and flags & END_STREAM:
            self._remote_end(st)
        elif not st.local_closed and not flags & END_STREAM:
            self.credit(st)

    def _messages(self, st: _Stream) -> bool:
        """Take whole messages out of the stream's buffer; False if the call was failed."""
        buf = st.buf
        while len(buf) >= 5:
            compressed, size = _GRPC_PREFIX.unpack_from(buf)
            if compressed and not st.encoding:
                details = "a compressed message without grpc-encoding"
                self._status(st, grpc.StatusCode.INTERNAL, details)
                return False
            if size > self.server.max_message:
                limit = self.server.max_message
                details = f"Received message larger than max ({size} vs. {limit})"
                self._status(st, grpc.StatusCode.RESOURCE_EXHAUSTED, details)
                return False
            if len(buf) < size + 5:
                break
            data = bytes(buf[5 : size + 5])
            del buf[: size + 5]
            if compressed:  # inflated by the handler's task, on a thread (a bomb takes time)
                data = _Compressed(data)
            assert st.method is not None
            if st.method.streaming:
                st.queue.append(data)
                st.held += size + 5
                self._wake(st)
            elif st.message is not None:
                self._status(st, grpc.StatusCode.UNIMPLEMENTED, "expected one request message")
                return False
            else:
                st.message = data
        return True

    async def message(self, st: _Stream, data: bytes) -> bytes:
        """A request message as the handler parses it: a compressed one inflated on a
        thread (a bomb takes time), within the message limit."""
        if isinstance(data, _Compressed):
            return await asyncio.to_thread(_inflate, data, st.encoding, self.server.max_message)
        return data

    def credit(self, st: _Stream) -> None:
        """Give the client back the window of what the handler took (and of partial
        messages, bounded by the message limit), never of requests still queued."""
        if st.remote_closed or st.local_closed:
            return
        give = STREAM_WINDOW - st.held - st.recv_window
        if give >= STREAM_WINDOW // 4 or (give > 0 and st.held == 0 and st.buf):
            st.recv_window += give
            self.send(frame(WINDOW_UPDATE, 0, st.id, _U32.pack(give)))

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
            st.task = self.loop.create_task(self._unary(st, method, st.message))
            st.message = None

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
            self._http_refusal(st, b"415" if method_ok else b"405")
            return
        method = self.server.methods.get(path or b"")
        if method is None:
            where = (path or b"").decode("latin-1", "replace")[:200]
            self._status(st, grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {where}")
            return
        if self.server.calls >= self.server.max_calls:
            self._status(st, grpc.StatusCode.RESOURCE_EXHAUSTED, "too many calls in progress")
            return
        if encoding is not None:
            wbits = _ENCODINGS.get(encoding.strip().lower())
            if wbits is None:
                name = encoding.decode("latin-1", "replace")[:40]
                details = f"grpc-encoding {name!r}: not supported (identity, deflate, gzip)"
                self._status(st, grpc.StatusCode.UNIMPLEMENTED, details)
                return
            st.encoding = wbits
        deadline = None
        if timeout is not None:
            seconds = _timeout(timeout)
            if seconds is None:
                self._status(st, grpc.StatusCode.INTERNAL, "malformed grpc-timeout")
                return
            deadline = time.monotonic() + seconds
            st.timer = self.loop.call_later(seconds, self._expire, st)
        st.method = method
        st.call = Call(metadata, self.peer, deadline)
        self.server.calls += 1
        st.remote_closed = False
        if method.streaming:
            st.task = self.loop.create_task(self._streaming(st, method))
        if ended:
            self._remote_end(st)

    async def _unary(self, st: _Stream, method: Method, data: bytes) -> None:
        call = st.call
        assert call is not None
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
        assert call is not None
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
        if (
            not st.pending
            and n <= st.send_window
            and n <= self.send_window
            and n <= self.peer_max_frame
        ):
            st.send_window -= n
            self.send_window -= n
            self.send(frame(DATA, 0, st.id, payload))
            return
        st.pending.append((True, payload, False))
        st.pending_bytes += n
        self.blocked.add(st)
        self._pump()

    def _pump(self) -> None:
        """Send what the windows allow of the streams' queued answers."""
        for st in list(self.blocked):
            while st.pending and not self.closed:
                is_data, data, ends = st.pending[0]
                if not is_data:
                    st.pending.popleft()
                    self.send(data)
                    if ends:
                        self._closed_local(st)
                    continue
                room = min(st.send_window, self.send_window, self.peer_max_frame, len(data))
                if room <= 0:
                    break
                chunk, rest = data[:room], data[room:]
                st.send_window -= room
                self.send_window -= room
                st.pending_bytes -= room
                self.send(frame(DATA, 0, st.id, chunk))
                if rest:
                    st.pending[0] = (True, rest, False)
                else:
                    st.pending.popleft()
            if not st.pending:
                self.blocked.discard(st)
            if st.drained is not None and st.pending_bytes <= MAX_OUT_PENDING // 2:
                if not st.drained.done():
                    st.drained.set_result(None)
                st.drained = None

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
            self.server.calls -= 1
        if st.timer is not None:
            st.timer.cancel()
            st.timer = None
        self.blocked.discard(st)

    def _drop(self, st: _Stream) -> None:
        """The client reset the stream or left: stop its handler."""
        st.local_closed = st.remote_closed = True
        self._end_call(st)
        if st.task is not None and not st.task.done():
            st.task.cancel()
        self._wake(st)
        if st.drained is not None and not st.drained.done():
            st.drained.set_result(None)

    def _reset(self, st: _Stream, code: int) -> None:
        self.send(frame(RST_STREAM, 0, st.id, _U32.pack(code)))
        self.streams.pop(st.id, None)
        self._drop(st)


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
        self.ssl = ssl_context
        self.calls = 0
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

    def room(self) -> bool:
        """Whether one more connection fits ``max_connections``."""
        return len(self.connections) + len(self.handshaking) < self.max_connections

    async def _sweep(self) -> None:
        """Close connections idle for IDLE_S, or without a preface after PREFACE_S."""
        while True:
            await asyncio.sleep(SWEEP_S)
            now = time.monotonic()
            for conn in list(self.connections):
                conn.resets = 0
                if not conn.preface_ok and now - conn.created > PREFACE_S:
                    conn.close(PROTOCOL_ERROR, "no preface")
                elif not conn.streams and now - conn.active > IDLE_S:
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
