"""Streamed answers on the HTTP/1.1 transport (``Connection.respond_stream``): chunked
framing, pipelining behind a stream, backpressure from a slow reader, and a client that
goes away mid-stream (the body's iterator is closed). A real ``HttpServer`` on 127.0.0.1
and raw sockets as the client, on uvloop as the server runs."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvloop

from rtserve.server.http1 import Connection, HttpServer, Request


class Body:
    """A streamed body that records how far it got and whether it was closed."""

    def __init__(self, pieces: int, size: int = 8, delay: float = 0.0, fail_at: int = -1) -> None:
        self.pieces, self.size, self.delay, self.fail_at = pieces, size, delay, fail_at
        self.sent = 0
        self.closed = asyncio.Event()
        self.finished = False

    async def run(self) -> AsyncIterator[bytes]:
        try:
            for i in range(self.pieces):
                if i == self.fail_at:
                    raise RuntimeError("the producer failed")
                if self.delay:
                    await asyncio.sleep(self.delay)
                self.sent += 1
                yield b"%07d\n" % i if self.size == 8 else bytes(self.size)
            self.finished = True
        finally:
            self.closed.set()


class App:
    def __init__(self) -> None:
        self.bodies: list[Body] = []
        self.next_body: dict[str, Any] = {}

    def handle(self, conn: Connection, request: Request) -> None:
        if request.path == "/stream":
            body = Body(**self.next_body)
            self.bodies.append(body)
            conn.respond_stream(200, [(b"content-type", b"text/event-stream")], body.run())
        else:
            conn.respond(200, b"plain", [(b"content-type", b"text/plain")])


async def _server(app: App) -> tuple[HttpServer, int]:
    server = HttpServer(app.handle, 1 << 20)
    port = await server.start("127.0.0.1", 0)
    return server, port


async def _read_until(reader: asyncio.StreamReader, marker: bytes, limit_s: float = 5.0) -> bytes:
    return await asyncio.wait_for(reader.readuntil(marker), limit_s)


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    while True:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert data == b"\r\n", data
            return bytes(out)
        out += data[:size]
        assert data[size : size + 2] == b"\r\n"
        data = data[size + 2 :]


def test_stream_is_chunked_and_pipelined_request_follows() -> None:
    async def main() -> None:
        app = App()
        app.next_body = {"pieces": 5, "delay": 0.01}
        server, port = await _server(app)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
                b"GET /plain HTTP/1.1\r\nHost: x\r\n\r\n"
            )
            head = await _read_until(reader, b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 OK\r\n")
            assert b"transfer-encoding: chunked" in head
            assert b"content-type: text/event-stream" in head
            assert b"content-length" not in head
            body = await _read_until(reader, b"\r\n0\r\n\r\n")
            assert _dechunk(body) == b"".join(b"%07d\n" % i for i in range(5))
            # The pipelined request was answered after the stream, on the same connection.
            head2 = await _read_until(reader, b"\r\n\r\n")
            assert head2.startswith(b"HTTP/1.1 200 OK") and b"content-length: 5" in head2
            assert await asyncio.wait_for(reader.readexactly(5), 5) == b"plain"
            assert app.bodies[0].finished
            writer.close()
        finally:
            await server.close()

    uvloop.run(main())


def test_http10_stream_is_delimited_by_close() -> None:
    async def main() -> None:
        app = App()
        app.next_body = {"pieces": 3}
        server, port = await _server(app)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /stream HTTP/1.0\r\nContent-Length: 0\r\n\r\n")
            data = await asyncio.wait_for(reader.read(), 5)  # until the server closes
            head, _, body = data.partition(b"\r\n\r\n")
            assert b"connection: close" in head and b"chunked" not in head
            assert body == b"0000000\n0000001\n0000002\n"
            writer.close()
        finally:
            await server.close()

    uvloop.run(main())


def test_client_gone_mid_stream_closes_the_body() -> None:
    async def main() -> None:
        app = App()
        app.next_body = {"pieces": 10_000, "delay": 0.005}
        server, port = await _server(app)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /stream HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
            await _read_until(reader, b"\r\n\r\n")
            await _read_until(reader, b"0000003\n")
            writer.close()
            body = app.bodies[0]
            await asyncio.wait_for(body.closed.wait(), 5)
            assert not body.finished and body.sent < 1000
            sent = body.sent
            await asyncio.sleep(0.1)
            assert body.sent == sent  # nothing produced after the close
            assert server.busy_connections == 0 and not server.connections
        finally:
            await server.close()

    uvloop.run(main())


def test_slow_reader_holds_the_producer() -> None:
    """A client that does not read: the body is not consumed past the transport's buffer
    (plus the socket's), so an unread stream costs bounded memory."""

    async def main() -> None:
        app = App()
        app.next_body = {"pieces": 100_000, "size": 64 * 1024}
        server, port = await _server(app)
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        try:
            sock.sendall(b"POST /stream HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
            await asyncio.sleep(0.5)
            body = app.bodies[0]
            held = body.sent
            assert 0 < held < 200, held  # ~12 MiB at most; unbounded would be 6 GiB
            await asyncio.sleep(0.3)
            assert body.sent == held  # paused: not advancing while nobody reads
            sock.setblocking(False)
            drained = 0
            for _ in range(200):  # reading resumes the producer
                with contextlib.suppress(BlockingIOError):
                    while chunk := sock.recv(1 << 20):
                        drained += len(chunk)
                await asyncio.sleep(0.01)
                if body.sent > held + 10:
                    break
            assert body.sent > held + 10, (held, body.sent, drained)
        finally:
            sock.close()
            await server.close()

    uvloop.run(main())


@pytest.mark.parametrize("fail_at", [0, 2])
def test_failing_body_cuts_the_connection(fail_at: int) -> None:
    """A body that fails after its head went out: the connection is reset, never ended
    with the final chunk (the client must not take a cut body for a whole one)."""

    async def main() -> None:
        app = App()
        app.next_body = {"pieces": 5, "fail_at": fail_at}
        server, port = await _server(app)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /stream HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
            try:
                data = await asyncio.wait_for(reader.read(), 5)
            except ConnectionResetError:
                data = b""
            assert b"\r\n0\r\n\r\n" not in data
            assert app.bodies[0].closed.is_set()
            writer.close()
        finally:
            await server.close()

    uvloop.run(main())


def test_drain_lets_a_stream_finish_then_closes() -> None:
    async def main() -> None:
        app = App()
        app.next_body = {"pieces": 20, "delay": 0.01}
        server, port = await _server(app)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /stream HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
            await _read_until(reader, b"0000001\n")
            server.begin_drain()
            rest = await asyncio.wait_for(reader.read(), 5)  # until the server closes
            assert rest.endswith(b"0000019\n\r\n0\r\n\r\n")
            assert app.bodies[0].finished
            writer.close()
        finally:
            await server.close()

    uvloop.run(main())
