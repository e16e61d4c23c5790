"""The HTTP/1.1 layer with raw sockets: keep-alive, pipelining, chunked bodies,
Expect: 100-continue, HTTP/1.0, HEAD and malformed requests."""

from __future__ import annotations

import json
import socket

from tests import rawhttp
from tests.conftest import RunningServer

BODY = json.dumps(
    {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
).encode()


def _connect(server: RunningServer) -> socket.socket:
    return rawhttp.connect(server.http_port)


_read_response = rawhttp.read_response


def _post(body: bytes = BODY, extra: str = "", version: str = "1.1") -> bytes:
    return (
        f"POST /v2/models/scale/infer HTTP/{version}\r\nHost: x\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


def test_keep_alive_serves_many_requests_on_one_connection(server: RunningServer) -> None:
    with _connect(server) as sock:
        buf = bytearray()
        for _ in range(20):
            sock.sendall(_post())
            status, headers, body = _read_response(sock, buf)
            assert status == 200
            assert json.loads(body)["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]
            assert "connection" not in headers


def test_pipelined_requests_are_answered_in_order(server: RunningServer) -> None:
    bodies = [
        json.dumps(
            {
                "id": str(i),
                "inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [i] * 4}],
            }
        ).encode()
        for i in range(10)
    ]
    with _connect(server) as sock:
        sock.sendall(
            b"".join(_post(b) for b in bodies) + b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        buf = bytearray()
        ids = [json.loads(_read_response(sock, buf)[2])["id"] for _ in range(10)]
        assert ids == [str(i) for i in range(10)]
        status, _, body = _read_response(sock, buf)
        assert status == 200 and json.loads(body) == {"live": True}


def test_chunked_request_body(server: RunningServer) -> None:
    half = len(BODY) // 2
    chunked = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (
        half,
        BODY[:half],
        len(BODY) - half,
        BODY[half:],
    )
    request = (
        b"POST /v2/models/scale/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + chunked
    )
    with _connect(server) as sock:
        sock.sendall(request)
        status, _, body = _read_response(sock, bytearray())
    assert status == 200 and json.loads(body)["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]


def test_expect_100_continue(server: RunningServer) -> None:
    head = _post(extra="Expect: 100-continue\r\n")[: -len(BODY)]
    with _connect(server) as sock:
        sock.sendall(head)
        interim = sock.recv(100)
        assert interim.startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(BODY)
        status, _, _ = _read_response(sock, bytearray())
    assert status == 200


def test_http10_closes_unless_keep_alive(server: RunningServer) -> None:
    with _connect(server) as sock:
        sock.sendall(_post(version="1.0"))
        status, headers, _ = _read_response(sock, bytearray())
        assert status == 200 and headers["connection"] == "close"
        assert sock.recv(10) == b""
    with _connect(server) as sock:
        sock.sendall(_post(version="1.0", extra="Connection: keep-alive\r\n"))
        status, headers, _ = _read_response(sock, bytearray())
        assert status == 200 and headers["connection"] == "keep-alive"


def test_connection_close_is_honoured(server: RunningServer) -> None:
    with _connect(server) as sock:
        sock.sendall(_post(extra="Connection: close\r\n"))
        status, headers, _ = _read_response(sock, bytearray())
        assert status == 200 and headers["connection"] == "close"
        assert sock.recv(10) == b""


def test_malformed_request_is_400_and_server_keeps_serving(server: RunningServer) -> None:
    with _connect(server) as sock:
        sock.sendall(b"THIS IS NOT HTTP\r\n\r\n")
        status, _, body = _read_response(sock, bytearray())
    assert status == 400 and b"malformed HTTP request" in body
    with _connect(server) as sock:
        sock.sendall(_post())
        assert _read_response(sock, bytearray())[0] == 200


def test_declared_body_over_limit_is_refused_before_upload(server: RunningServer) -> None:
    head = b"POST /v2/models/scale/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 50000000\r\n\r\n"
    with _connect(server) as sock:
        sock.sendall(head)
        status, headers, body = _read_response(sock, bytearray())
    assert status == 413 and headers["connection"] == "close"
    assert b"exceeds the limit of 1000000 bytes" in body


def test_head_and_unknown_routes(server: RunningServer) -> None:
    with _connect(server) as sock:
        buf = bytearray()
        sock.sendall(b"HEAD /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = _read_response(sock, buf)
        assert status == 200 and body == b""
        sock.sendall(b"GET /v3/nothing HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = _read_response(sock, buf)
        assert status == 404 and b"no route" in body
        sock.sendall(b"DELETE /v2/models/scale HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_response(sock, buf)[0] == 404
