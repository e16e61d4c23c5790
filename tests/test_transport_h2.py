"""The pieces of the HTTP/2 gRPC transport, each without a socket: framing and the frame
dispatch table, flow-control windows, the receive side's bookkeeping (request bytes held,
windows given back), the budgets a client spends, a call's headers and messages. (tests/test_grpc_h2.py and tests/test_h2_budgets.py drive the whole transport.)"""

from __future__ import annotations

import asyncio
import gc
import struct
import weakref
import zlib

import grpc
import pytest
from hpack import Decoder, Encoder

from rtserve.errors import RTServeError
from rtserve.server.h2_budgets import (
    CONN_BUFFER,
    CONN_WINDOW,
    INITIAL_WINDOW,
    MAX_CALLS_PER_ADDRESS,
    REQUEST_STALL_S,
    STREAM_WINDOW,
    WINDOW_STALL_S,
    CallBudget,
    FrameBudget,
    _env_bytes,
    stall_limit,
)
from rtserve.server.h2_call import (
    OK,
    RESPONSE_HEAD,
    Abort,
    CallHeaders,
    Stream,
    inflate,
    metadata_bytes,
    parse_timeout,
    status_block,
)
from rtserve.server.h2_frames import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    MAX_FRAME,
    MAX_HEADER_BYTES,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    ConnectionError_,
    FrameReader,
    frame,
    read_increment,
    read_settings,
    settings_frame,
)
from rtserve.server.h2_receive import Receiver
from rtserve.server.h2_send import MAX_OUT_PENDING, Outbox
from rtserve.server.h2_windows import (
    MAX_WINDOW,
    MIN_SEND,
    ReceiveWindow,
    grown,
    send_size,
    window_increment,
)


class Recorder:
    """A FrameTarget that writes down what it is handed."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, int, bytes]] = []
        self.spent = 0.0

    def _note(self, name: str, flags: int, sid: int, payload: memoryview) -> None:
        self.seen.append((name, flags, sid, bytes(payload)))

    def on_data(self, flags: int, sid: int, payload: memoryview) -> None:
        self._note("data", flags, sid, payload)

    def on_header_block(self, sid: int, flags: int, block: memoryview) -> None:
        self._note("headers", flags, sid, block)

    def on_settings(self, flags: int, sid: int, payload: memoryview) -> None:
        self._note("settings", flags, sid, payload)

    def on_window_update(self, flags: int, sid: int, payload: memoryview) -> None:
        self._note("window_update", flags, sid, payload)

    def on_ping(self, flags: int, sid: int, payload: memoryview) -> None:
        self._note("ping", flags, sid, payload)

    def on_rst_stream(self, flags: int, sid: int, payload: memoryview) -> None:
        self._note("rst_stream", flags, sid, payload)

    def on_goaway(self, flags: int, sid: int, payload: memoryview) -> None:
        self._note("goaway", flags, sid, payload)

    def on_other(self, kind: int, sid: int, payload: memoryview) -> None:
        self._note(f"other:{kind}", 0, sid, payload)

    def spend(self, cost: float = 1.0) -> None:
        self.spent += cost


def _reader() -> tuple[FrameReader, Recorder]:
    target = Recorder()
    reader = FrameReader(target)
    reader.feed(PREFACE)
    return reader, target


def _code(exc: pytest.ExceptionInfo[ConnectionError_]) -> int:
    return exc.value.code


# ---------------------------------------------------------------------- frames and dispatch
def test_each_frame_type_goes_to_its_handler() -> None:
    reader, target = _reader()
    reader.feed(
        frame(DATA, END_STREAM, 1, b"abc")
        + frame(SETTINGS, 0, 0, b"")
        + frame(WINDOW_UPDATE, 0, 3, b"\0\0\0\1")
        + frame(PING, 0, 0, b"12345678")
        + frame(RST_STREAM, 0, 5, b"\0\0\0\0")
        + frame(GOAWAY, 0, 0, b"\0" * 8)
        + frame(PRIORITY, 0, 7, b"\0" * 5)
        + frame(0xEE, 0, 0, b"unknown types are ignored")
        + frame(HEADERS, END_HEADERS, 9, b"block")
    )
    assert [name for name, *_ in target.seen] == [
        "data", "settings", "window_update", "ping", "rst_stream", "goaway",
        f"other:{PRIORITY}", "other:238", "headers",
    ]  # fmt: skip
    assert target.seen[0] == ("data", END_STREAM, 1, b"abc")
    assert target.seen[-1] == ("headers", END_HEADERS, 9, b"block")


def test_frames_split_across_reads_are_reassembled() -> None:
    reader, target = _reader()
    wire = frame(DATA, 0, 1, b"x" * 100) + frame(DATA, 0, 1, b"y")
    for i in range(len(wire)):
        reader.feed(wire[i : i + 1])
    assert [p for *_, p in target.seen] == [b"x" * 100, b"y"]
    assert not reader.buf


def test_a_preface_arriving_in_pieces_is_accepted_and_a_wrong_one_refused() -> None:
    reader = FrameReader(Recorder())
    reader.feed(PREFACE[:5])
    assert not reader.preface_ok
    reader.feed(PREFACE[5:])
    assert reader.preface_ok
    with pytest.raises(ConnectionError_) as exc:
        FrameReader(Recorder()).feed(b"GET / HTTP/1.1\r\n")
    assert _code(exc) == PROTOCOL_ERROR


def test_a_frame_over_the_size_limit_is_refused_from_its_header() -> None:
    reader, _ = _reader()
    n = MAX_FRAME + 1
    with pytest.raises(ConnectionError_) as exc:
        reader.feed(struct.pack(">BHBBL", n >> 16, n & 0xFFFF, DATA, 0, 1))  # no payload yet
    assert _code(exc) == FRAME_SIZE_ERROR


def test_a_header_block_is_gathered_across_continuations() -> None:
    reader, target = _reader()
    reader.feed(frame(HEADERS, END_STREAM, 1, b"ab") + frame(CONTINUATION, 0, 1, b"cd"))
    assert not target.seen
    reader.feed(frame(CONTINUATION, END_HEADERS, 1, b"ef"))
    assert target.seen == [("headers", END_STREAM, 1, b"abcdef")]
    assert target.spent == 2  # each CONTINUATION spends the budget


def test_another_frame_inside_a_header_block_is_a_protocol_error() -> None:
    reader, _ = _reader()
    reader.feed(frame(HEADERS, 0, 1, b"ab"))
    with pytest.raises(ConnectionError_) as exc:
        reader.feed(frame(PING, 0, 0, b"12345678"))
    assert _code(exc) == PROTOCOL_ERROR
    reader, _ = _reader()
    reader.feed(frame(HEADERS, 0, 1, b"ab"))
    with pytest.raises(ConnectionError_):
        reader.feed(frame(CONTINUATION, END_HEADERS, 3, b"cd"))  # another stream


def test_a_header_block_past_its_limit_ends_the_connection() -> None:
    reader, _ = _reader()
    reader.feed(frame(HEADERS, 0, 1, b"x" * MAX_FRAME))
    with pytest.raises(ConnectionError_) as exc:
        reader.feed(frame(CONTINUATION, 0, 1, b"x" * (MAX_HEADER_BYTES - MAX_FRAME + 1)))
    assert _code(exc) == ENHANCE_YOUR_CALM


def test_headers_padding_and_stream_ids_are_checked() -> None:
    reader, target = _reader()
    reader.feed(frame(HEADERS, END_HEADERS | PADDED, 1, b"\x02blockPP"))
    assert target.seen == [("headers", END_HEADERS | PADDED, 1, b"block")]
    for bad in (
        frame(HEADERS, END_HEADERS, 2, b"x"),  # an even (server) stream id
        frame(HEADERS, END_HEADERS, 0, b"x"),
        frame(HEADERS, END_HEADERS | PADDED, 3, b"\x05ab"),  # padding past the frame
        frame(PUSH_PROMISE, END_HEADERS, 3, b"\0\0\0\2"),
    ):
        reader, _ = _reader()
        with pytest.raises(ConnectionError_) as exc:
            reader.feed(bad)
        assert _code(exc) == PROTOCOL_ERROR


def test_reading_stops_when_the_connection_closes() -> None:
    reader, target = _reader()

    def close_on_data(flags: int, sid: int, payload: memoryview) -> None:
        target.seen.append(("data", flags, sid, bytes(payload)))
        reader.stop()

    reader.table[DATA] = close_on_data
    reader.feed(frame(DATA, 0, 1, b"a") + frame(DATA, 0, 1, b"b"))
    assert len(target.seen) == 1


def test_a_stopped_reader_holds_no_reference_to_its_connection() -> None:
    reader, target = _reader()
    ref = weakref.ref(target)
    reader.stop()
    gc.disable()  # freed by reference counting alone, as a closed connection must be
    try:
        del target
        assert ref() is None
    finally:
        gc.enable()
    reader.feed(frame(DATA, 0, 1, b"late"))  # (ignored)


def test_settings_and_window_update_payloads() -> None:
    wire = settings_frame({3: 1024, 4: 65536})
    assert read_settings(memoryview(wire[9:])) == [(3, 1024), (4, 65536)]
    with pytest.raises(ConnectionError_) as exc:
        read_settings(memoryview(b"\0" * 7))
    assert _code(exc) == FRAME_SIZE_ERROR
    assert read_increment(memoryview(struct.pack(">L", 0x80000005))) == 5  # reserved bit
    with pytest.raises(ConnectionError_):
        read_increment(memoryview(b"\0\0\1"))


# ---------------------------------------------------------------------- windows
def test_the_receive_window_is_given_back_in_large_updates() -> None:
    window = ReceiveWindow(size=1000, update_at=400)
    window.consume(600)
    assert window.available == 400
    assert window.release(300) == 0  # not yet worth a frame
    assert window.release(100) == 400
    assert window.available == 800 and window.unacked == 0
    window.grow(200)
    window.consume(1000)
    with pytest.raises(ConnectionError_) as exc:
        window.consume(1)
    assert _code(exc) == FLOW_CONTROL_ERROR


def test_a_stream_window_is_given_back_once_worth_a_frame() -> None:
    target = 64 << 10
    # The handler took everything: the whole window back.
    assert window_increment(target, window=0, held=0, withheld=0, partial=False) == target
    # Less than a quarter owed: no frame...
    assert window_increment(target, window=target - 100, held=0, withheld=0, partial=False) == 0
    # ...unless a partial message waits for it (its sender cannot finish it otherwise).
    assert window_increment(target, window=target - 100, held=0, withheld=0, partial=True) == 100
    # Requests still queued for the handler, or a partial message waiting for room, are not
    # given back.
    assert window_increment(target, window=0, held=target, withheld=0, partial=False) == 0
    assert window_increment(target, window=0, held=0, withheld=target // 2, partial=True) == (
        target // 2
    )


def test_an_answer_is_sent_in_frames_the_windows_allow() -> None:
    assert send_size(100_000, 100_000, 16384, 50_000) == 16384  # the frame size
    assert send_size(1000, 100_000, 16384, 50_000) == 1000  # the stream's window
    assert send_size(100_000, 700, 16384, 50_000) == 700  # the connection's window
    assert send_size(MIN_SEND - 1, 100_000, 16384, 50_000) == 0  # too little: wait
    assert send_size(100, 100_000, 16384, 100) == 100  # ...unless it is all that is left
    assert send_size(-50, 100_000, 16384, 100) == 0  # a window shrunk by SETTINGS


def test_a_send_window_may_not_grow_past_its_maximum() -> None:
    assert grown(10, 5) == 15
    with pytest.raises(ConnectionError_) as exc:
        grown(MAX_WINDOW, 1)
    assert _code(exc) == FLOW_CONTROL_ERROR


# ---------------------------------------------------------------------- budgets
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_frames_without_progress_spend_a_budget_that_refills_with_time() -> None:
    clock = Clock()
    budget = FrameBudget(clock, burst=10, rate=2.0)
    for _ in range(10):
        budget.spend()
    with pytest.raises(ConnectionError_) as exc:
        budget.spend()
    assert _code(exc) == ENHANCE_YOUR_CALM
    budget = FrameBudget(clock, burst=10, rate=2.0)
    for _ in range(10):
        budget.spend()
    clock.now += 1.0  # two more frames' worth
    budget.spend()
    budget.spend()
    with pytest.raises(ConnectionError_):
        budget.spend()


def test_progress_earns_the_budget_back_up_to_its_burst() -> None:
    budget = FrameBudget(Clock(), burst=10, rate=0.0)
    for _ in range(10):
        budget.spend()
    budget.earn(4)
    assert budget.left == 4
    budget.earn(100)
    assert budget.left == 10


def test_too_many_resets_in_a_period_end_the_connection() -> None:
    budget = FrameBudget(Clock(), max_resets=3)
    for _ in range(3):
        budget.reset()
    budget.new_period()
    for _ in range(3):
        budget.reset()
    with pytest.raises(ConnectionError_) as exc:
        budget.reset()
    assert _code(exc) == ENHANCE_YOUR_CALM


def test_calls_are_capped_per_server_and_per_address() -> None:
    budget = CallBudget(max_calls=8, max_message=1000)
    assert budget.max_address_calls == 8 * MAX_CALLS_PER_ADDRESS // 10_000 == 2
    budget.begin("10.0.0.1")
    budget.begin("10.0.0.1")
    assert budget.refusal("10.0.0.1") == "too many calls in progress from this address"
    assert budget.refusal("10.0.0.2") is None
    for i in range(6):
        budget.begin(f"10.0.1.{i}")
    assert budget.refusal("10.0.0.9") == "too many calls in progress"
    budget.end("10.0.0.1")
    budget.end("10.0.0.1")
    assert "10.0.0.1" not in budget.by_address and budget.calls == 6


def test_the_server_buffer_holds_at_least_two_messages() -> None:
    budget = CallBudget(max_calls=8, max_message=1 << 30)
    assert budget.max_buffered == 2 * ((1 << 30) + 5)
    budget.buffered = budget.max_buffered
    assert not budget.full
    budget.buffered += 1
    assert budget.full


def test_a_request_without_window_may_stall_longer() -> None:
    assert stall_limit(True) == (REQUEST_STALL_S, "REQUEST_STALL_S")
    assert stall_limit(False) == (WINDOW_STALL_S, "WINDOW_STALL_S")


def test_a_malformed_byte_count_in_the_environment_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RTSERVE_TEST_BYTES", "12")
    assert _env_bytes("RTSERVE_TEST_BYTES", 5) == 12
    monkeypatch.setenv("RTSERVE_TEST_BYTES", "1GiB")
    with pytest.raises(RTServeError, match="RTSERVE_TEST_BYTES must be a number of bytes"):
        _env_bytes("RTSERVE_TEST_BYTES", 5)


# ---------------------------------------------------------------------- a call
def test_call_headers_separate_grpc_fields_from_metadata() -> None:
    encoder = Encoder()
    block = encoder.encode(
        [
            (":method", "POST"),
            (":path", "/inference.GRPCInferenceService/ModelInfer"),
            ("content-type", "application/grpc+proto"),
            ("te", "trailers"),
            ("grpc-timeout", "5S"),
            ("grpc-encoding", "gzip"),
            ("x-request-id", "r1"),
            ("trace-bin", "AQI"),
        ]
    )
    headers = CallHeaders(list(Decoder().decode(block, raw=True)))
    assert headers.is_grpc
    assert headers.path == b"/inference.GRPCInferenceService/ModelInfer"
    assert headers.timeout == b"5S" and headers.encoding == b"gzip"
    assert headers.metadata == [("x-request-id", "r1"), ("trace-bin", b"\x01\x02")]
    get = CallHeaders([(b":method", b"GET"), (b"content-type", b"application/grpc")])
    assert not get.is_grpc and not get.post
    assert not CallHeaders([(b":method", b"POST"), (b"content-type", b"text/plain")]).is_grpc


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(b"5S", 5.0), (b"100m", 0.1), (b"2H", 7200.0), (b"12345678n", 0.012345678)],
)
def test_grpc_timeouts_are_read_in_seconds(value: bytes, seconds: float) -> None:
    assert parse_timeout(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", [b"S", b"123456789S", b"5s", b"-5S", b"5"])
def test_a_malformed_grpc_timeout_is_none(value: bytes) -> None:
    assert parse_timeout(value) is None


def test_answer_header_blocks_decode_without_encoder_state() -> None:
    decoder = Decoder()
    assert decoder.decode(RESPONSE_HEAD) == [
        (":status", "200"),
        ("content-type", "application/grpc"),
        ("grpc-accept-encoding", "identity,deflate,gzip"),
    ]
    block = status_block(3, "bad 'x': 100%\n", metadata_bytes([("k-bin", b"\xff"), ("k", "v")]))
    assert Decoder().decode(OK + block) == [
        ("grpc-status", "0"),
        ("grpc-status", "3"),
        ("grpc-message", "bad 'x': 100%25%0A"),
        ("k-bin", "/w"),
        ("k", "v"),
    ]


def test_a_compressed_message_is_inflated_within_the_limit() -> None:
    gzip = 16 + zlib.MAX_WBITS
    packed = zlib.compressobj(wbits=gzip)
    data = packed.compress(b"x" * 1000) + packed.flush()
    assert inflate(data, gzip, 1000) == b"x" * 1000
    with pytest.raises(Abort) as exc:
        inflate(data, gzip, 999)  # a bomb is cut off at the limit
    assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(Abort) as exc:
        inflate(b"not gzip", gzip, 1000)
    assert exc.value.code == grpc.StatusCode.INTERNAL
    with pytest.raises(Abort):
        inflate(data[:-4], gzip, 1000)  # cut short


# ---------------------------------------------------------------------- answers and windows
def _stream(send_window: int = 65535) -> Stream:
    return Stream(1, 65535, send_window)


def test_an_answer_within_the_windows_goes_out_at_once() -> None:
    outbox, sent = Outbox(), []
    st = _stream()
    assert outbox.data(st, b"x" * 100, sent.append) == (1, False)
    assert sent == [frame(DATA, 0, 1, b"x" * 100)]
    assert st.send_window == 65535 - 100 and outbox.window == 65535 - 100
    assert outbox.headers(st, b"trailers", True, sent.append)  # sent, and it ends the stream


def test_an_answer_waits_for_window_and_its_trailers_wait_behind_it() -> None:
    outbox, sent = Outbox(), []
    st = _stream(send_window=100)
    assert outbox.data(st, b"x" * 1000, sent.append) == (0, False)  # under MIN_SEND: waits
    assert st in outbox.blocked and st.pending_bytes == 1000 and not st.queued
    assert not outbox.headers(st, b"trailers", True, sent.append)  # behind the data
    st.send_window += 2000  # a WINDOW_UPDATE
    assert outbox.drain(st, sent.append) == (2, True)
    assert sent == [frame(DATA, 0, 1, b"x" * 1000), b"trailers"]
    assert st not in outbox.blocked and not st.pending


def test_an_answer_held_by_the_connection_window_waits_its_turn() -> None:
    outbox, sent = Outbox(), []
    outbox.window = 100
    st = _stream()
    outbox.data(st, b"x" * 1000, sent.append)
    assert st.queued and list(outbox.ready) == [st] and not sent
    outbox.window += 600
    assert outbox.drain(st, sent.append) == (1, False)  # 700 of 1000, in one frame
    assert sent == [frame(DATA, 0, 1, b"x" * 700)] and st.pending_bytes == 300


def test_a_large_answer_is_cut_to_the_peer_frame_size() -> None:
    outbox, sent = Outbox(), []
    outbox.window = 1 << 20
    st = _stream(send_window=1 << 20)
    assert outbox.data(st, b"x" * 40000, sent.append) == (3, False)
    assert [len(f) - 9 for f in sent] == [16384, 16384, 40000 - 2 * 16384]


def test_a_handler_waiting_for_its_queue_is_woken_once_it_shrinks() -> None:
    async def run() -> bool:
        outbox, sent = Outbox(), []
        st = _stream(send_window=0)
        outbox.data(st, b"x" * (MAX_OUT_PENDING + 1), sent.append)
        st.drained = asyncio.get_running_loop().create_future()
        waiter = st.drained
        st.send_window = outbox.window = 1 << 30
        outbox.max_frame = 1 << 24
        outbox.drain(st, sent.append)
        return waiter.done() and st.drained is None

    assert asyncio.run(run())


def test_a_settings_change_moves_every_stream_window() -> None:
    outbox = Outbox()
    streams = {1: _stream(100), 3: _stream(50)}
    outbox.initial_window(streams, -80)
    assert [st.send_window for st in streams.values()] == [20, -30]
    st = streams[3]
    outbox.data(st, b"x" * 10, [].append)
    outbox.drop(st)
    assert st not in outbox.blocked and not st.pending and st.pending_bytes == 0


# ---------------------------------------------------------------------- the receive side
class Conn:
    """The connection as the receive side sees it: its streams, the frames it sends."""

    def __init__(self) -> None:
        self.closed = False
        self.streams: dict[int, Stream] = {}
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)

    def updates(self) -> list[tuple[int, int]]:
        """The WINDOW_UPDATEs sent since the last look: (stream, increment)."""
        out = []
        for data in self.sent:
            kind, sid = data[3], struct.unpack(">I", data[5:9])[0] & 0x7FFFFFFF
            assert kind == WINDOW_UPDATE
            out.append((sid, struct.unpack(">I", data[9:13])[0]))
        self.sent.clear()
        return out


class Server:
    """The server as the receive side sees it: the shared budget, the held connections."""

    def __init__(self, max_message: int = 1 << 20) -> None:
        self.budget = CallBudget(10, max_message)
        self.held: dict[object, None] = {}
        self.woken = 0

    def wake(self) -> None:
        self.woken += 1


def _receiver() -> tuple[Receiver, Conn, Server]:
    conn, server = Conn(), Server()
    return Receiver(conn, server), conn, server


def _open(conn: Conn, sid: int) -> Stream:
    st = conn.streams[sid] = Stream(sid, INITIAL_WINDOW, 65535)
    return st


def _partial(recv: Receiver, st: Stream, n: int) -> None:
    """``n`` bytes of a message not yet whole arrive on ``st``."""
    assert recv.received(st, n)
    st.buf += b"x" * n
    recv.buffer(st, n)


def test_the_connection_window_is_granted_once_and_given_back_in_large_updates() -> None:
    recv, conn, _ = _receiver()
    recv.grant()
    assert recv.granted and conn.updates() == [(0, CONN_WINDOW - 65535)]
    st = _open(conn, 1)
    recv.inbound.consume(1000)
    assert recv.received(st, 1000) and (st.recv_window, st.unreleased) == (
        INITIAL_WINDOW - 1000,
        1000,
    )
    recv.buffer(st, 1000)
    recv.unary_taken(st)  # the one message went to the handler
    assert (st.buffered, recv.buffered, st.unreleased) == (0, 0, 0)
    assert conn.updates() == [] and recv.inbound.unacked == 1000  # not yet worth a frame
    recv.conn_credit(CONN_WINDOW // 4)
    assert conn.updates() == [(0, CONN_WINDOW // 4 + 1000)]
    conn.closed = True
    recv.conn_credit(CONN_WINDOW)  # a closed connection gives nothing back
    assert conn.updates() == []


def test_data_past_a_streams_window_is_refused() -> None:
    recv, conn, _ = _receiver()
    st = _open(conn, 1)
    assert recv.received(st, INITIAL_WINDOW)
    assert not recv.received(st, 1)


def test_one_partial_message_leads_and_the_others_wait_for_room_in_turn() -> None:
    recv, conn, _ = _receiver()
    first, second = _open(conn, 1), _open(conn, 3)
    _partial(recv, first, 60_000)
    recv.credit(first)  # the leader: its window grows to STREAM_WINDOW
    assert recv.leader is first
    # (and the connection's window for what it received)
    assert conn.updates() == [(1, STREAM_WINDOW - 5_536), (0, 60_000)]
    queued = _open(conn, 5)  # whole messages queued for a streaming handler
    queued.held = CONN_BUFFER
    recv.buffer(queued, CONN_BUFFER)  # the connection now holds past CONN_BUFFER
    _partial(recv, second, 1000)
    recv.credit(second)  # no room: it waits, its bytes not given back
    assert second.waits and list(recv.waiting) == [second] and conn.updates() == []
    # The leader's message is whole and taken: the waiting one gets its window.
    first.buf.clear()
    recv.buffer(first, -first.buffered)
    recv.promote()
    assert not second.waits and not recv.waiting
    assert conn.updates() == [(3, STREAM_WINDOW - (INITIAL_WINDOW - 1000))]
    assert recv.leader is second


def test_past_the_server_budget_a_connection_is_held_and_room_wakes_the_server() -> None:
    recv, conn, server = _receiver()
    st = _open(conn, 1)
    server.budget.buffered = server.budget.max_buffered  # other connections hold it all
    _partial(recv, st, 1000)
    recv.credit(st)
    assert server.held == {conn: None} and list(recv.waiting) == [st]
    assert conn.updates() == []
    server.budget.buffered -= 2000  # another connection's handler took a message
    recv.buffer(st, -1)  # room made here too: the server looks at the held connections
    assert server.woken == 1


def test_a_streaming_message_taken_gives_its_window_back_and_a_stream_end_releases_all() -> None:
    recv, conn, server = _receiver()
    st = _open(conn, 1)
    recv.received(st, 40_000)
    st.held = 40_000  # four whole messages queued for the handler
    recv.buffer(st, 40_000)
    recv.credit(st)
    assert conn.updates() == []  # queued requests are not given back
    recv.taken(st, 30_000)
    assert conn.updates() == [(1, 30_000)] and st.held == 10_000
    recv.end(st)
    assert (recv.buffered, server.budget.buffered, st.unreleased) == (0, 0, 0)
    assert conn.updates() == [(0, 40_000)]  # every byte received back to the connection
