"""The V2 gRPC service on rtserve's own HTTP/2 framing, over the event loop's transport.

grpcio's server spends about 150 µs of its one core per call in its own machinery (a
completion-queue hop per call step); this transport serves the same route table
(``rtserve.api.grpc_service.GRPC_ROUTES``) with a few Python frames per call
(docs/deploy.md has the figures). HPACK decoding comes from the ``hpack`` library. The
pieces, each testable without a socket: ``h2_frames`` (the preface, frames, header blocks,
the frame type -> handler table), ``h2_windows`` (flow-control arithmetic), ``h2_receive``
(the request bytes held and the windows given back), ``h2_budgets`` (what a client may
cost) and ``h2_call`` (a call's headers, messages, handler context and stream state).
This module is the connection that puts them together, and the server.

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
import logging
import resource
import ssl
import time
from typing import Any

import grpc
from hpack import Decoder, HPACKError

from rtserve.api.grpc_service import GrpcFrontend, Method, bind_routes, check_call_headers
from rtserve.errors import RTServeError
from rtserve.server.accept import TlsAcceptor
from rtserve.server.errors import grpc_error
from rtserve.server.h2_budgets import (
    CALL_CREDIT,
    CALM_BURST,
    CALM_RATE,
    CONN_BUFFER,
    CONN_WINDOW,
    INITIAL_WINDOW,
    MAX_CALLS,
    MAX_CALLS_PER_ADDRESS,
    MAX_RESETS,
    REQUEST_STALL_S,
    SERVER_BUFFER,
    STREAM_WINDOW,
    TINY_DATA,
    WINDOW_STALL_S,
    CallBudget,
    FrameBudget,
    stall_limit,
)
from rtserve.server.h2_call import (
    ENCODINGS,
    GRPC_PREFIX,
    RESPONSE_HEAD,
    TABLE_SIZE_ZERO,
    Call,
    CallHeaders,
    Compressed,
    Stream,
    header_block,
    metadata_bytes,
    parse_timeout,
    status_block,
)
from rtserve.server.h2_frames import (
    ACK,
    COMPRESSION_ERROR,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    MAX_HEADER_BYTES,
    NO_ERROR,
    PING,
    PREFACE,
    PRIORITY,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    STREAM_CLOSED,
    U32,
    ConnectionError_,
    FrameReader,
    frame,
    read_increment,
    read_settings,
    settings_frame,
    unpad,
)
from rtserve.server.h2_handlers import streaming, unary
from rtserve.server.h2_receive import Receiver
from rtserve.server.h2_send import Outbox
from rtserve.server.h2_windows import (
    DEFAULT_WINDOW,
    MAX_WINDOW,
    grown,
)

__all__ = [
    "CALL_CREDIT",
    "CALM_BURST",
    "CALM_RATE",
    "CONN_BUFFER",
    "CONN_WINDOW",
    "ENHANCE_YOUR_CALM",
    "INITIAL_WINDOW",
    "MAX_CALLS",
    "MAX_CALLS_PER_ADDRESS",
    "MAX_CONNECTIONS",
    "MAX_HEADER_BYTES",
    "MAX_RESETS",
    "MAX_STREAMS",
    "PREFACE",
    "REQUEST_STALL_S",
    "SERVER_BUFFER",
    "STREAM_WINDOW",
    "WINDOW_STALL_S",
    "Call",
    "Connection",
    "ConnectionError_",
    "GrpcH2Server",
    "frame",
    "header_block",
    "start_grpc_h2",
]

log = logging.getLogger(__name__)

MAX_STREAMS = 1024  # concurrent streams per connection (SETTINGS_MAX_CONCURRENT_STREAMS)
MAX_CONNECTIONS = 10_000  # open connections (at most an eighth of the descriptor limit)
IDLE_S = 300.0
PREFACE_S = 10.0
SWEEP_S = 5.0
TICK_S = 1.0  # how often stalled requests are looked for
_SETTINGS = {3: MAX_STREAMS, 4: INITIAL_WINDOW, 6: MAX_HEADER_BYTES}


def _methods(frontend: GrpcFrontend) -> dict[bytes, Method]:
    """The service's route table (``GRPC_ROUTES``) by HTTP/2 ``:path``."""
    return {path.encode(): m for path, m in bind_routes(frontend).items()}


class Connection(asyncio.Protocol):
    """One client connection: its streams, what it may still send and be sent, its answers
    waiting for window. Frames arrive through ``FrameReader``, one ``on_*`` per type."""

    def __init__(self, server: GrpcH2Server) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.reader = FrameReader(self)
        self.decoder = Decoder(max_header_list_size=MAX_HEADER_BYTES)
        self.streams: dict[int, Stream] = {}
        self.last_stream = 0
        self.peer = ""
        self.out: list[bytes] = []
        self.flushing = False
        self.closed = False
        self.going_away = False
        self.table_reset = False  # sent the dynamic table size update
        self.peer_window = DEFAULT_WINDOW  # the peer's initial stream window (SETTINGS)
        self.outbox = Outbox()  # answers waiting for window, the connection's send window
        self.recv = Receiver(self, server)  # request bytes held, windows given back
        self.address = ""  # the client's IP address
        self.now = self.created = self.active = self.loop.time()
        self.budget = FrameBudget(self.loop.time)  # frames without progress, resets

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
        self.send(settings_frame(_SETTINGS))
        if not self.server.authenticating:
            self.recv.grant()  # (with keys: once a call passed them)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reader.stop()
        self.server.connections.discard(self)
        self.server.held.pop(self, None)
        for st in list(self.streams.values()):
            self._drop(st)
        self.streams.clear()
        self.outbox.clear()

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
        payload = U32.pack(self.last_stream) + U32.pack(code) + reason.encode()[:256]
        self.send(frame(GOAWAY, 0, 0, payload))
        self._flush()
        self.closed = True
        self.reader.stop()
        if self.transport is not None:
            self.transport.close()

    def go_away(self) -> None:
        """Graceful: no new streams; the connection closes once its streams are done."""
        if not self.going_away and not self.closed:
            self.going_away = True
            self.send(frame(GOAWAY, 0, 0, U32.pack(self.last_stream) + U32.pack(NO_ERROR)))
            if not self.streams:
                self.close(NO_ERROR)

    @property
    def preface_ok(self) -> bool:
        return self.reader.preface_ok

    # ------------------------------------------------------------------ frames (FrameTarget)
    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.now = self.loop.time()
        try:
            self.reader.feed(data)
        except ConnectionError_ as exc:
            self.close(exc.code, str(exc))

    def spend(self, cost: float = 1.0) -> None:
        """A frame that makes no progress (``FrameBudget.spend``)."""
        self.budget.spend(cost)

    def on_ping(self, flags: int, sid: int, payload: memoryview) -> None:
        self.budget.spend()
        if len(payload) != 8 or sid:
            raise ConnectionError_(FRAME_SIZE_ERROR, "bad PING")
        if not flags & ACK:
            self.send(frame(PING, ACK, 0, bytes(payload)))

    def on_rst_stream(self, flags: int, sid: int, payload: memoryview) -> None:
        budget = self.budget
        budget.spend()
        if len(payload) != 4 or not sid:
            raise ConnectionError_(PROTOCOL_ERROR, "bad RST_STREAM")
        st = self.streams.pop(sid, None)
        if st is not None:
            unanswered = not st.local_closed
            self._drop(st)
            budget.reset()
            if unanswered:  # a call cancelled before its answer gives back its credit
                budget.spend(CALL_CREDIT)

    def on_goaway(self, flags: int, sid: int, payload: memoryview) -> None:
        self.budget.spend()
        self.go_away()

    def on_other(self, kind: int, sid: int, payload: memoryview) -> None:
        """PRIORITY, and frame types to ignore."""
        self.budget.spend()
        if kind == PRIORITY and (len(payload) != 5 or not sid):
            raise ConnectionError_(PROTOCOL_ERROR, "bad PRIORITY")

    def on_settings(self, flags: int, sid: int, payload: memoryview) -> None:
        if sid:
            raise ConnectionError_(PROTOCOL_ERROR, "SETTINGS on a stream")
        self.budget.spend()
        if flags & ACK:
            return
        grew = False
        for key, value in read_settings(payload):
            if key == 1:
                self.table_reset = False  # say again that we do not index
            elif key == 4:
                if value > MAX_WINDOW:
                    raise ConnectionError_(FLOW_CONTROL_ERROR, "window too large")
                delta = value - self.peer_window
                self.peer_window = value
                self.budget.spend(len(self.streams) / 64)  # (a walk over every stream)
                self.outbox.initial_window(self.streams, delta)
                grew = delta > 0
            elif key == 5:
                if not 16384 <= value <= 16777215:
                    raise ConnectionError_(PROTOCOL_ERROR, "bad MAX_FRAME_SIZE")
                self.outbox.max_frame = value
        self.send(frame(SETTINGS, ACK, 0))
        if grew:
            for st in list(self.outbox.blocked):
                if not st.queued:
                    self._drain(st)

    def on_window_update(self, flags: int, sid: int, payload: memoryview) -> None:
        self.budget.spend()  # (the answer frames it lets out earn it back)
        increment = read_increment(payload)
        if sid == 0:
            if not increment:
                raise ConnectionError_(PROTOCOL_ERROR, "zero window increment")
            outbox = self.outbox
            outbox.window = grown(outbox.window, increment)
            if outbox.ready:
                self._pump()
            return
        st = self.streams.get(sid)
        if st is None:
            return
        st.send_window += increment
        if not increment or st.send_window > MAX_WINDOW:
            self._reset(st, PROTOCOL_ERROR if not increment else FLOW_CONTROL_ERROR)
            return
        if st.pending and not st.queued:
            self._drain(st)  # only this stream can have been unblocked

    def on_header_block(self, sid: int, flags: int, block: memoryview) -> None:
        try:
            headers = list(self.decoder.decode(bytes(block), raw=True))
        except HPACKError as exc:
            reason = f"header block: {type(exc).__name__}"
            raise ConnectionError_(COMPRESSION_ERROR, reason) from None
        st = self.streams.get(sid)
        if st is not None:  # trailers from the client: they must end the request, once
            self.budget.spend()
            if st.remote_closed:
                self._reset(st, STREAM_CLOSED)
            elif not flags & END_STREAM:
                self._reset(st, PROTOCOL_ERROR)
            else:
                self._remote_end(st)
            return
        if sid <= self.last_stream:
            self.budget.spend()
            return  # a stream we already closed (reset): ignore what was in flight
        self.last_stream = sid
        if self.going_away or len(self.streams) >= MAX_STREAMS:
            self.budget.spend()
            self.send(frame(RST_STREAM, 0, sid, U32.pack(REFUSED_STREAM)))
            return
        st = Stream(sid, INITIAL_WINDOW, self.peer_window)
        self.streams[sid] = st
        self._start(st, CallHeaders(headers), bool(flags & END_STREAM))

    def on_data(self, flags: int, sid: int, payload: memoryview) -> None:
        n = len(payload)
        recv = self.recv
        recv.inbound.consume(n)
        ended = flags & END_STREAM
        st = self.streams.get(sid)
        if st is None or st.remote_closed:
            if sid > self.last_stream or not sid:
                raise ConnectionError_(PROTOCOL_ERROR, "DATA on an idle stream")
            if not n:
                self.budget.spend()
            recv.conn_credit(n)  # a stream closed or reset while the client was sending
            return
        if not recv.received(st, n):
            self._reset(st, FLOW_CONTROL_ERROR)
            return
        body = unpad(flags, payload)
        if st.local_closed:  # answered early (an error): discard the rest
            recv.release(st, n)
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
            compressed, size = GRPC_PREFIX.unpack_from(body)
            if len(body) == size + 5 and not compressed and size <= self.server.max_message:
                st.message = bytes(body[5:])
                if ended:
                    self._remote_end(st)
                else:
                    recv.buffer(st, size)
                return
        size = len(body)
        st.buf += body
        recv.buffer(st, size)
        taken = self._messages(st)
        if taken < 0:
            return
        if not taken and not ended and size < TINY_DATA:
            self.budget.spend()
        if ended:
            self._remote_end(st)
        elif not st.local_closed:
            recv.credit(st)
            if recv.waiting and recv.leader is st and not st.buf:
                recv.promote()  # its message is whole: another may lead

    def _messages(self, st: Stream) -> int:
        """Take whole messages out of the stream's buffer: how many, -1 if the call failed."""
        buf = st.buf
        taken = 0
        max_message = self.server.max_message
        while len(buf) >= 5:
            compressed, size = GRPC_PREFIX.unpack_from(buf)
            if compressed and not st.encoding:
                details = "a compressed message without grpc-encoding"
                self.status(st, grpc.StatusCode.INTERNAL, details)
                return -1
            if size > max_message:
                details = f"Received message larger than max ({size} vs. {max_message})"
                self.status(st, grpc.StatusCode.RESOURCE_EXHAUSTED, details)
                return -1
            if len(buf) < size + 5:
                break
            data = bytes(buf[5 : size + 5])
            del buf[: size + 5]
            taken += 1
            if compressed:  # inflated by the handler's task, on a thread (a bomb takes time)
                data = Compressed(data)
            assert st.method is not None
            if st.method.streaming:
                st.queue.append(data)
                st.held += size + 5
                st.wake()
            elif st.message is not None:
                self.status(st, grpc.StatusCode.UNIMPLEMENTED, "expected one request message")
                return -1
            else:
                st.message = data
                self.recv.buffer(st, -5)  # (the prefix, no longer held)
        return taken

    # ------------------------------------------------------------------ receiving
    def taken(self, st: Stream, n: int) -> None:
        """A streaming call's handler took a message of ``n`` bytes (with its prefix)."""
        st.since = self.loop.time()  # (the client may send again)
        self.recv.taken(st, n)

    def promote(self) -> None:
        """Room was made (``Receiver.promote``: the server wakes held connections)."""
        self.recv.promote()

    def stalled(self, now: float) -> None:
        """End the calls whose request made no progress for REQUEST_STALL_S: headers and
        no whole unary message, or a partial message (not while whole ones wait for the
        handler: then the server holds the client); WINDOW_STALL_S while the stream or the
        connection has no window left (the budgets hold the client)."""
        window_open = self.recv.window_open
        for st in list(self.streams.values()):
            method = st.method
            if not st.open or method is None or st.held:
                continue
            if not method.streaming or st.buf:
                limit, name = stall_limit(window_open(st))
                if now - st.since <= limit:
                    continue
                details = f"no request data for {limit:g} s ({name})"
                self.status(st, grpc.StatusCode.RESOURCE_EXHAUSTED, details)
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

    def _remote_end(self, st: Stream) -> None:
        st.remote_closed = True
        if st.local_closed:
            self._forget(st)
            return
        method = st.method
        if method is None:
            return
        if method.streaming:
            st.wake()
        elif st.buf:
            self.status(st, grpc.StatusCode.INTERNAL, "incomplete request message")
        elif st.message is None:
            self.status(st, grpc.StatusCode.UNIMPLEMENTED, "expected one request message")
        else:
            data, st.message = st.message, None
            self.recv.unary_taken(st)  # (the connection's window back)
            st.task = self.loop.create_task(unary(self, st, method, data, self.server.max_message))

    # ------------------------------------------------------------------ calls
    def _start(self, st: Stream, headers: CallHeaders, ended: bool) -> None:
        st.remote_closed = ended  # an error below answers a complete request
        if not headers.is_grpc:
            self.budget.spend(2)
            self._http_refusal(st, b"415" if headers.post else b"405")
            return
        server = self.server
        method = server.methods.get(headers.path)
        if server.authenticating:  # before anything of the message is read
            try:
                check_call_headers(server.guard, method.name if method else None, headers.metadata)
            except RTServeError as exc:
                self.budget.spend(2)
                self.status(st, *grpc_error(exc))
                return
        if not self.recv.granted:
            self.recv.grant()
        if method is None:
            self.budget.spend(2)
            where = headers.path.decode("latin-1", "replace")[:200]
            self.status(st, grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {where}")
            return
        refusal = server.budget.refusal(self.address)
        if refusal is not None:
            self.status(st, grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
            return
        if not self._call_options(st, headers):
            return
        st.method = method
        st.call = Call(headers.metadata, self.peer, self._deadline(st, headers))
        server.budget.begin(self.address)
        st.since = self.active = self.now
        self.budget.earn(CALL_CREDIT)
        st.remote_closed = False
        if method.streaming:
            st.task = self.loop.create_task(streaming(self, st, method, self.server.max_message))
        if ended:
            self._remote_end(st)

    def _call_options(self, st: Stream, headers: CallHeaders) -> bool:
        """Read the call's grpc-encoding and grpc-timeout; False if one was refused."""
        encoding = headers.encoding
        if encoding is not None:
            wbits = ENCODINGS.get(encoding.strip().lower())
            if wbits is None:
                self.budget.spend(2)
                name = encoding.decode("latin-1", "replace")[:40]
                details = f"grpc-encoding {name!r}: not supported (identity, deflate, gzip)"
                self.status(st, grpc.StatusCode.UNIMPLEMENTED, details)
                return False
            st.encoding = wbits
        if headers.timeout is not None and parse_timeout(headers.timeout) is None:
            self.budget.spend(2)
            self.status(st, grpc.StatusCode.INTERNAL, "malformed grpc-timeout")
            return False
        return True

    def _deadline(self, st: Stream, headers: CallHeaders) -> float | None:
        """The call's deadline (a timer ends it then), None without grpc-timeout."""
        seconds = None if headers.timeout is None else parse_timeout(headers.timeout)
        if seconds is None:
            return None
        st.timer = self.loop.call_later(seconds, self._expire, st)
        return time.monotonic() + seconds

    def _expire(self, st: Stream) -> None:
        st.timer = None
        if not st.local_closed:
            self.status(st, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        if st.task is not None:
            st.task.cancel()

    # ------------------------------------------------------------------ writing answers
    def _first(self, block: bytes) -> bytes:
        """A header block to send; the connection's first also says that this encoder
        never uses the dynamic table (again after the client changes its size)."""
        if self.table_reset:
            return block
        self.table_reset = True
        return TABLE_SIZE_ZERO + block

    def head(self, st: Stream) -> None:
        self._out(st, frame(HEADERS, END_HEADERS, st.id, self._first(RESPONSE_HEAD)), False)

    def trailers(self, st: Stream, block: bytes) -> None:
        st.local_closed = True
        self._out(st, frame(HEADERS, END_HEADERS | END_STREAM, st.id, block), True)

    def status(
        self,
        st: Stream,
        code: grpc.StatusCode,
        details: str,
        metadata: Any = (),
        started: bool = False,
    ) -> None:
        """End the call with a status (a trailers-only answer if nothing was sent)."""
        if st.local_closed or self.closed:
            return
        block = status_block(code.value[0], details, metadata_bytes(metadata))
        if not started:
            block = self._first(RESPONSE_HEAD) + block
        self.trailers(st, block)

    def _http_refusal(self, st: Stream, status: bytes) -> None:
        self.trailers(st, self._first(header_block([(b":status", status)])))

    def _out(self, st: Stream, headers: bytes, ends: bool) -> None:
        """A HEADERS frame, after the stream's answer data still waiting for window."""
        if self.outbox.headers(st, headers, ends, self.send):
            self._closed_local(st)

    def data_out(self, st: Stream, payload: bytes) -> None:
        self.active = self.loop.time()
        sent, ended = self.outbox.data(st, payload, self.send)
        self._sent(st, sent, ended)

    def _drain(self, st: Stream) -> int:
        """Send what the windows allow of ``st``'s queued answer (``Outbox.drain``);
        returns the frames sent."""
        if self.closed:
            return 0
        sent, ended = self.outbox.drain(st, self.send)
        self._sent(st, sent, ended)
        return sent

    def _sent(self, st: Stream, sent: int, ended: bool) -> None:
        """Answer frames went out: they earn the budget back; the last one ends the stream."""
        if sent:
            self.budget.earn(sent)
        if ended:
            self._closed_local(st)

    def _pump(self) -> None:
        """The connection's window grew: send the answers that waited for it, in turn,
        until it is spent (work in proportion to the frames sent)."""
        ready = self.outbox.ready
        while ready and not self.closed:
            st = ready.popleft()
            st.queued = False
            if st.pending and st.id in self.streams and not self._drain(st):
                break  # (the window is spent; it waits again, at the back)

    def _closed_local(self, st: Stream) -> None:
        """The answer's last frame was sent."""
        if not st.remote_closed:  # answered before the request ended: the client may stop
            self.send(frame(RST_STREAM, 0, st.id, U32.pack(NO_ERROR)))
        self._forget(st)

    def _forget(self, st: Stream) -> None:
        if self.streams.pop(st.id, None) is not None:
            self._end_call(st)
        if self.going_away and not self.streams:
            self.loop.call_soon(self.close, NO_ERROR)

    def _end_call(self, st: Stream) -> None:
        if st.call is not None:
            st.call = None
            self.server.budget.end(self.address)
        if st.timer is not None:
            st.timer.cancel()
            st.timer = None
        self.outbox.blocked.discard(st)
        self.recv.end(st)

    def _drop(self, st: Stream) -> None:
        """The client reset the stream or left: stop its handler."""
        st.local_closed = st.remote_closed = True
        self._end_call(st)
        self.outbox.drop(st)
        if st.task is not None and not st.task.done():
            st.task.cancel()
        st.wake()
        if st.drained is not None and not st.drained.done():
            st.drained.set_result(None)

    def _reset(self, st: Stream, code: int) -> None:
        """A stream error (the client broke the protocol on it): counts as a reset."""
        self.send(frame(RST_STREAM, 0, st.id, U32.pack(code)))
        self.streams.pop(st.id, None)
        self._drop(st)
        self.budget.reset()
        self.budget.spend(CALL_CREDIT)


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
        self.budget = CallBudget(max_calls, self.max_message)
        self.ssl = ssl_context
        self.guard = frontend.guard
        self.authenticating = self.guard is not None and self.guard.auth is not None
        # Connections with a partial message held by the budget's max_buffered, woken in
        # order once room is made (by a call on any connection), not only by their own traffic.
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

    @property
    def calls(self) -> int:
        """Calls in progress, all connections."""
        return self.budget.calls

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
        while held and not self.budget.full:
            conn = next(iter(held))
            del held[conn]
            if not conn.closed and conn.recv.waiting:
                conn.promote()  # (held again, at the back, if it still finds no room)

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
                conn.budget.new_period()
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
