"""The pieces of the HTTP/1.1 transport, each without a socket: the request reader (real
httptools parsing, with the client's limits), the limits' refusals, flow control and the
chunks of a streamed answer. (tests/test_http_*.py and tests/test_hostile_http.py drive
the whole server.)"""

from __future__ import annotations

import asyncio
from typing import Any

import httptools
import pytest

from rtserve.errors import (
    ConfigError,
    HeaderTooLarge,
    InvalidInput,
    NotSupported,
    PayloadTooLarge,
    RTServeError,
    UriTooLong,
)
from rtserve.server.h1_flow import FlowControl
from rtserve.server.h1_limits import CHUNK_COST, HttpLimits, body_too_large, declared_too_large
from rtserve.server.h1_parse import BODY, HEAD, IDLE, READ_FIRST, Request, RequestReader
from rtserve.server.h1_stream import chunk


class Server:
    def __init__(self, limits: HttpLimits, max_body: int, head: Any = None) -> None:
        self.limits = limits
        self.max_body = max_body
        self.head = head
        self.draining = False


class Conn:
    """What a RequestReader reaches of its connection: where requests go, and flags."""

    def __init__(self, limits: HttpLimits | None = None, max_body: int = 1 << 20, head: Any = None):
        self.server = Server(limits or HttpLimits(), max_body, head)
        self.rejected = False
        self.requests: list[Request] = []
        self.continues = 0

    def received(self, request: Request) -> None:
        self.requests.append(request)

    def continue_(self) -> None:
        self.continues += 1


def _read(wire: bytes, conn: Conn | None = None) -> tuple[Conn, RequestReader]:
    conn = conn or Conn()
    reader = RequestReader(conn)  # type: ignore[arg-type]
    reader.parser.feed_data(wire)
    return conn, reader


def _refusal(wire: bytes, conn: Conn | None = None) -> BaseException | None:
    with pytest.raises(httptools.HttpParserCallbackError) as exc:
        _read(wire, conn)
    return exc.value.__context__


# ---------------------------------------------------------------------- the request reader
def test_pipelined_requests_are_read_with_canonical_paths_and_bodies() -> None:
    conn, reader = _read(
        b"POST /v2/models/%62//infer?x=1 HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\nabc"
        b"GET /v2/health/ready HTTP/1.1\r\nConnection: close\r\n\r\n"
    )
    first, second = conn.requests
    assert (first.method, first.path, first.query, first.body) == (
        b"POST", "/v2/models/b/infer", "x=1", b"abc"
    )  # fmt: skip
    assert first.headers == {b"host": b"h", b"content-length": b"3"}
    assert first.keep_alive and not first.http10 and not first.checked
    assert (second.method, second.path, second.keep_alive) == (b"GET", "/v2/health/ready", False)
    assert reader.state == IDLE and reader.gen == 2


def test_a_body_arriving_in_pieces_is_gathered_in_one_buffer() -> None:
    conn, reader = _read(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert reader.state == BODY
    for piece in (b"a", b"bc", b"def"):
        reader.parser.feed_data(b"%x\r\n%s\r\n" % (len(piece), piece))
    reader.parser.feed_data(b"0\r\n\r\n")
    (request,) = conn.requests
    assert request.body == b"abcdef" and type(request.body) is bytes


def test_a_head_in_pieces_is_still_a_head() -> None:
    conn, reader = _read(b"GET /a HTTP/1.1\r\nHo")
    assert reader.state == HEAD and not conn.requests
    reader.parser.feed_data(b"st: h\r\n\r\n")
    assert conn.requests[0].headers == {b"host": b"h"}


def test_only_an_http10_client_that_asked_for_keep_alive_is_told_it_got_it() -> None:
    conn, _ = _read(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET / HTTP/1.0\r\n\r\n")
    asked, plain = conn.requests
    assert asked.keep_alive and asked.http10
    assert not plain.keep_alive and not plain.http10


def test_a_draining_server_ends_keep_alive() -> None:
    conn = Conn()
    conn.server.draining = True
    conn, _ = _read(b"GET / HTTP/1.1\r\n\r\n", conn)
    assert not conn.requests[0].keep_alive


@pytest.mark.parametrize(
    ("wire", "error", "named"),
    [
        (b"GET /" + b"a" * 200 + b" HTTP/1.1\r\n\r\n", UriTooLong, "http_max_url_bytes"),
        (b"GET / HTTP/1.1\r\nx: " + b"v" * 200 + b"\r\n\r\n", HeaderTooLarge, "per header"),
        (b"GET / HTTP/1.1\r\n" + b"a: b\r\n" * 5 + b"\r\n", HeaderTooLarge, "http_max_headers"),
        (
            b"GET / HTTP/1.1\r\n" + b"h: " + b"v" * 90 + b"\r\n" + b"i: " + b"v" * 90 + b"\r\n\r\n",
            HeaderTooLarge,
            "http_max_head_bytes",
        ),
        (b"POST / HTTP/1.1\r\nContent-Length: 2000\r\n\r\n", PayloadTooLarge, "max_request_bytes"),
    ],
)
def test_each_limit_refuses_naming_itself(wire: bytes, error: type, named: str) -> None:
    limits = HttpLimits(max_url_bytes=100, max_header_bytes=100, max_headers=4, max_head_bytes=150)
    exc = _refusal(wire, Conn(limits, max_body=1000))
    assert isinstance(exc, error) and named in str(exc)


def test_a_chunked_body_pays_for_each_chunk() -> None:
    conn = Conn(max_body=3 * CHUNK_COST)
    wire = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1\r\na\r\n" * 3
    exc = _refusal(wire, conn)
    assert isinstance(exc, PayloadTooLarge)
    assert f"each chunk counts {CHUNK_COST} bytes more" in str(exc)


def test_a_second_credential_header_is_refused() -> None:
    exc = _refusal(b"GET / HTTP/1.1\r\nAuthorization: a\r\nauthorization: b\r\n\r\n")
    assert isinstance(exc, InvalidInput) and "authorization: expected one" in str(exc)


def test_connect_and_websocket_are_refused_other_upgrades_end_the_connection() -> None:
    assert isinstance(_refusal(b"CONNECT h:443 HTTP/1.1\r\n\r\n"), NotSupported)
    exc = _refusal(b"GET / HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
    assert isinstance(exc, NotSupported) and "websocket" in str(exc)
    conn = Conn()
    with pytest.raises(httptools.HttpParserUpgrade):
        _read(b"GET / HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n", conn)
    assert conn.rejected and not conn.requests[0].keep_alive


def test_a_large_or_chunked_body_is_checked_from_its_head() -> None:
    seen: list[tuple[bytes, str]] = []

    def head(conn: Any, method: bytes, path: str, headers: dict[bytes, bytes]) -> int | None:
        seen.append((method, path))
        return 10  # this route takes at most 10 bytes

    small = b"POST /small HTTP/1.1\r\nContent-Length: 4\r\n\r\nabcd"
    conn, _ = _read(small, Conn(head=head))
    assert not seen and not conn.requests[0].checked  # read first, checked by the route
    length = READ_FIRST + 1
    big = b"POST /big HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % length
    exc = _refusal(big, Conn(max_body=1 << 20, head=head))
    assert seen == [(b"POST", "/big")]
    assert isinstance(exc, PayloadTooLarge) and "limit of 10 bytes for /big" in str(exc)
    chunked = b"POST /c HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nb\r\n" + b"x" * 11
    exc = _refusal(chunked, Conn(head=head))
    assert isinstance(exc, PayloadTooLarge) and "(/c; each chunk" in str(exc)


def test_a_refusal_from_the_head_check_stops_the_body() -> None:
    def head(conn: Any, method: bytes, path: str, headers: dict[bytes, bytes]) -> int | None:
        raise InvalidInput("no such model")

    wire = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    exc = _refusal(wire, Conn(head=head))
    assert isinstance(exc, InvalidInput)


def test_expect_continue_asks_the_connection() -> None:
    conn, _ = _read(b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n")
    assert conn.continues == 1 and not conn.requests


def test_clear_drops_what_the_request_holds() -> None:
    _, reader = _read(b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")
    reader.clear()
    assert reader.state == IDLE
    assert reader._body == b"" and reader._headers == {}


# ---------------------------------------------------------------------- limits
def test_limits_must_be_positive_numbers_named_by_their_field() -> None:
    with pytest.raises(ConfigError, match="http_max_headers: expected a number > 0"):
        HttpLimits(max_headers=0)
    with pytest.raises(ConfigError, match="http_idle_timeout_s"):
        HttpLimits(idle_timeout_s=True)  # type: ignore[arg-type]

    class Config:
        http_max_headers = 7
        http_idle_timeout_s = None

    limits = HttpLimits.from_config(Config())
    assert limits.max_headers == 7 and limits.idle_timeout_s == HttpLimits().idle_timeout_s


def test_refusals_name_the_limit_and_its_value() -> None:
    limits = HttpLimits(header_timeout_s=2.5, body_timeout_s=3)
    assert "2.5 s (http_header_timeout_s)" in str(limits.head_timeout())
    assert "3 s (http_body_timeout_s)" in str(limits.body_timeout())
    assert "(max_request_bytes)" in str(declared_too_large(5, 4))
    assert str(body_too_large(4, "max_request_bytes", False)).endswith("(max_request_bytes)")
    for exc in (limits.head_timeout(), limits.url_too_long(), declared_too_large(5, 4)):
        assert isinstance(exc, RTServeError)


# ---------------------------------------------------------------------- flow control
class Transport:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def pause_reading(self) -> None:
        self.calls.append("pause")

    def resume_reading(self) -> None:
        self.calls.append("resume")


def test_reading_is_paused_and_resumed_once_each() -> None:
    transport = Transport()
    flow = FlowControl(transport)  # type: ignore[arg-type]
    flow.resume_reading()  # not paused: nothing to do
    flow.pause_reading()
    flow.pause_reading()
    assert flow.read_paused
    flow.resume_reading()
    flow.resume_reading()
    assert transport.calls == ["pause", "resume"] and not flow.read_paused
    flow.transport = None  # lost: nothing more is asked of it
    flow.pause_reading()
    assert transport.calls == ["pause", "resume"]


def test_a_stream_waits_until_the_peer_reads() -> None:
    async def run() -> list[str]:
        flow = FlowControl()
        events: list[str] = []
        await flow.drain()  # writable: returns at once
        events.append("writable")
        flow.pause_writing(12.0)
        assert flow.write_paused_at == 12.0

        async def writer() -> None:
            await flow.drain()
            events.append("drained")

        task = asyncio.ensure_future(writer())
        await asyncio.sleep(0)
        assert events == ["writable"]  # still waiting
        flow.resume_writing()
        await task
        return events

    assert asyncio.run(run()) == ["writable", "drained"]


def test_a_streamed_piece_is_one_chunk() -> None:
    assert chunk(b"hello") == b"5\r\nhello\r\n"
    assert chunk(b"x" * 26) == b"1a\r\n" + b"x" * 26 + b"\r\n"
