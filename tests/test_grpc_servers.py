"""Both gRPC transports: rtserve's own HTTP/2 (the default, one listener) and
``--grpc-server grpcio``, several grpc.aio servers on the port (``GRPC_SERVERS``,
SO_REUSEPORT). Each serves many connections, unary and streamed, and drains on SIGTERM."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from rtserve.protocol import grpc_service_pb2 as pb
from rtserve.server.grpc import GRPC_SERVERS
from tests.conftest import RunningServer, start_server
from tests.models import build_scale, build_slow_repository

INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


TRANSPORTS = {"rtserve": 1, "grpcio": GRPC_SERVERS}  # transport -> listeners on the port


@pytest.fixture(scope="module", params=sorted(TRANSPORTS))
def server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[str, RunningServer]]:
    root = tmp_path_factory.mktemp("repo")
    build_scale(root / "scale" / "1" / "model.onnx", 2.0)
    (root / "scale" / "config.yaml").write_text("max_batch_size: 4\n")
    s = start_server(root, tmp_path_factory.mktemp("s"), "--grpc-server", request.param)
    yield request.param, s
    s.stop()


def listeners(port: int) -> int:
    """Listening TCP sockets on ``port``, from /proc/net/tcp and tcp6."""
    rows = [
        r.split()
        for table in ("tcp", "tcp6")
        for r in Path(f"/proc/net/{table}").read_text().splitlines()[1:]
    ]
    return sum(1 for r in rows if r[1].endswith(f":{port:04X}") and r[3] == "0A")


def request(value: float, request_id: str = "", model: str = "scale") -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name=model, id=request_id)
    r.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    r.raw_input_contents.append(np.full((1, 4), value, np.float32).tobytes())
    return r


def own_channel(address: str) -> grpc.Channel:
    """A channel with its own connection (not one shared from the process's pool)."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def answer(response: pb.ModelInferResponse) -> list[float]:
    return np.frombuffer(response.raw_output_contents[0], np.float32).tolist()


def test_the_grpc_port_has_the_transports_listeners(server: tuple[str, RunningServer]) -> None:
    transport, s = server
    assert GRPC_SERVERS > 1
    assert listeners(s.grpc_port) == TRANSPORTS[transport]


def test_many_connections_get_every_unary_and_stream_answer(
    server: tuple[str, RunningServer],
) -> None:
    channels = [own_channel(server[1].grpc) for _ in range(2 * GRPC_SERVERS)]
    try:
        for i, channel in enumerate(channels):
            infer = channel.unary_unary(
                INFER,
                request_serializer=pb.ModelInferRequest.SerializeToString,
                response_deserializer=pb.ModelInferResponse.FromString,
            )
            assert answer(infer(request(i), timeout=10)) == [2.0 * i] * 4
            stream = channel.stream_stream(
                STREAM,
                request_serializer=pb.ModelInferRequest.SerializeToString,
                response_deserializer=pb.ModelStreamInferResponse.FromString,
            )
            replies = list(stream(iter([request(i, "a"), request(i + 1, "b")]), timeout=10))
            got = {r.infer_response.id: answer(r.infer_response) for r in replies}
            assert got == {"a": [2.0 * i] * 4, "b": [2.0 * (i + 1)] * 4}
    finally:
        for channel in channels:
            channel.close()


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_a_stop_answers_calls_in_flight_on_every_server(tmp_path: Path, transport: str) -> None:
    """SIGTERM while queued calls are in flight on several connections (fewer than a batch,
    so they wait out the queue delay): each is answered, then the process exits 0 and no
    listener is left."""
    repo = build_slow_repository(tmp_path / "repo", max_queue_size=64, delay_us=1_500_000)
    s = start_server(repo, tmp_path / "s", "--grpc-server", transport)
    channels = [own_channel(s.grpc) for _ in range(3)]
    results: list[object] = []
    try:
        calls = [
            c.unary_unary(
                INFER,
                request_serializer=pb.ModelInferRequest.SerializeToString,
                response_deserializer=pb.ModelInferResponse.FromString,
            )
            for c in channels
        ]

        def call(fn: grpc.UnaryUnaryMultiCallable) -> None:
            try:
                results.append(answer(fn(request(1.0, model="slow"), timeout=20)))
            except grpc.RpcError as exc:
                results.append(exc.code())

        threads = [threading.Thread(target=call, args=(fn,)) for fn in calls]
        for t in threads:
            t.start()
        time.sleep(0.5)
        s.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert results == [[3.0] * 4] * len(threads)
        assert s.proc.wait(30) == 0
        assert listeners(s.grpc_port) == 0
    finally:
        for channel in channels:
            channel.close()
        s.stop()
