"""gRPC under hostile clients: garbage messages, huge names, and HTTP's connection cap."""

from __future__ import annotations

import socket

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.conftest import start_server
from tests.models import build_scale


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("repo")
    build_scale(root / "a" / "1" / "model.onnx", 2.0)
    (root / "a" / "config.yaml").write_text("max_batch_size: 4\n")
    s = start_server(root, tmp_path_factory.mktemp("s"), "--http-max-connections", "16")
    yield s
    s.stop()


def _infer(url: str) -> list[list[float]]:
    client = grpcclient.InferenceServerClient(url)
    x = grpcclient.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.ones((1, 4), np.float32))
    return client.infer("a", [x]).as_numpy("y").tolist()


def test_a_malformed_message_is_invalid_argument_and_the_server_keeps_serving(capped) -> None:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(capped.grpc) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as info:
            call(b"\xff\xff\xff\xff\x0f garbage", timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed" in info.value.details()
    assert _infer(capped.grpc) == [[2.0] * 4]


def test_a_huge_model_name_gets_a_short_not_found(capped) -> None:  # type: ignore[no-untyped-def]
    client = grpcclient.InferenceServerClient(capped.grpc)
    x = grpcclient.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.ones((1, 4), np.float32))
    with pytest.raises(InferenceServerException) as info:
        client.infer("m" * 100_000, [x])
    assert info.value.status() in ("StatusCode.NOT_FOUND", "StatusCode.INVALID_ARGUMENT")
    assert len(info.value.message()) < 1000


def test_grpc_still_serves_when_http_connections_are_at_their_cap(capped) -> None:  # type: ignore[no-untyped-def]
    held = []
    try:
        for _ in range(24):  # beyond the cap of 16: the extra ones are refused
            sock = socket.create_connection(("127.0.0.1", capped.http_port), timeout=5)
            held.append(sock)
        extra = socket.create_connection(("127.0.0.1", capped.http_port), timeout=5)
        extra.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\n")
        answer = extra.recv(4096)
        extra.close()
        assert answer.startswith(b"HTTP/1.1 503"), answer[:80]
        assert _infer(capped.grpc) == [[2.0] * 4]
    finally:
        for sock in held:
            sock.close()
