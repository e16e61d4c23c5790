"""Property-based fuzzing of the HTTP/1.1 layer against a real server: random and mutated
request bytes, sent in random pieces, never crash it and never get a 5xx (client garbage is
the client's error); a valid request is served afterwards.

Bounded for CI (a few seconds); ``RTSERVE_FUZZ_EXAMPLES=5000`` runs longer.
"""

from __future__ import annotations

import contextlib
import os
import socket

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import RunningServer
from tests.rawhttp import read_all
from tests.test_hostile_http import BODY, assert_still_serves, connect

EXAMPLES = int(os.environ.get("RTSERVE_FUZZ_EXAMPLES", "200"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

METHODS = [b"GET", b"POST", b"HEAD", b"PUT", b"DELETE", b"OPTIONS", b"CONNECT", b"PRI", b"G\x00T"]
PATHS = [
    b"/v2/models/scale/infer",
    b"/v2/models/scale/versions/1/infer",
    b"/v2/health/live",
    b"/v2/health/ready",
    b"/v2/models/scale",
    b"/v2/models/scale/config",
    b"/v2/models/nothing/infer",
    b"/metrics",
    b"*",
    b"http://x/v2/health/live",
    b"/%00%ff/../..",
]
VERSIONS = [b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1x", b"", b"HTTP/9.9"]
HEADER_NAMES = [
    b"Host",
    b"Content-Length",
    b"Transfer-Encoding",
    b"Content-Type",
    b"Content-Encoding",
    b"Connection",
    b"Expect",
    b"Upgrade",
    b"Inference-Header-Content-Length",
    b"X-Any",
    b"Bad Name",
    b"",
]
HEADER_VALUES = [
    b"x",
    b"0",
    b"-1",
    b"99999999999999999999",
    b"chunked",
    b"gzip",
    b"deflate",
    b"close",
    b"keep-alive",
    b"100-continue",
    b"websocket",
    b"application/json",
    b"10, 12",
    b"\x00\xff",
]


@st.composite
def http_requests(draw: st.DrawFn) -> bytes:
    """A request built from plausible parts (so that the parser gets past the first byte)."""
    method = draw(st.sampled_from(METHODS))
    path = draw(st.sampled_from(PATHS) | st.binary(min_size=1, max_size=40))
    version = draw(st.sampled_from(VERSIONS))
    headers = draw(
        st.lists(
            st.tuples(
                st.sampled_from(HEADER_NAMES) | st.binary(max_size=12),
                st.sampled_from(HEADER_VALUES) | st.binary(max_size=24),
            ),
            max_size=8,
        )
    )
    body = draw(
        st.sampled_from([b"", BODY, BODY[:-5], b"0\r\n\r\n", b"5\r\nhello\r\n0\r\n\r\n"])
        | st.binary(max_size=300)
    )
    if draw(st.booleans()):  # a consistent length most of the time
        headers.append((b"Content-Length", str(len(body)).encode()))
    head = b"%s %s %s\r\n" % (method, path, version)
    head += b"".join(b"%s: %s\r\n" % pair for pair in headers)
    return head + b"\r\n" + body


@st.composite
def mutated(draw: st.DrawFn, base: st.SearchStrategy[bytes]) -> bytes:
    """``base`` with a few bytes flipped, inserted or deleted."""
    data = bytearray(draw(base))
    for _ in range(draw(st.integers(0, 4))):
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        op = draw(st.sampled_from(["flip", "insert", "delete"]))
        if op == "flip":
            data[at] = draw(st.integers(0, 255))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            del data[at : at + draw(st.integers(1, 8))]
    return bytes(data)


def _exchange(port: int, pieces: list[bytes]) -> bytes:
    """Send the pieces, close our side, read everything the server answers."""
    with connect(port, timeout=10) as sock:
        for piece in pieces:
            try:
                sock.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):
                break
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
        return read_all(sock)


def _responses(data: bytes) -> list[tuple[int, bytes]]:
    """(status, body) of each response in ``data`` (walked by content-length, so that a
    status line echoed inside a body is not mistaken for a response)."""
    found = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        assert sep, f"an incomplete response: {data[:200]!r}"
        lines = head.split(b"\r\n")
        assert lines[0].startswith(b"HTTP/1.1 "), lines[0]
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        found.append((int(lines[0].split()[1]), rest[:length]))
        data = rest[length:]
    return found


def _check(server: RunningServer, data: bytes, cuts: list[int]) -> None:
    bounds = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    pieces = [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    answer = _exchange(server.http_port, pieces)
    assert server.proc.poll() is None, "the server died"
    for status, body in _responses(answer):
        # 501 only as the deliberate refusal of CONNECT or a WebSocket upgrade.
        assert status < 500 or (status == 501 and b"is not supported" in body), (data, answer)
        assert status >= 200 or status == 100  # 100 Continue is the only interim answer


@FUZZ
@given(
    data=mutated(http_requests()) | mutated(st.binary(max_size=400)),
    cuts=st.lists(st.integers(0, 10_000), max_size=4),
)
def test_fuzzed_requests_never_crash_the_server_or_get_a_5xx(
    server: RunningServer, data: bytes, cuts: list[int]
) -> None:
    _check(server, data, cuts)


@FUZZ
@given(
    requests=st.lists(mutated(http_requests()), min_size=2, max_size=6),
    cuts=st.lists(st.integers(0, 10_000), max_size=4),
)
def test_fuzzed_pipelines_never_crash_the_server_or_get_a_5xx(
    server: RunningServer, requests: list[bytes], cuts: list[int]
) -> None:
    _check(server, b"".join(requests), cuts)


def test_server_still_serves_after_fuzzing(server: RunningServer) -> None:
    assert_still_serves(server.http_port)
