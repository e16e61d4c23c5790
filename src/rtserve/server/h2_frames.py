"""HTTP/2 framing for the gRPC transport: the client preface, frames, header blocks, and
the table that hands each frame to its handler.

``FrameReader`` knows nothing of streams or gRPC: it splits a connection's bytes into frames,
checks what the framing layer alone can check (frame size, padding, CONTINUATION order, the
header block's size) and calls the handler that the frame's type names. What the frames mean
is the handler's (``server/grpc_h2.py``).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Protocol

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE = range(9)
CONTINUATION = 9
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0, 1, 2, 3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 5, 6, 7, 8, 9
ENHANCE_YOUR_CALM = 11

MAX_HEADER_BYTES = 16 << 10  # one header block, and the decoded header list
MAX_FRAME = 16384  # the largest frame we accept (the protocol's default)

_FRAME = struct.Struct(">BHBBL")
U32 = struct.Struct(">L")
_SETTING = struct.Struct(">HL")


class ConnectionError_(Exception):
    """A connection error: GOAWAY with ``code``, then close."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _FRAME.pack(n >> 16, n & 0xFFFF, kind, flags, stream_id) + payload


def unpad(flags: int, payload: memoryview) -> memoryview:
    """A DATA or HEADERS frame's payload without its padding."""
    if flags & PADDED:
        if not payload:
            raise ConnectionError_(PROTOCOL_ERROR, "bad padding")
        pad = payload[0]
        if pad >= len(payload):
            raise ConnectionError_(PROTOCOL_ERROR, "padding longer than the frame")
        return payload[1 : len(payload) - pad]
    return payload


def settings_frame(settings: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(_SETTING.pack(k, v) for k, v in settings.items()))


def read_settings(payload: memoryview) -> list[tuple[int, int]]:
    """A SETTINGS frame's (identifier, value) pairs."""
    if len(payload) % 6:
        raise ConnectionError_(FRAME_SIZE_ERROR, "bad SETTINGS length")
    return [_SETTING.unpack_from(payload, i) for i in range(0, len(payload), 6)]


def read_increment(payload: memoryview) -> int:
    """A WINDOW_UPDATE frame's increment (possibly 0: the caller decides what that breaks)."""
    if len(payload) != 4:
        raise ConnectionError_(FRAME_SIZE_ERROR, "bad WINDOW_UPDATE")
    return int(U32.unpack(payload)[0]) & 0x7FFFFFFF


FrameHandler = Callable[[int, int, memoryview], None]  # (flags, stream id, payload)


class FrameTarget(Protocol):
    """What a connection does with the frames; one method per frame type."""

    def on_data(self, flags: int, sid: int, payload: memoryview) -> None: ...
    def on_header_block(self, sid: int, flags: int, block: memoryview) -> None: ...
    def on_settings(self, flags: int, sid: int, payload: memoryview) -> None: ...
    def on_window_update(self, flags: int, sid: int, payload: memoryview) -> None: ...
    def on_ping(self, flags: int, sid: int, payload: memoryview) -> None: ...
    def on_rst_stream(self, flags: int, sid: int, payload: memoryview) -> None: ...
    def on_goaway(self, flags: int, sid: int, payload: memoryview) -> None: ...
    def on_other(self, kind: int, sid: int, payload: memoryview) -> None: ...
    def spend(self, cost: float = 1.0) -> None: ...


def _ignore(*args: object) -> None:
    """What a stopped reader does with a frame."""


class FrameReader:
    """Frames out of a connection's bytes, each handed to the handler its type names
    (``table``). HEADERS and CONTINUATION are gathered here into whole header blocks
    (``FrameTarget.on_header_block``); a frame of another type, or on another stream, while
    a block is being continued is a protocol error. ``stop`` ends the reading of what is
    buffered (the connection closed)."""

    __slots__ = (
        "buf",
        "preface_ok",
        "table",
        "other",
        "header_block",
        "spend",
        "continued",
        "stopped",
    )

    def __init__(self, target: FrameTarget) -> None:
        self.buf = bytearray()
        self.preface_ok = False
        self.other = target.on_other
        self.header_block = target.on_header_block
        self.spend = target.spend
        self.table: dict[int, FrameHandler] = {
            DATA: target.on_data,
            HEADERS: self._headers,
            CONTINUATION: self._continuation,
            SETTINGS: target.on_settings,
            WINDOW_UPDATE: target.on_window_update,
            PING: target.on_ping,
            RST_STREAM: target.on_rst_stream,
            GOAWAY: target.on_goaway,
            PUSH_PROMISE: self._push_promise,
        }
        # A header block being continued: (stream id, flags of its HEADERS, the block so far).
        self.continued: tuple[int, int, bytearray] | None = None
        self.stopped = False

    def feed(self, data: bytes) -> None:
        """Read ``data``: dispatch every whole frame, keep the rest for the next read."""
        buf = self.buf
        buf += data
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
        table = self.table
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
                sid &= 0x7FFFFFFF
                try:
                    continued = self.continued
                    if continued is not None and (kind != CONTINUATION or sid != continued[0]):
                        raise ConnectionError_(PROTOCOL_ERROR, "expected CONTINUATION")
                    handler = table.get(kind)
                    if handler is None:  # PRIORITY, and frame types to ignore
                        self.other(kind, sid, payload)
                    else:
                        handler(flags, sid, payload)
                finally:
                    payload.release()
                if self.stopped:
                    return
        finally:
            view.release()
        del buf[:pos]

    def stop(self) -> None:
        """Read no more; drop the handlers (the connection's methods: no cycle is left)."""
        self.stopped = True
        self.table = {}
        self.other = self.header_block = self.spend = _ignore  # type: ignore[assignment]

    def _headers(self, flags: int, sid: int, payload: memoryview) -> None:
        if not sid or not sid & 1:
            raise ConnectionError_(PROTOCOL_ERROR, "HEADERS on an invalid stream id")
        block = unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            block = block[5:]
        if flags & END_HEADERS:
            self.header_block(sid, flags, block)
        else:
            self.continued = (sid, flags, bytearray(block))

    def _continuation(self, flags: int, sid: int, payload: memoryview) -> None:
        self.spend()  # (an empty one would otherwise never reach MAX_HEADER_BYTES)
        if self.continued is None:
            raise ConnectionError_(PROTOCOL_ERROR, "CONTINUATION without HEADERS")
        _, first_flags, block = self.continued
        block += payload
        if len(block) > MAX_HEADER_BYTES:
            raise ConnectionError_(ENHANCE_YOUR_CALM, "header block too large")
        if flags & END_HEADERS:
            self.continued = None
            self.header_block(sid, first_flags, memoryview(block))

    @staticmethod
    def _push_promise(flags: int, sid: int, payload: memoryview) -> None:
        raise ConnectionError_(PROTOCOL_ERROR, "a client may not push")
