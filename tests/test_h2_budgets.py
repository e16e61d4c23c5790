"""rtserve's HTTP/2 gRPC transport against clients that try to make it pay: each budget is
decided before its cost is paid (server/grpc_h2.py). The attacks are written frame by frame
(``tests/h2_attacks.py``) against a real server with API keys on;
each test asserts first on what bounds the attack (a refusal, a reset, GOAWAY), then that the
server's memory stayed near its baseline and that a valid client kept being answered."""

from __future__ import annotations

import json
import struct
import time
import urllib.request
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from hpack import Decoder

from rtserve.protocol import grpc_service_pb2 as pb
from rtserve.server.grpc_h2 import (
    CONN_BUFFER,
    CONN_WINDOW,
    INITIAL_WINDOW,
    MAX_CALLS_PER_ADDRESS,
    MAX_RESETS,
    REQUEST_STALL_S,
    STREAM_WINDOW,
)
from tests.conftest import RunningServer, start_server
from tests.h2_attacks import (
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOODS,
    HEADERS,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    Raw,
    Victim,
    blocked_answers,
    cpu_s,
    drain,
    flood,
    frame,
    goaway_code,
    grpc_message,
    gzip_bombs,
    infer_message,
    made_you_reset,
    partial_messages,
    settings_window_flood,
    window_update_flood,
)
from tests.models import build_scale

USER = "user-token-0123456789abcdef"  # models a, big and held
ADMIN = "admin-token-0123456789abcdef"
LIMIT = 8 << 20  # --max-request-bytes
UNAUTHENTICATED, PERMISSION_DENIED, RESOURCE_EXHAUSTED, UNIMPLEMENTED = "16", "7", "8", "12"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("repo")
    build_scale(root / "a" / "1" / "model.onnx", 2.0)
    (root / "a" / "config.yaml").write_text("max_batch_size: 4\n")
    build_scale(root / "big" / "1" / "model.onnx", 2.0)
    (root / "big" / "config.yaml").write_text("max_batch_size: 0\n")
    build_scale(root / "held" / "1" / "model.onnx", 3.0)  # a batch waits 1.5 s to fill
    (root / "held" / "config.yaml").write_text(
        "max_batch_size: 1024\n"
        "dynamic_batching: {max_queue_delay_us: 1500000, adaptive_delay: false}\n"
    )
    auth = root / "auth.yaml"
    auth.write_text(
        f"keys:\n  - {{name: app, token: {USER}, models: [a, big, held]}}\n"
        f"  - {{name: ops, token: {ADMIN}, admin: true}}\n"
    )
    s = start_server(
        root, tmp_path_factory.mktemp("s"), "--auth-file", str(auth),
        "--max-request-bytes", str(LIMIT),
    )  # fmt: skip
    yield s
    s.stop()


def statuses(frames: list) -> dict[int, dict[str, str]]:
    """The grpc-status (and message) of each stream that got a trailers-only answer or
    trailers, by stream id."""
    decoder = Decoder()
    out: dict[int, dict[str, str]] = {}
    for kind, _, sid, payload in frames:
        if kind == HEADERS:
            headers = dict(decoder.decode(payload))
            if "grpc-status" in headers:
                out[sid] = headers
    return out


def kinds(frames: list, kind: int) -> list[tuple[int, int, int, bytes]]:
    return [f for f in frames if f[0] == kind]


def infer_ok(s: RunningServer, key: str = USER) -> float:
    """A valid ModelInfer call (grpcio); returns its latency."""
    with grpc.insecure_channel(s.grpc) as channel:
        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=lambda b: b,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        t0 = time.perf_counter()
        reply = infer(infer_message("a", 4.0), metadata=[("authorization", key)], timeout=10)
        took = time.perf_counter() - t0
    assert np.frombuffer(reply.raw_output_contents[0], np.float32).tolist() == [8.0] * 4
    return took


def executions(s: RunningServer, model: str) -> int:
    req = urllib.request.Request(
        f"{s.base}/v2/models/{model}/stats", headers={"authorization": f"Bearer {USER}"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        stats = json.loads(r.read())["model_stats"][0]
    return int(stats["inference_stats"]["success"]["count"])


def served_meanwhile(victim: Victim) -> None:
    """The valid client kept being answered (gRPC and HTTP), and memory stayed near its
    baseline."""
    assert not victim.errors, victim.errors[:3]
    assert len(victim.latencies) >= 3
    assert victim.median() < 0.5, sorted(victim.latencies)[-5:]
    assert victim.median(http=True) < 0.5, sorted(victim.http_latencies)[-5:]
    assert victim.rss_peak - victim.rss_base < 100, (victim.rss_base, victim.rss_peak)


# ---------------------------------------------------------------------------- before the message
def test_calls_without_a_key_cost_their_headers_only(server: RunningServer) -> None:
    """60 calls whose prefix declares 60 MiB, no key: each is refused UNAUTHENTICATED from
    its headers and reset; the connection never gets more than the protocol's 64 KiB window
    (it was 16 MiB at once, and 3.7 GB were buffered in 21 s)."""
    with Victim(server.grpc, server.proc.pid, server.base) as victim:
        sent, got = partial_messages(server.grpc_port, streams=60, key=None, seconds=1.5)
    answers = statuses(got)
    assert len(answers) == 60
    assert {a["grpc-status"] for a in answers.values()} == {UNAUTHENTICATED}
    assert {f[2] for f in kinds(got, RST_STREAM)} == set(answers)
    assert not [f for f in kinds(got, WINDOW_UPDATE) if f[2] == 0]  # no connection window
    assert sent < 65535
    served_meanwhile(victim)


def test_a_compression_bomb_without_a_key_is_not_inflated(server: RunningServer) -> None:
    before = cpu_s(server.proc.pid)
    sent, got = gzip_bombs(server.grpc_port, count=20, key=None)
    answers = statuses(got)
    assert len(answers) == 20
    assert {a["grpc-status"] for a in answers.values()} == {UNAUTHENTICATED}
    # Inflating each to the 8 MiB limit would cost ~20 ms apiece; refused, it costs headers.
    assert cpu_s(server.proc.pid) - before < 1.0
    assert infer_ok(server) < 5


def _call(c: Raw, method: str, key: str | None, extra: tuple = ()) -> dict[str, str]:
    sid, frames = c.call_frames(method, grpc_message(b""), key, extra)
    c.send(frames)
    got = drain(c, 0.0) + c.frames(2.0)
    return statuses(got)[sid]


def test_an_unknown_method_is_unauthenticated_before_it_is_unimplemented(
    server: RunningServer,
) -> None:
    c = Raw(server.grpc_port)
    try:
        assert _call(c, "NoSuchMethod", None)["grpc-status"] == UNAUTHENTICATED
        assert _call(c, "NoSuchMethod", "wrong-token-0123456789")["grpc-status"] == UNAUTHENTICATED
        answer = _call(c, "NoSuchMethod", USER)
        assert answer["grpc-status"] == UNIMPLEMENTED and "NoSuchMethod" in answer["grpc-message"]
        assert _call(c, "RepositoryIndex", USER)["grpc-status"] == PERMISSION_DENIED
        assert _call(c, "ServerLive", None)["grpc-status"] == "0"  # health stays open
    finally:
        c.close()


def test_a_credential_sent_twice_is_refused_naming_it(server: RunningServer) -> None:
    c = Raw(server.grpc_port)
    try:
        twice = (("authorization", f"Bearer {USER}"),)
        answer = _call(c, "ServerMetadata", USER, twice)
        assert answer["grpc-status"] == UNAUTHENTICATED
        assert "duplicate 'authorization'" in answer["grpc-message"]
        answer = _call(c, "ServerMetadata", None, (("x-api-key", USER), ("x-api-key", USER)))
        assert "duplicate 'x-api-key'" in answer["grpc-message"]
        assert _call(c, "ServerMetadata", USER)["grpc-status"] == "0"
    finally:
        c.close()


# ---------------------------------------------------------------------------- buffers and stalls
def test_partial_messages_are_bounded_per_connection(server: RunningServer) -> None:
    """With a key: 60 unary calls declare a message of the limit (8 MiB here) and send what
    window they get, never all of it. Past CONN_BUFFER only one message gets more window, so
    the connection holds at most its window, the budget and one message (it held 60 times
    the limit)."""
    with Victim(server.grpc, server.proc.pid, server.base) as victim:
        sent, got = partial_messages(
            server.grpc_port, streams=60, key=USER, seconds=3.0, declared=LIMIT
        )
        assert infer_ok(server) < 5
    assert sent <= CONN_WINDOW + CONN_BUFFER + LIMIT + (1 << 20), sent
    assert not statuses(got)  # held by flow control, not failed (WINDOW_STALL_S ends them)
    served_meanwhile(victim)


def test_large_messages_sent_at_once_on_one_connection_all_pass(server: RunningServer) -> None:
    """The other side of the budget: 16 calls of 4 MiB at once on one grpcio channel (64 MiB,
    16 times CONN_BUFFER) each get their turn as the connection's leader, and all pass."""
    import concurrent.futures

    rows = 1 << 18  # 4 MiB of FP32
    r = pb.ModelInferRequest(model_name="big")
    r.inputs.add(name="x", datatype="FP32", shape=[rows, 4])
    r.raw_input_contents.append(np.full((rows, 4), 1.5, np.float32).tobytes())
    body = r.SerializeToString()
    options = [("grpc.max_receive_message_length", LIMIT), ("grpc.max_send_message_length", LIMIT)]
    with grpc.insecure_channel(server.grpc, options=options) as channel:
        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=lambda b: b,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        metadata = [("authorization", USER)]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            calls = [pool.submit(infer, body, metadata=metadata, timeout=25) for _ in range(16)]
            replies = [c.result() for c in calls]
    for reply in replies:
        assert np.frombuffer(reply.raw_output_contents[0], np.float32)[:4].tolist() == [3.0] * 4


def test_header_only_calls_cannot_take_every_call_slot(server: RunningServer) -> None:
    """With a key, from 127.0.0.2: 3 connections x 1000 calls that send headers only. One
    address holds at most MAX_CALLS_PER_ADDRESS calls; a client from another address is
    answered at once; after REQUEST_STALL_S the held calls are ended (as is a message left
    unfinished, from 127.0.0.3) and the address is served again."""
    attackers = [Raw(server.grpc_port, source="127.0.0.2") for _ in range(3)]
    partial = Raw(server.grpc_port, source="127.0.0.3")  # a message left unfinished
    try:
        t0 = time.monotonic()
        sid, block = partial.headers("ModelInfer")
        partial.send(
            frame(HEADERS, END_HEADERS, sid, block)
            + frame(DATA, 0, sid, struct.pack(">BL", 0, 100_000) + b"\0" * 10_000)
        )
        for c in attackers:
            calls = (c.headers("ModelInfer") for _ in range(1000))
            c.send(b"".join(frame(HEADERS, END_HEADERS, sid, block) for sid, block in calls))
        got = [c.frames(1.0) for c in attackers]
        refused = [a for g in got for a in statuses(g).values()]
        assert len(refused) == 3000 - MAX_CALLS_PER_ADDRESS
        assert {a["grpc-message"] for a in refused} == {
            "too many calls in progress from this address"
        }
        assert infer_ok(server) < 2  # from 127.0.0.1
        while time.monotonic() - t0 < REQUEST_STALL_S + 2.5:
            for c, g in zip(attackers, got, strict=True):
                g += c.frames(0.2)
        ended = [
            a for g in got for a in statuses(g).values() if "REQUEST_STALL_S" in a["grpc-message"]
        ]
        assert len(ended) == MAX_CALLS_PER_ADDRESS
        again = attackers[0]
        assert _call(again, "ServerMetadata", USER)["grpc-status"] == "0"
        answer = statuses(partial.frames(0.5))[sid]
        assert answer["grpc-status"] == RESOURCE_EXHAUSTED
        assert "REQUEST_STALL_S" in answer["grpc-message"]
    finally:
        for c in [*attackers, partial]:
            c.close()


# ---------------------------------------------------------------------------- frames without progress
@pytest.mark.parametrize("name", list(FLOODS))
def test_a_flood_of_frames_without_progress_gets_goaway(server: RunningServer, name: str) -> None:
    setup, one = FLOODS[name]
    with Victim(server.grpc, server.proc.pid, server.base) as victim:
        before = cpu_s(server.proc.pid)
        sent, got = flood(server.grpc_port, setup, one, 30_000)
        cpu = cpu_s(server.proc.pid) - before
    assert goaway_code(got) == ENHANCE_YOUR_CALM, got[-3:]
    print(f"{name}: {sent / 1e6:.2f} MB accepted, server {cpu:.2f} CPU s")
    served_meanwhile(victim)


@pytest.mark.parametrize("attack", [window_update_flood, settings_window_flood])
def test_window_floods_with_answers_waiting_get_goaway(server: RunningServer, attack) -> None:  # type: ignore[no-untyped-def]
    """1000 answers wait for window; WINDOW_UPDATE(+1) or SETTINGS_INITIAL_WINDOW_SIZE
    flips wake them all per frame no more (that was 10.7 and 2.8 CPU s per MB)."""
    with Victim(server.grpc, server.proc.pid, server.base) as victim:
        before = cpu_s(server.proc.pid)
        sent, got = attack(server.grpc_port)
        cpu = cpu_s(server.proc.pid) - before
    assert goaway_code(got) == ENHANCE_YOUR_CALM
    assert cpu / (sent / 1e6) < 2.0, (cpu, sent)
    served_meanwhile(victim)


def test_answers_waiting_for_window_are_all_sent_once_it_opens(server: RunningServer) -> None:
    """The other side of the budget: 1000 answers held by a zero stream window all arrive
    when SETTINGS opens it, and one stream's WINDOW_UPDATE sends that stream's answer."""
    c = blocked_answers(server.grpc_port, streams=1000)
    try:
        assert not kinds(c.frames(0.3), DATA)
        c.send(frame(WINDOW_UPDATE, 0, 1, struct.pack(">L", 100)))  # stream 1 only
        got = c.frames(0.5)
        assert {f[2] for f in kinds(got, DATA)} == {1}
        c.send(frame(SETTINGS, 0, 0, struct.pack(">HL", 4, 65535)))
        deadline = time.monotonic() + 10
        while len(statuses(got)) < 1000 and time.monotonic() < deadline:
            got += c.frames(0.3)
        assert len({f[2] for f in kinds(got, DATA)}) == 1000
        assert {a["grpc-status"] for a in statuses(got).values()} == {"0"}
    finally:
        c.close()


# ---------------------------------------------------------------------------- resets
def test_calls_cancelled_while_queued_never_reach_the_model(server: RunningServer) -> None:
    before = executions(server, "held")
    c = Raw(server.grpc_port)
    try:
        body = grpc_message(infer_message("held"))
        sids = []
        out = []
        for _ in range(200):
            sid, frames = c.call_frames("ModelInfer", body)
            sids.append(sid)
            out.append(frames)
        c.send(b"".join(out))
        c.frames(0.3)
        c.send(b"".join(frame(RST_STREAM, 0, sid, b"\0\0\0\x08") for sid in sids))
        c.frames(2.0)  # past the 1.5 s the batch would have waited
    finally:
        c.close()
    assert executions(server, "held") == before


def test_calls_reset_with_their_request_never_reach_the_model(server: RunningServer) -> None:
    before = executions(server, "a")
    c = Raw(server.grpc_port)
    try:
        body = grpc_message(infer_message("a"))
        out = []
        for _ in range(500):
            sid, frames = c.call_frames("ModelInfer", body)
            out.append(frames + frame(RST_STREAM, 0, sid, b"\0\0\0\x08"))
        c.send(b"".join(out))
        c.frames(1.0)
    finally:
        c.close()
    assert executions(server, "a") - before <= 25  # (a read may split a call from its reset)


def test_streams_the_server_resets_count_towards_the_reset_limit(server: RunningServer) -> None:
    """The "made you reset" pattern (CVE-2025-8671): a WINDOW_UPDATE of 0 on each call makes
    the server reset it; each reset takes back its call's credit (and counts towards
    MAX_RESETS), so the connection soon gets GOAWAY, and the calls never ran."""
    before = executions(server, "a")
    sent, got = made_you_reset(server.grpc_port, calls=MAX_RESETS + 200)
    assert goaway_code(got) == ENHANCE_YOUR_CALM
    assert executions(server, "a") - before < MAX_RESETS // 20
    assert infer_ok(server) < 5


def test_headers_after_the_request_ended_reset_the_stream_without_an_error_log(
    server: RunningServer,
) -> None:
    c = Raw(server.grpc_port)
    try:
        body = grpc_message(infer_message("a"))
        out, sids = [], []
        for _ in range(20):
            sid, frames = c.call_frames("ModelInfer", body)
            trailers = c.enc.encode([("x-trailer", "1")])
            out.append(frames + frame(HEADERS, END_HEADERS | END_STREAM, sid, trailers))
            sids.append(sid)
        c.send(b"".join(out))
        got = c.frames(1.0)
        assert {f[2] for f in kinds(got, RST_STREAM) if f[3] == b"\0\0\0\x05"} == set(sids)
        # Trailers that end the request are still read as such.
        sid, block = c.headers("ModelInfer")
        c.send(
            frame(HEADERS, END_HEADERS, sid, block)
            + frame(DATA, 0, sid, body)
            + frame(HEADERS, END_HEADERS | END_STREAM, sid, c.enc.encode([("x-trailer", "1")]))
        )
        assert statuses(c.frames(1.0))[sid]["grpc-status"] == "0"
    finally:
        c.close()
    log = server.log()
    assert "Traceback" not in log and "AssertionError" not in log


def test_grpcio_transport_checks_the_same_headers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With ``--grpc-server grpcio`` the headers are checked alike, before the handler."""
    build_scale(tmp_path / "repo" / "a" / "1" / "model.onnx", 2.0)
    (tmp_path / "repo" / "a" / "config.yaml").write_text("max_batch_size: 4\n")
    (tmp_path / "auth.yaml").write_text(f"keys:\n  - {{name: app, token: {USER}, models: [a]}}\n")
    s = start_server(
        tmp_path / "repo", tmp_path / "s", "--auth-file", str(tmp_path / "auth.yaml"),
        "--grpc-server", "grpcio",
    )  # fmt: skip
    try:
        with grpc.insecure_channel(s.grpc) as channel:

            def code(method: str, metadata: list[tuple[str, str]]) -> tuple[object, str]:
                call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
                try:
                    call(b"", metadata=metadata, timeout=10)
                except grpc.RpcError as exc:
                    return exc.code(), str(exc.details())
                return grpc.StatusCode.OK, ""

            key = ("authorization", f"Bearer {USER}")
            assert code("ServerMetadata", [key, key])[0] == grpc.StatusCode.UNAUTHENTICATED
            assert "duplicate 'authorization'" in code("ServerMetadata", [key, key])[1]
            assert code("NoSuchMethod", [])[0] == grpc.StatusCode.UNAUTHENTICATED
            assert code("NoSuchMethod", [key])[0] == grpc.StatusCode.UNIMPLEMENTED
            assert code("ServerMetadata", [key])[0] == grpc.StatusCode.OK
            assert code("ServerLive", [])[0] == grpc.StatusCode.OK
            stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
            with pytest.raises(grpc.RpcError) as info:
                list(stream(iter([b""]), timeout=10))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert infer_ok(s) < 5
    finally:
        s.stop()


# ---------------------------------------------------------------------------- the server's budget
SMALL = 2 << 20  # --max-request-bytes of the server below: its budget is 2 x (SMALL + 5)


@pytest.fixture(scope="module")
def small_budget(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A server whose SERVER_BUFFER is lowered to its floor (twice the message limit)."""
    import os

    root = tmp_path_factory.mktemp("repo-budget")
    build_scale(root / "a" / "1" / "model.onnx", 2.0)
    (root / "a" / "config.yaml").write_text("max_batch_size: 4\n")
    auth = root / "auth.yaml"
    auth.write_text(f"keys:\n  - {{name: app, token: {USER}, models: [a]}}\n")
    saved = os.environ.get("RTSERVE_H2_SERVER_BUFFER")
    os.environ["RTSERVE_H2_SERVER_BUFFER"] = "0"
    try:
        s = start_server(
            root, tmp_path_factory.mktemp("s-budget"), "--auth-file", str(auth),
            "--max-request-bytes", str(SMALL),
        )  # fmt: skip
    finally:
        if saved is None:
            del os.environ["RTSERVE_H2_SERVER_BUFFER"]
        else:
            os.environ["RTSERVE_H2_SERVER_BUFFER"] = saved
    yield s
    s.stop()


class Holder:
    """One connection with one unary call whose message (SMALL bytes declared) is sent as far
    as the server gives window, never finished."""

    def __init__(self, port: int) -> None:
        self.c = Raw(port)
        self.sid, block = self.c.headers("ModelInfer", USER)
        self.c.send(
            frame(HEADERS, END_HEADERS, self.sid, block)
            + frame(DATA, 0, self.sid, struct.pack(">BL", 0, SMALL))
        )
        self.window = 65535 - 5
        self.conn_window = 65535 - 5
        self.left = SMALL - 1  # (one byte short: the message never completes)
        self.sent = 0  # message bytes sent
        self.updates = 0  # WINDOW_UPDATE frames for the stream
        self.got: list = []

    def pump(self) -> None:
        for kind, flags, sid, payload in self.c.frames(0.01):
            self.got.append((kind, flags, sid, payload))
            if kind == SETTINGS and not flags & 1:
                for i in range(0, len(payload), 6):
                    k, v = struct.unpack(">HL", payload[i : i + 6])
                    if k == 4:
                        self.window += v - 65535
            elif kind == WINDOW_UPDATE:
                inc = struct.unpack(">L", payload)[0]
                if sid == 0:
                    self.conn_window += inc
                elif sid == self.sid:
                    self.window += inc
                    self.updates += 1
        out = []
        while (n := min(self.window, self.conn_window, self.left, 16384)) > 0:
            out.append(frame(DATA, 0, self.sid, b"\0" * n))
            self.window -= n
            self.conn_window -= n
            self.left -= n
            self.sent += n
        if out:
            self.c.send(b"".join(out))


def test_partial_messages_are_bounded_by_the_server_budget(small_budget: RunningServer) -> None:
    """5 connections each send a partial message of up to SMALL (10 MiB in all, each within
    its connection's own budget), then 8 more connections do the same. Past the server's
    budget (2 x SMALL here) no stream gets more window: the late ones are held at their
    first window (not failed), everything sent stays within the budget and the windows
    already given, and a valid client is answered. When the calls holding the budget end,
    the held streams get window at once, though nothing arrived on their connections."""
    budget = 2 * (SMALL + 5)

    def pump(holders: list[Holder], seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not all(h.updates for h in holders):
            for h in holders:
                h.pump()

    fillers = [Holder(small_budget.grpc_port) for _ in range(5)]
    late: list[Holder] = []
    try:
        pump(fillers, 1.0)
        late = [Holder(small_budget.grpc_port) for _ in range(8)]
        pump(late, 1.0)
        assert infer_ok(small_budget) < 5
        total = sum(h.sent for h in fillers + late)
        bound = budget + len(fillers) * (STREAM_WINDOW + INITIAL_WINDOW)
        assert total <= bound + len(late) * INITIAL_WINDOW, total
        assert [h.updates for h in late] == [0] * len(late)
        assert all(h.sent <= INITIAL_WINDOW for h in late)
        assert not [s for h in fillers + late for s in statuses(h.got).values()]
        # The calls holding the budget end (their connections close): the late ones,
        # which sent nothing since, are given window.
        for h in fillers:
            h.c.close()
        waited = [h.sent for h in late]
        pump(late, 1.5)
        assert all(h.updates for h in late), [h.updates for h in late]
        assert all(h.sent > w for h, w in zip(late, waited, strict=True))
        assert not [s for h in late for s in statuses(h.got).values()]
        assert infer_ok(small_budget) < 5
    finally:
        for h in fillers + late:
            h.c.close()


def test_a_malformed_server_budget_is_refused_naming_it() -> None:
    import subprocess
    import sys

    env = dict(__import__("os").environ, RTSERVE_H2_SERVER_BUFFER="256MiB")
    out = subprocess.run(
        [sys.executable, "-c", "import rtserve.server.grpc_h2"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode != 0
    assert "RTSERVE_H2_SERVER_BUFFER must be a number of bytes" in out.stderr
