"""Hostile HTTP/2 clients against rtserve's gRPC transport, written frame by frame, and a
valid client calling ``ServerLive`` beside them; ``tests/test_h2_budgets.py`` asserts on how
each attack is bounded. (The measuring ``bench.h2_attacks`` whose figures are in
``bench/results/security.md`` is retired: it is in the tree at commit 33a12e5.)
"""

from __future__ import annotations

import socket
import struct
import threading
import time
import urllib.request
import zlib
from collections.abc import Callable

import grpc
import numpy as np
from hpack import Encoder

from bench import procs

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH, PING, GOAWAY, WINDOW_UPDATE = range(9)
CONTINUATION = 9
END_STREAM, END_HEADERS = 0x1, 0x4
ENHANCE_YOUR_CALM = 11
SERVICE = "/inference.GRPCInferenceService/"
USER = "user-token-0123456789abcdef"  # may use model "a"
ADMIN = "admin-token-0123456789abcdef"


def frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return struct.pack(">BHBBL", n >> 16, n & 0xFFFF, kind, flags, sid) + payload


def grpc_message(message: bytes, compressed: int = 0) -> bytes:
    return struct.pack(">BL", compressed, len(message)) + message


def infer_message(model: str = "a", value: float = 1.0) -> bytes:
    from rtserve.protocol import grpc_service_pb2 as pb

    r = pb.ModelInferRequest(model_name=model)
    r.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    r.raw_input_contents.append(np.full((1, 4), value, np.float32).tobytes())
    return r.SerializeToString()


class Raw:
    """One HTTP/2 connection written by hand (no client state machine: it sends what it is
    told), reading the server's frames on demand."""

    def __init__(self, port: int, source: str | None = None, window: int | None = None) -> None:
        self.sock = socket.create_connection(
            ("127.0.0.1", port), timeout=10, source_address=(source, 0) if source else None
        )
        self.enc = Encoder()
        self.sid = -1
        self.sent = 0
        self.inbuf = b""
        settings = b"" if window is None else struct.pack(">HL", 4, window)
        self.send(PREFACE + frame(SETTINGS, 0, 0, settings))

    def send(self, data: bytes) -> None:
        try:
            self.sock.settimeout(10)  # (a partial write would leave the stream mid-frame)
            self.sock.sendall(data)
        except OSError:
            return  # closed by the server
        self.sent += len(data)

    def headers(self, method: str, key: str | None = USER, extra: tuple = ()) -> tuple[int, bytes]:
        """(stream id, a HEADERS block starting a call) to send."""
        self.sid += 2
        fields = [
            (":method", "POST"), (":scheme", "http"), (":path", SERVICE + method),
            (":authority", "x"), ("te", "trailers"), ("content-type", "application/grpc"),
            *([("authorization", f"Bearer {key}")] if key else []), *extra,
        ]  # fmt: skip
        return self.sid, self.enc.encode(fields)

    def call_frames(
        self, method: str, body: bytes | None, key: str | None = USER, extra: tuple = ()
    ) -> tuple[int, bytes]:
        """(stream id, the frames of a call: headers, and ``body`` ending the request)."""
        sid, block = self.headers(method, key, extra)
        out = frame(HEADERS, END_HEADERS | (END_STREAM if body is None else 0), sid, block)
        if body is not None:
            out += frame(DATA, END_STREAM, sid, body)
        return sid, out

    def frames(
        self, timeout: float = 0.2, first: bool = False
    ) -> list[tuple[int, int, int, bytes]]:
        """The frames that arrive within ``timeout`` (or until the connection closes;
        ``first``: until some arrive)."""
        got: list[tuple[int, int, int, bytes]] = []
        self.sock.settimeout(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not (first and got):
            try:
                chunk = self.sock.recv(1 << 20)
            except (TimeoutError, OSError):
                break
            if not chunk:
                break
            self.inbuf += chunk
            while len(self.inbuf) >= 9:
                n = int.from_bytes(self.inbuf[:3], "big")
                if len(self.inbuf) < 9 + n:
                    break
                kind, flags, sid = (
                    self.inbuf[3],
                    self.inbuf[4],
                    struct.unpack(">L", self.inbuf[5:9])[0],
                )
                got.append((kind, flags, sid, self.inbuf[9 : 9 + n]))
                self.inbuf = self.inbuf[9 + n :]
        return got

    def close(self) -> None:
        self.sock.close()


def goaway_code(frames: list[tuple[int, int, int, bytes]]) -> int | None:
    for kind, _, _, payload in frames:
        if kind == GOAWAY:
            return int(struct.unpack(">L", payload[4:8])[0])
    return None


def drain(c: Raw, seconds: float = 5.0) -> list[tuple[int, int, int, bytes]]:
    """Read until GOAWAY, close, or ``seconds``."""
    got: list[tuple[int, int, int, bytes]] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        more = c.frames(0.3)
        got += more
        if goaway_code(got) is not None or (not more and _closed(c)):
            break
    return got


def _closed(c: Raw) -> bool:
    try:
        c.sock.settimeout(0.01)
        return c.sock.recv(1, socket.MSG_PEEK) == b""
    except (TimeoutError, BlockingIOError):
        return False
    except OSError:
        return True


# ---------------------------------------------------------------------------- floods
# Each: (port) -> (bytes sent, frames the server sent back). Frames are written in batches
# so that the server reads many per system call, as a real flood does.


def flood(
    port: int, setup: Callable[[Raw], bytes], one: Callable[[Raw, int], bytes], count: int
) -> tuple[int, list]:
    c = Raw(port)
    try:
        c.send(setup(c))
        batch = 500
        for i in range(0, count, batch):
            c.send(b"".join(one(c, i + j) for j in range(batch)))
        return c.sent, drain(c)
    finally:
        c.close()


def _stream(c: Raw) -> bytes:
    """A ModelStreamInfer call left open (the floods that need a stream use it)."""
    sid, block = c.headers("ModelStreamInfer")
    return frame(HEADERS, END_HEADERS, sid, block)


FLOODS: dict[str, tuple[Callable[[Raw], bytes], Callable[[Raw, int], bytes]]] = {
    "PING": (lambda c: b"", lambda c, i: frame(PING, 0, 0, struct.pack(">Q", i))),
    "PRIORITY": (lambda c: b"", lambda c, i: frame(PRIORITY, 0, 3, b"\0\0\0\1\x10")),
    "SETTINGS": (lambda c: b"", lambda c, i: frame(SETTINGS, 0, 0)),
    "WINDOW_UPDATE(+1)": (lambda c: b"", lambda c, i: frame(WINDOW_UPDATE, 0, 0, b"\0\0\0\1")),
    "empty DATA (key)": (_stream, lambda c, i: frame(DATA, 0, 1, b"")),
    "empty CONTINUATION": (
        lambda c: frame(HEADERS, 0, 1, c.headers("ServerLive", None)[1]),
        lambda c, i: frame(CONTINUATION, 0, 1, b""),
    ),
    "RST_STREAM": (lambda c: b"", lambda c, i: frame(RST_STREAM, 0, 1 + 2 * i, b"\0\0\0\x08")),
    "unknown frame type": (lambda c: b"", lambda c, i: frame(0x20, 0, 0, b"x")),
}


def blocked_answers(port: int, streams: int = 1000) -> Raw:
    """A connection whose ``streams`` ServerLive answers wait: its stream window is 0."""
    c = Raw(port, window=0)
    c.send(
        b"".join(
            c.call_frames("ServerLive", grpc_message(b""), key=None)[1] for _ in range(streams)
        )
    )
    c.frames(0.5)
    return c


def window_update_flood(port: int, count: int = 50_000) -> tuple[int, list]:
    """WINDOW_UPDATE(+1) on the connection while 1000 answers wait for window."""
    c = blocked_answers(port)
    try:
        one = frame(WINDOW_UPDATE, 0, 0, b"\0\0\0\1")
        for _ in range(count // 1000):
            c.send(one * 1000)
        return c.sent, drain(c)
    finally:
        c.close()


def settings_window_flood(port: int, count: int = 20_000) -> tuple[int, list]:
    """SETTINGS_INITIAL_WINDOW_SIZE 0 / 1 alternating while 1000 answers wait for window."""
    c = blocked_answers(port)
    try:
        pair = frame(SETTINGS, 0, 0, struct.pack(">HL", 4, 1)) + frame(
            SETTINGS, 0, 0, struct.pack(">HL", 4, 0)
        )
        for _ in range(count // 1000):
            c.send(pair * 500)
        return c.sent, drain(c)
    finally:
        c.close()


def partial_messages(
    port: int,
    streams: int = 60,
    key: str | None = None,
    seconds: float = 3.0,
    declared: int = 60 << 20,
) -> tuple[int, list]:
    """``streams`` unary calls whose prefix declares ``declared`` bytes, each sent as far
    as the server gives window, never finished; returns (bytes sent, frames back)."""
    c = Raw(port)
    chunk = b"\0" * 16384
    windows: dict[int, int] = {}
    left: dict[int, int] = {}  # bytes to send before the message would be complete
    conn_window = 65535
    got: list = []
    try:
        out = []
        for _ in range(streams):
            sid, block = c.headers("ModelInfer", key)
            out.append(frame(HEADERS, END_HEADERS, sid, block))
            out.append(frame(DATA, 0, sid, struct.pack(">BL", 0, declared)))
            windows[sid] = 65535 - 5
            left[sid] = declared - 1
        c.send(b"".join(out))
        conn_window -= 5 * streams
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for kind, flags, sid, payload in c.frames(0.05):
                got.append((kind, flags, sid, payload))
                if kind == SETTINGS and not flags & 1:
                    for i in range(0, len(payload), 6):
                        k, v = struct.unpack(">HL", payload[i : i + 6])
                        if k == 4:
                            windows = {s: w + v - 65535 for s, w in windows.items()}
                elif kind == WINDOW_UPDATE:
                    inc = struct.unpack(">L", payload)[0]
                    if sid == 0:
                        conn_window += inc
                    elif sid in windows:
                        windows[sid] += inc
                elif kind in (RST_STREAM, HEADERS) and sid in windows:
                    del windows[sid]
            out = []
            for sid in list(windows):
                room = windows[sid]
                while room >= 16384 and conn_window >= 16384 and left[sid] >= 16384:
                    out.append(frame(DATA, 0, sid, chunk))
                    room -= 16384
                    conn_window -= 16384
                    left[sid] -= 16384
                windows[sid] = room
            if out:
                c.send(b"".join(out))
            if goaway_code(got) is not None:
                break
        return c.sent, got
    finally:
        c.close()


def gzip_bombs(port: int, count: int = 20, key: str | None = None) -> tuple[int, list]:
    """``count`` gzip-compressed ModelInfer messages of 64 MiB of zeros (~65 KB each)."""
    bomb = zlib.compress(b"\0" * (64 << 20), 9)
    c = Raw(port)
    try:
        for _ in range(count):
            sid, block = c.headers("ModelInfer", key, (("grpc-encoding", "deflate"),))
            c.send(frame(HEADERS, END_HEADERS, sid, block))
            body = grpc_message(bomb, 1)
            for i in range(0, len(body), 16384):
                end = END_STREAM if i + 16384 >= len(body) else 0
                c.send(frame(DATA, end, sid, body[i : i + 16384]))
        return c.sent, drain(c, 3.0)
    finally:
        c.close()


def made_you_reset(port: int, calls: int = 10_100, model: str = "a") -> tuple[int, list]:
    """Calls that end their request, then a WINDOW_UPDATE of 0 on the stream: the server
    resets them itself (CVE-2025-8671)."""
    c = Raw(port)
    body = grpc_message(infer_message(model))
    try:
        for _ in range(0, calls, 100):
            out = []
            for _ in range(100):
                sid, frames = c.call_frames("ModelInfer", body)
                out.append(frames + frame(WINDOW_UPDATE, 0, sid, b"\0\0\0\0"))
            c.send(b"".join(out))
        return c.sent, drain(c)
    finally:
        c.close()


# ---------------------------------------------------------------------------- the server side
cpu_s = procs.cpu_seconds


def rss_mb(pid: int) -> float:
    return procs.proc_status(pid)["rss_mib"]


class Victim:
    """A valid client calling ``ServerLive`` (and, given ``http``, the server's HTTP
    ``/v2/health/live``), sampling the server's RSS, in a thread."""

    def __init__(self, address: str, pid: int, http: str | None = None) -> None:
        self.address, self.pid, self.http = address, pid, http
        self.latencies: list[float] = []
        self.http_latencies: list[float] = []
        self.errors: list[str] = []
        self.rss_peak = self.rss_base = rss_mb(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Victim:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        deadline = time.monotonic() + 10  # (a few calls at least, after a short attack)
        while len(self.latencies) + len(self.errors) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        from rtserve.protocol import grpc_service_pb2 as pb

        with grpc.insecure_channel(self.address) as channel:
            live = channel.unary_unary(
                SERVICE + "ServerLive",
                request_serializer=pb.ServerLiveRequest.SerializeToString,
                response_deserializer=pb.ServerLiveResponse.FromString,
            )
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    live(pb.ServerLiveRequest(), timeout=10)
                    self.latencies.append(time.perf_counter() - t0)
                except grpc.RpcError as exc:
                    self.errors.append(str(exc.code()))
                if self.http is not None:
                    t0 = time.perf_counter()
                    try:
                        with urllib.request.urlopen(f"{self.http}/v2/health/live", timeout=10):
                            self.http_latencies.append(time.perf_counter() - t0)
                    except OSError as exc:
                        self.errors.append(f"HTTP: {exc}")
                self.rss_peak = max(self.rss_peak, rss_mb(self.pid))
                time.sleep(0.02)

    def median(self, http: bool = False) -> float:
        s = sorted(self.http_latencies if http else self.latencies)
        return s[len(s) // 2] if s else float("inf")
