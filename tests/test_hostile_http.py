"""Hostile HTTP/1.1 clients against a real server, with raw sockets: each is answered (or cut
off) as configured, a valid inference is still served meanwhile, and memory comes back.

The server runs with small limits and timeouts so that the slow clients take about a second.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import rawhttp
from tests.conftest import RELAXED, RunningServer, rss_mb, start_server

BODY = json.dumps(
    {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
).encode()
MAX_BODY = 16_000_000
TIMEOUT_S = 1.0  # header and body timeouts of the test server
IDLE_S = 2.0
MAX_CONNECTIONS = 64
LIMITS = (
    "--max-request-bytes", str(MAX_BODY),
    "--http-max-url-bytes", "4096",
    "--http-max-headers", "40",
    "--http-max-header-bytes", "8192",
    "--http-max-head-bytes", "32768",
    "--http-header-timeout-s", str(TIMEOUT_S),
    "--http-body-timeout-s", str(TIMEOUT_S),
    "--http-idle-timeout-s", str(IDLE_S),
    "--http-max-connections", str(MAX_CONNECTIONS),
)  # fmt: skip


# ---------------------------------------------------------------------------- raw HTTP helpers
connect = rawhttp.connect
read_response = rawhttp.read_response
read_all = rawhttp.read_all


def statuses(data: bytes) -> list[int]:
    return [int(m) for m in re.findall(rb"HTTP/1\.1 (\d{3}) ", data)]


def post(body: bytes = BODY, extra: str = "", path: str = "/v2/models/scale/infer") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


def infer_once(port: int, timeout: float = 10.0) -> float:
    """A valid inference on a fresh connection; its latency in seconds."""
    start = time.monotonic()
    with connect(port, timeout) as sock:
        sock.sendall(post())
        status, _, body = read_response(sock, bytearray())
    assert status == 200, body
    assert json.loads(body)["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]
    return time.monotonic() - start


def assert_still_serves(port: int, bound_s: float = 2.0) -> None:
    latency = infer_once(port)
    assert latency < bound_s, f"a valid inference took {latency:.2f} s"


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def settle_rss(pid: int, target_mb: float, wait_s: float = 5.0) -> float:
    """RSS once it is at or below ``target_mb`` (or after ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    rss = rss_mb(pid)
    while rss > target_mb and time.monotonic() < deadline:
        time.sleep(0.1)
        rss = rss_mb(pid)
    return rss


def send_ignoring_reset(sock: socket.socket, data: bytes) -> bool:
    try:
        sock.sendall(data)
        return True
    except (BrokenPipeError, ConnectionResetError):
        return False


# ---------------------------------------------------------------------------- fixtures
class Hostile:
    def __init__(self, server: RunningServer) -> None:
        self.server = server
        self.port = server.http_port
        self.pid = server.proc.pid
        self.baseline_mb = 0.0


@pytest.fixture(scope="module")
def hostile(test_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hostile]:
    server = start_server(test_repo, tmp_path_factory.mktemp("hostile"), *LIMITS, *RELAXED)
    h = Hostile(server)
    for _ in range(50):  # warm: allocator pools, first-request paths
        infer_once(h.port)
    h.baseline_mb = rss_mb(h.pid)
    yield h
    server.stop()


# ---------------------------------------------------------------------------- item: memory
def test_bodies_are_freed_when_requests_and_connections_end(hostile: Hostile) -> None:
    """Per-connection buffers are freed by reference counting (the server makes cyclic GC
    rare): finished uploads on open and closed connections, and unfinished ones cut off."""
    before = rss_mb(hostile.pid)
    junk = b"x" * 4_000_000
    kept = []
    for _ in range(10):  # answered (400: not JSON), the connection stays open and idle
        sock = connect(hostile.port)
        sock.sendall(post(junk))
        assert read_response(sock, bytearray())[0] == 400
        kept.append(sock)
    for _ in range(10):  # answered, then the client goes away
        with connect(hostile.port) as sock:
            sock.sendall(post(junk))
            assert read_response(sock, bytearray())[0] == 400
    for _ in range(3):  # unfinished uploads: half of the declared body, then a disconnect
        partial = [connect(hostile.port) for _ in range(10)]
        for sock in partial:
            sock.sendall(post(b"y" * 8_000_000)[:4_000_000])
        assert_still_serves(hostile.port)
        time.sleep(0.2)
        for sock in partial:
            sock.close()
    # 160 MB passed through; what stays must be far less (the open connections included).
    rss = settle_rss(hostile.pid, before + 40)
    assert rss - before < 40, f"RSS grew {rss - before:.0f} MB after 160 MB of bodies"
    assert_still_serves(hostile.port)
    for sock in kept:
        sock.close()


# ---------------------------------------------------------------------------- item: limits
def test_long_url_is_414_naming_the_limit(hostile: Hostile) -> None:
    with connect(hostile.port) as sock:
        sock.sendall(b"GET /v2/" + b"a" * 4000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock, bytearray())[0] == 404  # within the limit: routed
    with connect(hostile.port) as sock:
        sock.sendall(b"GET /v2/" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = read_response(sock, bytearray())
    assert status == 414 and headers["connection"] == "close"
    assert json.loads(body)["error"] == (
        "the request URL exceeds the limit of 4096 bytes (http_max_url_bytes)"
    )


@pytest.mark.parametrize(
    ("headers", "named"),
    [
        ([f"X-H{i}: v" for i in range(41)], "more than 40 request headers (http_max_headers)"),
        (["X-Big: " + "v" * 9000], "(http_max_header_bytes)"),
        ([f"X-H{i}: " + "v" * 4000 for i in range(9)], "32768 bytes in all (http_max_head_bytes)"),
    ],
    ids=["count", "one-header", "all-headers"],
)
def test_header_limits_are_431_naming_the_limit(
    hostile: Hostile, headers: list[str], named: str
) -> None:
    request = "GET /v2/health/live HTTP/1.1\r\nHost: x\r\n" + "".join(h + "\r\n" for h in headers)
    with connect(hostile.port) as sock:
        sock.sendall(request.encode() + b"\r\n")
        status, answer_headers, body = read_response(sock, bytearray())
        assert read_all(sock) == b""  # closed after the one answer
    assert status == 431 and answer_headers["connection"] == "close"
    assert named in json.loads(body)["error"]
    assert_still_serves(hostile.port)


def test_headers_just_within_the_limits_are_served(hostile: Hostile) -> None:
    headers = "".join(f"X-H{i}: {'v' * 700}\r\n" for i in range(38))  # ~27 KB, 39 headers
    with connect(hostile.port) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n" + headers.encode() + b"\r\n")
        assert read_response(sock, bytearray())[0] == 200


def test_a_header_sent_in_pieces_is_cut_off_cheaply(hostile: Hostile) -> None:
    """A header trickled in 1 KB pieces is refused once the head limit is passed, instead of
    being gathered (with a copy per piece) without bound."""
    cpu_before = cpu_s(hostile.pid)
    start = time.monotonic()
    with connect(hostile.port) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        sent = 0
        # After its answer the server drops further input for a moment, then cuts the client off.
        while time.monotonic() - start < 8 and send_ignoring_reset(sock, b"v" * 1024):
            sent += 1024
            if sent % 65536 == 0:
                time.sleep(0.01)  # separate reads on the server side
            if sent == 16384:
                assert_still_serves(hostile.port)
        cut_off_s = time.monotonic() - start
        answer = read_all(sock)
    assert statuses(answer) == [431]
    assert b"(http_max_head_bytes)" in answer or b"(http_max_header_bytes)" in answer
    assert cut_off_s < 5, "the server kept reading the endless header"
    assert cpu_s(hostile.pid) - cpu_before < 1.5
    assert_still_serves(hostile.port)


# ---------------------------------------------------------------------------- item: slow clients
def test_slow_loris_head_gets_408_and_is_closed(hostile: Hostile) -> None:
    start = time.monotonic()
    with connect(hostile.port) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Drip: ")
        answer = b""
        sock.settimeout(0.25)
        while time.monotonic() - start < 5:
            if not send_ignoring_reset(sock, b"a"):
                break
            assert_still_serves(hostile.port)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                break
            answer += chunk
        answer += read_all(sock, 3)
    elapsed = time.monotonic() - start
    assert statuses(answer) == [408]
    assert b"(http_header_timeout_s)" in answer
    assert TIMEOUT_S * 0.9 < elapsed < TIMEOUT_S + 3.5


def test_slow_body_gets_408_and_is_closed(hostile: Hostile) -> None:
    start = time.monotonic()
    with connect(hostile.port) as sock:
        sock.sendall(post(BODY)[:-20])
        assert_still_serves(hostile.port)
        answer = read_all(sock, TIMEOUT_S + 5)
    elapsed = time.monotonic() - start
    assert statuses(answer) == [408] and b"(http_body_timeout_s)" in answer
    assert elapsed < TIMEOUT_S + 3.5


def test_silent_and_idle_connections_are_closed(hostile: Hostile) -> None:
    start = time.monotonic()
    with connect(hostile.port) as silent, connect(hostile.port) as idle:
        idle.sendall(post())
        assert read_response(idle, bytearray())[0] == 200
        assert read_all(silent, 5) == b""  # nothing sent: closed after the header timeout
        silent_s = time.monotonic() - start
        assert read_all(idle, 6) == b""  # keep-alive with nothing more: the idle timeout
        idle_s = time.monotonic() - start
    assert TIMEOUT_S * 0.9 < silent_s < TIMEOUT_S + 2.5
    assert IDLE_S * 0.9 < idle_s < IDLE_S + 2.5


def test_connection_cap_refuses_with_503_and_keeps_listening(hostile: Hostile) -> None:
    limits = Path(f"/proc/{hostile.pid}/limits").read_text()
    soft, hard = re.search(r"Max open files\s+(\d+)\s+(\d+)", limits).groups()  # type: ignore[union-attr]
    assert soft == hard  # raised to the hard limit at start
    hogs = [connect(hostile.port) for _ in range(MAX_CONNECTIONS)]
    try:
        for hog in hogs:  # a request each: every hog has surely been accepted
            hog.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(hog, bytearray())[0] == 200
        for _ in range(3):
            with connect(hostile.port) as extra:
                extra.sendall(post())
                status, headers, body = read_response(extra, bytearray())
                assert read_all(extra) == b""
            assert status == 503 and headers["connection"] == "close"
            assert headers["retry-after"] == "1"
            assert "limit of 64 open HTTP connections (http_max_connections)" in body.decode()
    finally:
        for hog in hogs:
            hog.close()
    deadline = time.monotonic() + 5
    while True:  # the hogs' closes reach the server: served again
        try:
            assert_still_serves(hostile.port)
            break
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


# ---------------------------------------------------------------------------- item: pipelining
def test_many_pipelined_requests_after_an_inference_are_answered_in_order(
    hostile: Hostile,
) -> None:
    """Answers written synchronously one after another must not nest (no RecursionError)."""
    gets = [
        b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
        if i % 2
        else b"GET /v2/models/scale/ready HTTP/1.1\r\nHost: x\r\n\r\n"
        for i in range(500)
    ]
    with connect(hostile.port) as sock:
        sock.sendall(post() + b"".join(gets))
        buf = bytearray()
        status, _, body = read_response(sock, buf)
        assert status == 200 and json.loads(body)["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]
        for i in range(500):
            status, _, body = read_response(sock, buf)
            assert status == 200
            assert (b'"live":true' if i % 2 else b'"name":"scale"') in body
        sock.sendall(post())  # the connection is still usable
        assert read_response(sock, buf)[0] == 200


def test_a_large_pipelined_write_is_parsed_as_answers_drain(hostile: Hostile) -> None:
    """20,000 requests in one write (reads far larger than a slice): parsing pauses while
    answers wait and resumes as they are read; all are answered, in order."""
    count = 20_000
    gets = [
        b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
        if i % 2
        else b"GET /v2/models/scale/ready HTTP/1.1\r\nHost: x\r\n\r\n"
        for i in range(count)
    ]
    with connect(hostile.port) as sock:
        # The inference first: the requests behind it wait, so parsing must pause.
        sender = threading.Thread(target=sock.sendall, args=(post() + b"".join(gets),))
        sender.start()
        buf = bytearray()
        assert read_response(sock, buf)[0] == 200
        for i in range(count):
            status, _, body = read_response(sock, buf)
            assert status == 200
            assert (b'"live":true' if i % 2 else b'"name":"scale"') in body, i
        sender.join(10)
        sock.sendall(post())
        assert read_response(sock, buf)[0] == 200


def test_100_continue_never_overtakes_an_earlier_answer(hostile: Hostile) -> None:
    expecting = post(extra="Expect: 100-continue\r\n")
    with connect(hostile.port) as sock:
        sock.sendall(post() + expecting[: -len(BODY)])
        buf = bytearray()
        assert read_response(sock, buf)[0] == 200  # the inference's answer comes first
        sock.sendall(BODY)
        status, _, body = read_response(sock, buf)
        if status == 100:  # sent once nothing was pending any more
            status, _, body = read_response(sock, buf)
        assert status == 200 and b"outputs" in body


FLOOD = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n" * 2000


def _flood_unread(port: int, seconds: float) -> tuple[socket.socket, int, bool]:
    """Pipelined GETs whose answers are never read, sent for at least ``seconds`` and until
    the server stops taking them (sends block for 0.3 s: its answers fill every buffer, so it
    paused): (socket, bytes sent, whether the server cut the client off). On a loaded machine
    a fixed time could end before the answers outgrow the kernel's buffers, and a client
    whose answers all fit there is not one the server needs to cut off."""
    sock = connect(port)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    sent = 0
    start = time.monotonic()
    blocked_since = None
    while time.monotonic() - start < seconds + 10:
        try:
            sent += sock.send(FLOOD)
            blocked_since = None
        except BlockingIOError:
            now = time.monotonic()
            blocked_since = blocked_since or now
            if now - start >= seconds and now - blocked_since >= 0.3:
                break
            time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError):
            return sock, sent, True
    return sock, sent, False


def test_a_client_that_never_reads_is_held_back_then_cut_off(hostile: Hostile) -> None:
    """Write backpressure: reading pauses while answers wait for the peer, and a peer that
    does not read for the body timeout is disconnected."""
    before = rss_mb(hostile.pid)
    start = time.monotonic()
    sock, sent, cut = _flood_unread(hostile.port, TIMEOUT_S / 2)
    try:
        assert not cut
        assert sent < 30_000_000  # the client could send ~200,000 requests a second
        assert_still_serves(hostile.port)
        grown = rss_mb(hostile.pid) - before
        assert grown < 30, f"RSS grew {grown:.0f} MB"
        # The server answers 408, lingers (2 s) and resets the connection; on a loaded
        # machine its sweep and the linger take a few seconds more than the timeout.
        while not cut and time.monotonic() - start < TIMEOUT_S + 30:
            time.sleep(0.1)
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) in (
                errno.ECONNRESET,
                errno.EPIPE,
            ):
                cut = True  # a reset seen by the kernel while our sends were blocked
                break
            try:
                # More of the flood, not one request: on a loaded machine the flood above can
                # end while the answers still fit the kernel's buffers (the server was only
                # slow to read); a trickle would keep the connection active, never stuck.
                sock.send(FLOOD)
            except BlockingIOError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                cut = True
        assert cut, "a client that never reads was kept"
    finally:
        sock.close()
    assert_still_serves(hostile.port)


# ---------------------------------------------------------------------------- item: upgrades
@pytest.mark.parametrize(
    ("request_head", "named"),
    [
        (
            "GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
            b"Upgrade to 'websocket' is not supported",
        ),
        ("CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n", b"CONNECT"),
    ],
    ids=["websocket", "connect"],
)
def test_websocket_and_connect_get_exactly_one_answer(
    hostile: Hostile, request_head: str, named: bytes
) -> None:
    with connect(hostile.port) as sock:
        sock.sendall(request_head.encode() + b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = read_all(sock)
    assert statuses(answer) == [501] and named in answer


def test_an_ignored_upgrade_is_answered_once_then_closed(hostile: Hostile) -> None:
    with connect(hostile.port) as sock:
        sock.sendall(
            b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
            b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n"
            b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        answer = read_all(sock)
    assert statuses(answer) == [200] and b"connection: close" in answer


# ---------------------------------------------------------------------------- afterwards
def test_memory_returns_near_baseline(hostile: Hostile) -> None:
    """After every hostile client above, the server is as big as it was before them."""
    rss = settle_rss(hostile.pid, hostile.baseline_mb + 40)
    assert rss - hostile.baseline_mb < 40, f"{hostile.baseline_mb:.0f} MB -> {rss:.0f} MB"
    assert_still_serves(hostile.port)


def test_sigterm_does_not_wait_for_a_client_that_never_reads(
    test_repo: Path, tmp_path: Path
) -> None:
    server = start_server(test_repo, tmp_path, "--grace-period", "30", *RELAXED)
    try:
        sock, _, _ = _flood_unread(server.http_port, 1.0)
        with sock:
            assert_still_serves(server.http_port)
            start = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            server.proc.wait(15)
        assert server.proc.returncode == 0
        assert time.monotonic() - start < 10, "SIGTERM waited for the stuck connection"
    finally:
        server.stop()


def test_a_limit_that_is_not_positive_is_refused_at_start(test_repo: Path) -> None:
    cmd = [
        sys.executable, "-m", "rtserve.cli", "serve", "--model-repository", str(test_repo),
        "--http-port", "0", "--grpc-port", "0", "--http-header-timeout-s", "0",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent / "src"))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode != 0
    assert "http_header_timeout_s: expected a number > 0, got 0" in done.stderr
