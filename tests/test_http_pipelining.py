"""Pipelined inference requests on one connection, written at once with a raw socket: every
one is answered, in order (issue 23, item 5)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import rawhttp
from tests.conftest import RELAXED, RunningServer, start_server

BODY_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def pipelining(
    test_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    server = start_server(
        test_repo,
        tmp_path_factory.mktemp("pipelining"),
        "--http-body-timeout-s", str(BODY_TIMEOUT_S), *RELAXED,
    )  # fmt: skip
    yield server
    server.stop()


def infer_request(i: int, rng: random.Random) -> bytes:
    """An MLP inference of 256 distinct floats (~5 kB), tagged ``x-request-id: p<i>``."""
    data = [rng.random() for _ in range(256)]
    body = json.dumps(
        {"inputs": [{"name": "input", "shape": [1, 256], "datatype": "FP32", "data": data}]}
    ).encode()
    head = (
        f"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nx-request-id: p{i}\r\n\r\n"
    )
    return head.encode() + body


@pytest.mark.parametrize("count", [40, 200])
def test_pipelined_inferences_written_at_once_are_all_answered_in_order(
    pipelining: RunningServer, count: int
) -> None:
    rng = random.Random(count)
    requests = [infer_request(i, rng) for i in range(count)]
    with rawhttp.connect(pipelining.http_port, timeout=BODY_TIMEOUT_S + 3) as sock:
        sock.sendall(b"".join(requests))
        buf = bytearray()
        for i in range(count):
            status, headers, body = rawhttp.read_response(sock, buf)
            assert (status, headers.get("x-request-id")) == (200, f"p{i}"), (i, body[:200])
            assert len(json.loads(body)["outputs"][0]["data"]) == 10
        sock.sendall(requests[0])  # the connection is still usable
        assert rawhttp.read_response(sock, buf)[0] == 200
