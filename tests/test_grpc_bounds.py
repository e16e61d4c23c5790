"""gRPC under clients that do not read, cancel, or unload: bounded memory, a prompt stop,
quiet logs, readiness answered alike on both protocols; the request id's length limit."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from rtserve.protocol import grpc_service_pb2 as pb
from tests.conftest import RunningServer, rss_mb, start_server
from tests.models import _save, build_scale, build_slow_repository

STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
MIB = 1 << 20


def build_echo(path: Path) -> Path:
    """y = x, FP32 of any length, unbatched: an answer as large as its request."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "echo",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])],
    )
    return _save(graph, path)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("repo")
    build_scale(root / "scale" / "1" / "model.onnx", 2.0)
    (root / "scale" / "config.yaml").write_text("max_batch_size: 4\n")
    build_echo(root / "echo" / "1" / "model.onnx")
    (root / "echo" / "config.yaml").write_text("max_batch_size: 0\n")
    s = start_server(root, tmp_path_factory.mktemp("s"))
    yield s
    s.stop()


def scale_request(request_id: str) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="scale", id=request_id)
    r.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    r.raw_input_contents.append(np.ones((1, 4), np.float32).tobytes())
    return r


class UnreadStream:
    """A ModelStreamInfer call that sends ``requests`` and reads no answer until asked."""

    def __init__(self, address: str, requests: Iterator[pb.ModelInferRequest]) -> None:
        self.sent = 0
        self.channel = grpc.insecure_channel(
            address, options=[("grpc.max_receive_message_length", 64 * MIB)]
        )
        stub = self.channel.stream_stream(
            STREAM,
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelStreamInferResponse.FromString,
        )
        self.call = stub(self._counted(requests))

    def _counted(self, requests: Iterator[pb.ModelInferRequest]) -> Iterator[Any]:
        for r in requests:
            self.sent += 1
            yield r

    def settle(self, pid: int, seconds: float = 8.0) -> float:
        """Wait until the client is held (or sent everything) and the server's RSS stops
        growing; the RSS then, in MB."""
        deadline = time.monotonic() + seconds
        last = (-1, -1.0)
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = (self.sent, rss_mb(pid))
            if now[0] == last[0] and abs(now[1] - last[1]) < 1:
                break
            last = now
        return rss_mb(pid)

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()


def test_an_unread_stream_of_long_ids_is_refused_and_holds_bounded_memory(server) -> None:  # type: ignore[no-untyped-def]
    """The issue's request: 1,600 requests whose id is 256 KiB, answers never read."""
    pid = server.proc.pid
    base = rss_mb(pid)
    requests = (scale_request(f"{i:06d}" + "a" * (256 << 10)) for i in range(1600))
    stream = UnreadStream(server.grpc, requests)
    try:
        held = stream.settle(pid)
        assert held - base < 64, f"RSS {base:.0f} -> {held:.0f} MB"
        first = next(stream.call)
        assert "id: 262150 characters, longer than the limit of 256" in first.error_message
        assert first.infer_response.id == "000000" + "a" * 250
    finally:
        stream.close()


@pytest.mark.parametrize(
    ("count", "elements", "bound_mb"), [(800, 64 << 10, 64), (40, 1 << 20, 128)]
)
def test_an_unread_stream_stops_being_read_and_answers_everything_once_read(
    server, count: int, elements: int, bound_mb: int
) -> None:  # type: ignore[no-untyped-def]
    """Requests of 256 KiB (4 MiB) whose answers are as large: without a window the server
    held every unread answer (+200 MB, +160 MB); with it the client is held back instead."""
    pid = server.proc.pid
    base = rss_mb(pid)
    x = np.arange(elements, dtype=np.float32).tobytes()

    def requests() -> Iterator[pb.ModelInferRequest]:
        for i in range(count):
            r = pb.ModelInferRequest(model_name="echo", id=str(i))
            r.inputs.add(name="x", datatype="FP32", shape=[elements])
            r.raw_input_contents.append(x)
            yield r

    stream = UnreadStream(server.grpc, requests())
    try:
        held = stream.settle(pid)
        assert stream.sent < count, "the server kept reading a stream nobody reads"
        assert held - base < bound_mb, f"RSS {base:.0f} -> {held:.0f} MB"
        ids = set()
        for answer in stream.call:
            assert not answer.error_message, answer.error_message
            assert answer.infer_response.raw_output_contents[0] == x
            ids.add(answer.infer_response.id)
        assert ids == {str(i) for i in range(count)}
    finally:
        stream.close()


def test_a_long_request_id_is_refused_on_both_protocols(server) -> None:  # type: ignore[no-untyped-def]
    stub = grpc.insecure_channel(server.grpc).unary_unary(
        "/inference.GRPCInferenceService/ModelInfer",
        request_serializer=pb.ModelInferRequest.SerializeToString,
        response_deserializer=pb.ModelInferResponse.FromString,
    )
    assert stub(scale_request("i" * 256), timeout=10).id == "i" * 256
    with pytest.raises(grpc.RpcError) as info:
        stub(scale_request("i" * 257), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "id: 257 characters, longer than the limit of 256"

    def http_infer(request_id: str) -> tuple[int, dict[str, Any]]:
        body = {
            "id": request_id,
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1] * 4}],
        }
        req = urllib.request.Request(
            f"{server.base}/v2/models/scale/infer", json.dumps(body).encode(), method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    assert http_infer("i" * 256) == (200, http_infer("i" * 256)[1])
    assert http_infer("i" * 256)[1]["id"] == "i" * 256
    assert http_infer("i" * (256 << 10)) == (
        400,
        {"error": "id: 262144 characters, longer than the limit of 256"},
    )


def test_cancelled_streams_and_calls_leave_nothing_in_flight_nor_an_error_logged(
    tmp_path: Path,
) -> None:
    """300 streams cancelled while sending, 300 unary calls cancelled while queued; then
    SIGTERM with a 30 s grace period: the server stops at once, with no ERROR logged."""
    repo = build_slow_repository(tmp_path / "repo", 100_000, 200_000)
    s = start_server(repo, tmp_path / "s", "--grace-period", "30")
    try:
        channel = grpc.insecure_channel(s.grpc)
        stream = channel.stream_stream(
            STREAM,
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelStreamInferResponse.FromString,
        )
        unary = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        request = scale_request("r")
        request.model_name = "slow"
        stop = threading.Event()

        def endless() -> Iterator[pb.ModelInferRequest]:
            while not stop.is_set():
                yield request

        calls = []
        for i in range(300):
            calls += [stream(endless()), unary.future(request)]
            if i % 10 == 9:
                time.sleep(0.01)
                for call in calls[-20:]:
                    call.cancel()
        stop.set()
        time.sleep(0.5)
        started = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(60)
        assert time.monotonic() - started < 5
        assert s.proc.returncode == 0
        log = s.log()
        assert "ERROR" not in log and "Traceback" not in log, log[-3000:]
        channel.close()
    finally:
        s.stop()


def test_model_ready_after_an_unload_is_false_on_both_protocols(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    build_scale(repo / "a" / "1" / "model.onnx", 2.0)
    (repo / "a" / "config.yaml").write_text("max_batch_size: 4\n")
    s = start_server(repo, tmp_path / "s", "--model-control-mode", "explicit", "--load-model", "a")
    try:
        g = grpcclient.InferenceServerClient(s.grpc)
        h = httpclient.InferenceServerClient(s.http)
        assert g.is_model_ready("a") and h.is_model_ready("a")
        g.unload_model("a")
        assert g.is_model_ready("a") is False
        assert h.is_model_ready("a") is False
        try:
            urllib.request.urlopen(f"{s.base}/v2/models/a/ready", timeout=10)
        except urllib.error.HTTPError as e:
            assert (e.code, json.loads(e.read())) == (503, {"name": "a", "ready": False})
        else:
            raise AssertionError("an unloaded model answered 200 ready")
        # A name the server never knew: NOT_FOUND on gRPC, 404 on HTTP.
        with pytest.raises(InferenceServerException) as info:
            g.is_model_ready("never")
        assert info.value.status() == "StatusCode.NOT_FOUND"
        with pytest.raises(urllib.error.HTTPError) as http_info:
            urllib.request.urlopen(f"{s.base}/v2/models/never/ready", timeout=10)
        assert http_info.value.code == 404
        h.load_model("a")
        assert g.is_model_ready("a") and h.is_model_ready("a")
    finally:
        s.stop()
