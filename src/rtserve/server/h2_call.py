"""A gRPC call on an HTTP/2 stream, without the connection: the request's headers read,
the answer's header blocks written (HPACK literals, no encoder state), the handler's
context (``Call``), compressed messages, and one stream's state (``Stream``).
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import zlib
from collections import deque
from collections.abc import Iterable
from typing import Any, NoReturn
from urllib.parse import quote

import grpc
from hpack.hpack import encode_integer

from rtserve.api.grpc_service import Method

GRPC_PREFIX = struct.Struct(">BL")  # a message's prefix: compressed flag, length
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_NOT_METADATA = frozenset(
    {b"te", b"content-type", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding"}
)
# Request messages may be compressed (answers never are, as gRPC allows): zlib wbits.
ENCODINGS = {b"identity": 0, b"gzip": 16 + zlib.MAX_WBITS, b"deflate": zlib.MAX_WBITS}
_ACCEPTED = b"identity,deflate,gzip"
_MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")


def _literal(name: bytes, value: bytes) -> bytes:
    """One header as an HPACK literal, never indexed, with a literal name: no encoder state."""
    return b"".join(
        (b"\x10", encode_integer(len(name), 7), name, encode_integer(len(value), 7), value)
    )


def header_block(headers: list[tuple[bytes, bytes]]) -> bytes:
    return b"".join(_literal(k, v) for k, v in headers)


TABLE_SIZE_ZERO = b"\x20"  # dynamic table size update to 0: this encoder never indexes
RESPONSE_HEAD = b"\x88" + header_block(
    [(b"content-type", b"application/grpc"), (b"grpc-accept-encoding", _ACCEPTED)]
)
OK = _literal(b"grpc-status", b"0")


def status_block(code: int, details: str, metadata: list[tuple[bytes, bytes]]) -> bytes:
    headers = [(b"grpc-status", str(code).encode())]
    if details:
        headers.append((b"grpc-message", quote(details[:4096], safe=_MESSAGE_SAFE).encode()))
    return header_block(headers + metadata)


def metadata_bytes(metadata: Any) -> list[tuple[bytes, bytes]]:
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


class CallHeaders:
    """What a call's request headers say (pseudo-headers, gRPC's own, and the metadata)."""

    __slots__ = ("path", "post", "content_type", "timeout", "encoding", "metadata")

    def __init__(self, headers: Iterable[Any]) -> None:
        """``headers``: the decoded block's (name, value) pairs, as bytes."""
        self.path: bytes = b""
        self.post = False  # :method is POST
        self.content_type: bytes | None = None
        self.timeout: bytes | None = None
        self.encoding: bytes | None = None
        self.metadata: list[tuple[str, str | bytes]] = []
        for name, value in headers:
            if name[:1] == b":":
                if name == b":path":
                    self.path = value
                elif name == b":method":
                    self.post = value == b"POST"
            elif name == b"content-type":
                self.content_type = value
            elif name == b"grpc-timeout":
                self.timeout = value
            elif name == b"grpc-encoding":
                self.encoding = value
            elif name not in _NOT_METADATA:
                if name.endswith(b"-bin"):
                    self.metadata.append((name.decode("latin-1"), _unbase64(value)))
                else:
                    self.metadata.append((name.decode("latin-1"), value.decode("latin-1")))

    @property
    def is_grpc(self) -> bool:
        ctype = self.content_type
        return self.post and ctype is not None and ctype.startswith(b"application/grpc")


def _unbase64(value: bytes) -> bytes:
    try:
        return base64.b64decode(value + b"=" * (-len(value) % 4))
    except ValueError:
        return value


def parse_timeout(value: bytes) -> float | None:
    """grpc-timeout (``1234S``: at most 8 digits and a unit) in seconds, None if malformed."""
    digits, unit = value[:-1], value[-1:]
    if not 1 <= len(digits) <= 8 or not digits.isdigit() or unit not in _TIMEOUT_UNITS:
        return None
    return int(digits) * _TIMEOUT_UNITS[unit]


class Abort(Exception):
    """Ends a call with a status (raised by ``Call.abort`` and by failed decompression)."""

    def __init__(self, code: grpc.StatusCode, details: str, metadata: Any = None) -> None:
        self.code, self.details, self.metadata = code, details, metadata


class Compressed(bytes):
    """A request message as it came, compressed with the call's grpc-encoding."""


def inflate(data: bytes, wbits: int, limit: int) -> bytes:
    """``data`` decompressed, at most ``limit`` bytes; raises ``Abort`` as grpcio fails
    the call (RESOURCE_EXHAUSTED if larger, INTERNAL if not valid)."""
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(data, limit + 1)
    except zlib.error:
        raise Abort(grpc.StatusCode.INTERNAL, "could not decompress the message") from None
    if len(out) > limit:
        details = f"Received message larger than max (over {limit} bytes decompressed)"
        raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, details)
    if not d.eof:
        raise Abort(grpc.StatusCode.INTERNAL, "could not decompress the message")
    return out


async def message(data: bytes, wbits: int, limit: int) -> bytes:
    """A request message as the handler parses it: a compressed one inflated on a thread
    (a bomb takes time), within the message limit."""
    if isinstance(data, Compressed):
        return await asyncio.to_thread(inflate, data, wbits, limit)
    return data


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
        raise Abort(code, details, trailing_metadata)


class Stream:
    """One HTTP/2 stream carrying one call: its request as received, its answer waiting for
    window, its windows and its place in the connection's queues."""

    __slots__ = (
        "id", "method", "call", "task", "buf", "message", "queue", "held", "waiter",
        "recv_window", "send_window", "remote_closed", "local_closed", "pending",
        "pending_bytes", "drained", "timer", "encoding", "buffered", "unreleased", "since",
        "queued", "waits",
    )  # fmt: skip

    def __init__(self, stream_id: int, recv_window: int, send_window: int) -> None:
        self.id = stream_id
        self.method: Method | None = None
        self.call: Call | None = None
        self.task: asyncio.Task[None] | None = None
        self.buf = bytearray()
        self.message: bytes | None = None  # a unary call's request
        self.queue: deque[bytes] = deque()  # a streaming call's requests not yet taken
        self.held = 0  # bytes in queue
        self.waiter: asyncio.Future[None] | None = None
        self.recv_window = recv_window
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

    @property
    def open(self) -> bool:
        return not (self.remote_closed or self.local_closed)

    def wake(self) -> None:
        """A streaming handler waiting for its next request looks again."""
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
