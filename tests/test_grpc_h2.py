"""rtserve's own HTTP/2 gRPC transport (server/grpc_h2.py), driven frame by frame with the
``h2`` library as a client: what grpcio's clients never send (bad prefaces, compressed or
oversized messages, header floods, resets), flow control both ways, deadlines; after each,
the server keeps serving."""

from __future__ import annotations

import socket
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    ResponseReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
)
from h2.settings import SettingCodes

from rtserve.protocol import grpc_service_pb2 as pb
from tests.conftest import RunningServer, hold_connections, start_server
from tests.models import build_scale

SERVICE = "/inference.GRPCInferenceService/"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("repo")
    build_scale(root / "scale" / "1" / "model.onnx", 2.0)
    (root / "scale" / "config.yaml").write_text("max_batch_size: 4\n")
    build_scale(root / "big" / "1" / "model.onnx", 2.0)
    (root / "big" / "config.yaml").write_text("max_batch_size: 0\n")
    build_scale(root / "slow" / "1" / "model.onnx", 3.0)
    (root / "slow" / "config.yaml").write_text(
        "max_batch_size: 4\n"
        "dynamic_batching: {max_queue_delay_us: 1500000, adaptive_delay: false}\n"
    )
    s = start_server(root, tmp_path_factory.mktemp("s"), "--max-request-bytes", str(8 << 20))
    yield s
    s.stop()


def infer_message(model: str, rows: int = 1, value: float = 1.0) -> bytes:
    r = pb.ModelInferRequest(model_name=model)
    r.inputs.add(name="x", datatype="FP32", shape=[rows, 4])
    r.raw_input_contents.append(np.full((rows, 4), value, np.float32).tobytes())
    return r.SerializeToString()


def framed(message: bytes, compressed: int = 0) -> bytes:
    return struct.pack(">BL", compressed, len(message)) + message


class Client:
    """One HTTP/2 connection; ``ack=False`` never gives the server window back."""

    def __init__(self, port: int, window: int | None = None, ack: bool = True) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.conn = H2Connection(H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        if window is not None:
            self.conn.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.ack = ack
        self.flush()
        self.headers: dict[int, dict[str, str]] = {}
        self.trailers: dict[int, dict[str, str]] = {}
        self.data: dict[int, bytearray] = {}
        self.ended: set[int] = set()
        self.reset: dict[int, int] = {}
        self.terminated: ConnectionTerminated | None = None

    def flush(self) -> None:
        self.sock.sendall(self.conn.data_to_send())

    def start(self, method: str, extra: list[tuple[str, str]] | None = None) -> int:
        sid = self.conn.get_next_available_stream_id()
        headers = [
            (":method", "POST"), (":scheme", "http"), (":path", SERVICE + method),
            (":authority", "127.0.0.1"), ("te", "trailers"),
            ("content-type", "application/grpc"), *(extra or []),
        ]  # fmt: skip
        self.conn.send_headers(sid, headers)
        return sid

    def call(self, method: str, body: bytes, extra: list[tuple[str, str]] | None = None) -> int:
        sid = self.start(method, extra)
        self.conn.send_data(sid, body, end_stream=True)
        self.flush()
        return sid

    def pump(self, until: object, timeout: float = 10.0) -> None:
        """Read until ``until()`` holds or the connection ends."""
        deadline = time.monotonic() + timeout
        while not until() and (left := deadline - time.monotonic()) > 0:  # type: ignore[operator]
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(1 << 16)
            except TimeoutError:
                break
            if not chunk:
                break
            for event in self.conn.receive_data(chunk):
                self._event(event)
            out = self.conn.data_to_send()
            if out:
                self.sock.sendall(out)

    def _event(self, event: object) -> None:
        if isinstance(event, ResponseReceived):
            self.headers[event.stream_id] = dict(event.headers)
        elif isinstance(event, TrailersReceived):
            self.trailers[event.stream_id] = dict(event.headers)
        elif isinstance(event, DataReceived):
            self.data.setdefault(event.stream_id, bytearray()).extend(event.data)
            if self.ack:
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, StreamEnded):
            self.ended.add(event.stream_id)
        elif isinstance(event, StreamReset):
            self.reset[event.stream_id] = event.error_code
        elif isinstance(event, ConnectionTerminated):
            self.terminated = event

    def finish(self, sid: int, timeout: float = 10.0) -> dict[str, str]:
        """The call's status: its trailers (or a trailers-only answer's headers)."""
        self.pump(lambda: sid in self.ended or sid in self.reset, timeout)
        assert sid in self.ended, f"stream {sid} did not end (reset: {self.reset.get(sid)})"
        return self.trailers.get(sid) or self.headers[sid]

    def close(self) -> None:
        self.sock.close()


@pytest.fixture()
def client(server: RunningServer) -> Iterator[Client]:
    c = Client(server.grpc_port)
    yield c
    c.close()


def answer(c: Client, sid: int) -> list[float]:
    body = bytes(c.data[sid])
    compressed, size = struct.unpack(">BL", body[:5])
    assert compressed == 0 and size == len(body) - 5
    reply = pb.ModelInferResponse.FromString(body[5:])
    return np.frombuffer(reply.raw_output_contents[0], np.float32).tolist()


def still_serves(server: RunningServer) -> None:
    with grpc.insecure_channel(server.grpc) as channel:
        infer = channel.unary_unary(
            SERVICE + "ModelInfer",
            request_serializer=lambda b: b,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        reply = infer(infer_message("scale", value=4.0), timeout=10)
    assert np.frombuffer(reply.raw_output_contents[0], np.float32).tolist() == [8.0] * 4


def test_a_unary_call_frame_by_frame(client: Client) -> None:
    sid = client.call("ModelInfer", framed(infer_message("scale", value=3.0)))
    status = client.finish(sid)
    assert status["grpc-status"] == "0"
    assert client.headers[sid][":status"] == "200"
    assert client.headers[sid]["content-type"] == "application/grpc"
    assert "server-timing" in status
    assert answer(client, sid) == [6.0] * 4


def test_many_calls_on_one_connection_each_get_their_answer(client: Client) -> None:
    sids = {
        client.call("ModelInfer", framed(infer_message("scale", value=i))): i for i in range(50)
    }
    for sid, i in sids.items():
        assert client.finish(sid)["grpc-status"] == "0"
        assert answer(client, sid) == [2.0 * i] * 4


def test_unknown_method_is_unimplemented(server: RunningServer, client: Client) -> None:
    sid = client.call("NoSuchMethod", framed(b""))
    status = client.finish(sid)
    assert status["grpc-status"] == str(grpc.StatusCode.UNIMPLEMENTED.value[0])
    assert "NoSuchMethod" in status["grpc-message"]
    still_serves(server)


def test_a_body_that_is_not_grpc_is_415(client: Client) -> None:
    sid = client.conn.get_next_available_stream_id()
    client.conn.send_headers(
        sid,
        [(":method", "POST"), (":scheme", "http"), (":path", SERVICE + "ModelInfer"),
         (":authority", "x"), ("content-type", "application/json")],
        end_stream=True,
    )  # fmt: skip
    client.flush()
    client.finish(sid)
    assert client.headers[sid][":status"] == "415"


def test_compressed_messages_from_tritonclient_are_answered(server: RunningServer) -> None:
    """gzip and deflate, as tritonclient's compression_algorithm sends them, on unary and
    streamed calls, large enough that grpc really compresses them."""
    import queue

    import tritonclient.grpc as tgrpc

    client = tgrpc.InferenceServerClient(server.grpc)
    x = np.arange(4096 * 4, dtype=np.float32).reshape(4096, 4) % 7
    inp = tgrpc.InferInput("x", [4096, 4], "FP32")
    inp.set_data_from_numpy(x)
    for algorithm in ("gzip", "deflate"):
        result = client.infer("big", [inp], compression_algorithm=algorithm)
        assert np.array_equal(result.as_numpy("y"), x * 2)
    answers: queue.Queue = queue.Queue()
    client.start_stream(
        lambda result, error: answers.put((result, error)), compression_algorithm="gzip"
    )
    try:
        client.async_stream_infer("big", [inp])
        result, error = answers.get(timeout=20)
    finally:
        client.stop_stream()
    assert error is None and np.array_equal(result.as_numpy("y"), x * 2)


def _deflated(message: bytes) -> bytes:
    return zlib.compress(message)


@pytest.mark.parametrize(
    ("encoding", "body", "code", "needle"),
    [
        ("gzip", b"not gzip at all", grpc.StatusCode.INTERNAL, "could not decompress"),
        (
            "deflate",
            _deflated(b"\0" * (9 << 20)),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "larger than max",
        ),
        ("deflate", _deflated(b"\0" * 1000)[:-6], grpc.StatusCode.INTERNAL, "could not decompress"),
        ("br", b"x", grpc.StatusCode.UNIMPLEMENTED, "grpc-encoding 'br': not supported"),
        (None, b"x", grpc.StatusCode.INTERNAL, "compressed message without grpc-encoding"),
    ],
    ids=["garbage", "bomb", "truncated", "unknown-encoding", "no-encoding"],
)
def test_a_bad_compressed_message_fails_its_call_only(
    server: RunningServer, client: Client, encoding: str | None, body: bytes,
    code: grpc.StatusCode, needle: str,
) -> None:  # fmt: skip
    """A bomb stops at the message limit (8 MiB here) however small it came."""
    extra = [("grpc-encoding", encoding)] if encoding else []
    sid = client.call("ModelInfer", framed(body, compressed=1), extra)
    status = client.finish(sid)
    assert status["grpc-status"] == str(code.value[0]), status
    assert needle in status["grpc-message"]
    still_serves(server)


def test_a_message_over_the_limit_is_refused_from_its_prefix(
    server: RunningServer, client: Client
) -> None:
    """The 5-byte prefix declares 1 GiB: refused before any of it is sent or buffered."""
    sid = client.start("ModelInfer")
    client.conn.send_data(sid, struct.pack(">BL", 0, 1 << 30))
    client.flush()
    status = client.finish(sid)
    assert status["grpc-status"] == str(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
    assert str(1 << 30) in status["grpc-message"]
    still_serves(server)


def test_a_bad_preface_gets_goaway(server: RunningServer) -> None:
    with socket.create_connection(("127.0.0.1", server.grpc_port), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        got = b""
        while chunk := sock.recv(4096):
            got += chunk
    kinds = []
    while len(got) >= 9:
        length = int.from_bytes(got[:3], "big")
        kinds.append(got[3])
        got = got[9 + length :]
    assert 7 in kinds  # GOAWAY, then the connection closed
    still_serves(server)


def test_ping_is_acknowledged(client: Client) -> None:
    from h2.events import PingAckReceived

    acks: list[bytes] = []
    seen = client._event

    def event(e: object) -> None:
        if isinstance(e, PingAckReceived):
            acks.append(e.ping_data)
        seen(e)

    client._event = event  # type: ignore[method-assign]
    client.conn.ping(b"12345678")
    client.flush()
    client.pump(lambda: acks)
    assert acks == [b"12345678"]


def test_a_header_flood_closes_only_that_connection(server: RunningServer) -> None:
    """HEADERS without END_HEADERS, then CONTINUATION frames past the 16 KiB bound."""
    with socket.create_connection(("127.0.0.1", server.grpc_port), timeout=10) as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
        sock.sendall(bytes([0, 0, 1, 1, 0, 0, 0, 0, 1]) + b"\x82")  # HEADERS, stream 1
        block = bytes([0, 0x40, 0, 9, 0, 0, 0, 0, 1]) + b"\x00" * 0x4000  # CONTINUATION
        try:
            for _ in range(64):
                sock.sendall(block)
        except OSError:
            pass  # closed by the server mid-flood
        got = b""
        try:
            while chunk := sock.recv(1 << 16):
                got += chunk
        except OSError:
            pass
    assert b"header block too large" in got
    still_serves(server)


def test_a_reset_call_is_dropped_and_the_server_keeps_serving(
    server: RunningServer, client: Client
) -> None:
    sid = client.call("ModelInfer", framed(infer_message("slow")))
    client.pump(lambda: False, timeout=0.3)
    client.conn.reset_stream(sid)
    client.flush()
    sid2 = client.call("ModelInfer", framed(infer_message("scale", value=5.0)))
    assert client.finish(sid2)["grpc-status"] == "0"
    assert answer(client, sid2) == [10.0] * 4
    assert sid not in client.ended


def test_the_deadline_ends_a_call_with_deadline_exceeded(client: Client) -> None:
    started = time.monotonic()
    sid = client.call("ModelInfer", framed(infer_message("slow")), [("grpc-timeout", "200m")])
    status = client.finish(sid)
    assert status["grpc-status"] == str(grpc.StatusCode.DEADLINE_EXCEEDED.value[0])
    assert time.monotonic() - started < 1.4  # before the 1.5 s queue delay would answer


def test_a_large_answer_respects_the_clients_window(server: RunningServer) -> None:
    """A 2 MiB request and answer through 16 KiB stream windows: the server sends no more
    than the window allows, and goes on as the client gives window back."""
    rows = 1 << 17
    c = Client(server.grpc_port, window=16384)
    try:
        c.conn.increment_flow_control_window(1 << 24)
        sid = c.start("ModelInfer")
        body = framed(infer_message("big", rows=rows, value=1.5))
        for i in range(0, len(body), 16384):
            while c.conn.local_flow_control_window(sid) < min(16384, len(body) - i):
                c.pump(lambda: True, timeout=0.05)
                c.pump(lambda: False, timeout=0.05)
            c.conn.send_data(sid, body[i : i + 16384], end_stream=i + 16384 >= len(body))
            c.flush()
        assert c.finish(sid, timeout=30)["grpc-status"] == "0"
        values = answer(c, sid)
        assert len(values) == rows * 4 and set(values) == {3.0}
    finally:
        c.close()


def test_without_window_updates_the_server_stops_at_the_window(server: RunningServer) -> None:
    """A client that never gives window back gets exactly its initial window of the
    answer, and the call stays open (not failed, nothing else lost)."""
    c = Client(server.grpc_port, window=65535, ack=False)
    try:
        c.conn.increment_flow_control_window(1 << 24)
        sid = c.start("ModelInfer")
        body = framed(infer_message("big", rows=1 << 15, value=1.0))  # 512 KiB out
        for i in range(0, len(body), 16384):
            c.conn.send_data(sid, body[i : i + 16384], end_stream=i + 16384 >= len(body))
            c.flush()
            c.pump(lambda: False, timeout=0.02)
        c.pump(lambda: False, timeout=1.0)
        assert len(c.data.get(sid, b"")) == 65535
        assert sid not in c.ended
    finally:
        c.close()
    still_serves(server)


def test_streams_past_the_limit_are_refused(server: RunningServer) -> None:
    from rtserve.server.grpc_h2 import MAX_STREAMS

    c = Client(server.grpc_port)  # streams opened before the server's SETTINGS are read
    try:
        sids = [c.start("ModelStreamInfer") for _ in range(MAX_STREAMS + 4)]
        c.flush()
        c.pump(lambda: len(c.reset) >= 4, timeout=10)
        assert sorted(c.reset) == sids[MAX_STREAMS:]
    finally:
        c.close()
    still_serves(server)


def test_a_streamed_call_frame_by_frame(client: Client) -> None:
    sid = client.start("ModelStreamInfer")
    for i in range(3):
        r = pb.ModelInferRequest.FromString(infer_message("scale", value=i))
        r.id = f"r{i}"
        client.conn.send_data(sid, framed(r.SerializeToString()))
    client.conn.end_stream(sid)
    client.flush()
    assert client.finish(sid)["grpc-status"] == "0"
    body, got = bytes(client.data[sid]), {}
    while body:
        size = struct.unpack(">L", body[1:5])[0]
        reply = pb.ModelStreamInferResponse.FromString(body[5 : 5 + size]).infer_response
        got[reply.id] = np.frombuffer(reply.raw_output_contents[0], np.float32).tolist()
        body = body[5 + size :]
    assert got == {f"r{i}": [2.0 * i] * 4 for i in range(3)}


def test_a_second_message_on_a_unary_call_is_an_error(client: Client) -> None:
    sid = client.call("ModelInfer", framed(infer_message("scale")) * 2)
    status = client.finish(sid)
    assert status["grpc-status"] != "0"
    assert "one request message" in status["grpc-message"]


def test_a_rapid_reset_flood_closes_only_that_connection(server: RunningServer) -> None:
    """Calls started and cancelled at once, past MAX_RESETS per sweep: GOAWAY."""
    from rtserve.server.grpc_h2 import ENHANCE_YOUR_CALM, MAX_RESETS

    c = Client(server.grpc_port)
    try:
        body = framed(infer_message("slow"))
        c.pump(lambda: c.conn.outbound_flow_control_window > 65535)  # the server's window
        try:
            for i in range(MAX_RESETS + 50):
                sid = c.start("ModelInfer")
                c.conn.send_data(sid, body, end_stream=True)
                c.conn.reset_stream(sid)
                if i % 100 == 0:
                    c.flush()
            c.flush()
        except OSError:
            pass  # closed by the server mid-flood
        c.pump(lambda: c.terminated is not None, timeout=20)
        assert c.terminated is not None
        assert c.terminated.error_code == ENHANCE_YOUR_CALM
    finally:
        c.close()
    still_serves(server)


def test_connections_past_the_grpc_cap_are_closed_at_once(tmp_path: Path) -> None:
    """The gRPC port had no connection cap: idle clients could take every descriptor. It
    holds at most an eighth of the descriptor limit (75 of 600 here); past it a connection
    is closed at once, and once they go a client is served again."""
    import shutil

    if shutil.which("prlimit") is None:
        pytest.skip("prlimit (util-linux) is needed to lower the descriptor limit")
    root = tmp_path / "repo"
    build_scale(root / "scale" / "1" / "model.onnx", 2.0)
    (root / "scale" / "config.yaml").write_text("max_batch_size: 4\n")
    s = start_server(root, tmp_path / "s", prefix=("prlimit", "--nofile=600:600"))
    held: list[socket.socket] = []
    try:
        held, closed = hold_connections(s.grpc_port, 100)
        assert closed >= 100 - 75, closed
        for sock in held:
            sock.close()
        held.clear()
        time.sleep(0.5)
        still_serves(s)
    finally:
        for sock in held:
            sock.close()
        s.stop()
