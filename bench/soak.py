"""Soak: rtserve at ~70% of its capacity of valid requests, with hostile clients alongside.

    python -m bench.soak [--minutes 30] [--out docs/soak.md] [--plot docs/img/soak.png]

rtserve serves the example MLP; after a short closed-loop capacity measurement, an open-loop
client offers ``--load`` x capacity (Poisson) while hostile clients send malformed bodies,
slow-loris drips, disconnects, oversized heads, pipelined bursts and gzip bombs. Every
``--sample-s`` the server's RSS, descriptors and the window's p99 are recorded. A valid request
is *lost* without an answer or with a status other than 200, 503, 429 (503/429: *shed*). The
run passes when nothing is lost, every hostile client gets its expected answer, and RSS,
descriptors and p99 stay flat (last third's median within ``FLAT_TOLERANCE`` of the first's,
or an absolute slack). The clients run as child processes (``--role``), apart from the sampler.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime as dt
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import uvloop

from bench import machine, procs
from bench.clients.openloop import _Client, _Connection
from bench.procs import Server, cpu_seconds
from bench.report import markdown_table
from bench.workloads import ROOT, WORK

MODEL = "mlp"
INFER_PATH = f"/v2/models/{MODEL}/infer"
FLAT_TOLERANCE = 0.20
P99_SLACK_MS = 1.0
RSS_SLACK_MIB = 8.0
FDS_SLACK = 8
# Valid answers still missing this long after the last send are lost.
DRAIN_S = 30.0
# Connections of the open-loop client (a request waits in the client when all are busy).
VALID_CONNECTIONS = 256
# The open-loop client wakes at most this often.
TICK_S = 0.0005


def _valid_body() -> bytes:
    rng = np.random.default_rng(7)
    row = [round(float(v), 4) for v in rng.uniform(-1.0, 1.0, size=256)]
    return json.dumps(
        {"inputs": [{"name": "input", "shape": [1, 256], "datatype": "FP32", "data": row}]}
    ).encode()


def _post(path: str, body: bytes, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"{extra}Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


# ---------------------------------------------------------------------------- valid load
@dataclass
class _Window:
    sent: int = 0
    ok: int = 0
    shed: int = 0
    lost: int = 0
    latencies: list[float] = field(default_factory=list)


class _ValidConnection(_Connection):
    """Reads the body and the keep-alive of each answer; ``outcome`` names how it ended."""

    def __init__(self, client: _Client) -> None:
        super().__init__(client)
        self.body: list[bytes] = []
        self.outcome, self.keep = "broken answer", False

    def on_message_begin(self) -> None:
        self.body = []

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        self.outcome = str(status)
        if status == 200:
            self.outcome = "ok" if b'"outputs"' in b"".join(self.body) else "200 without outputs"
        elif status in (503, 429):
            self.outcome = "shed"
        self.keep = self.parser.should_keep_alive()
        self.client.finish(self, self.outcome == "ok")
        if not self.keep and self.transport is not None:
            self.transport.close()
        self.outcome, self.keep = "broken answer", False


class _ValidClient(_Client):
    """The open-loop client (``bench.clients.openloop``) counting each answer's outcome per
    sampling window: 200 with outputs, shed (503/429) or lost (anything else)."""

    connection = _ValidConnection

    def __init__(self, port: int, max_connections: int) -> None:
        super().__init__("127.0.0.1", port, _post(INFER_PATH, _valid_body()), max_connections)
        self.window = _Window()
        self.totals: collections.Counter[str] = collections.Counter()

    def submit(self, scheduled: float) -> None:
        self.totals["sent"] += 1
        self.window.sent += 1
        super().submit(scheduled)

    def _send(self, conn: _Connection, scheduled: float) -> None:
        conn.scheduled = scheduled
        self.busy.add(conn)
        if conn.transport is None or conn.transport.is_closing():
            self._end(conn, "connection closed before sending")
        else:
            conn.transport.write(self.request)

    def _end(self, conn: _Connection, outcome: str) -> None:
        conn.outcome, conn.keep = outcome, False  # type: ignore[attr-defined]
        self.finish(conn, False)

    def finish(self, conn: _Connection, ok: bool) -> None:
        if conn not in self.busy:
            return
        self.busy.discard(conn)
        outcome, w = cast(_ValidConnection, conn).outcome, self.window
        if ok:
            w.ok += 1
            w.latencies.append(time.perf_counter() - conn.scheduled)
        elif outcome == "shed":
            w.shed += 1
        else:
            w.lost += 1
            self.totals[f"lost: {outcome}"] += 1
        self.totals[outcome if outcome in ("ok", "shed") else "lost"] += 1
        if cast(_ValidConnection, conn).keep:
            self._release(conn)
        elif self.waiting and len(self.busy) + self.opening < self.max_connections:
            self.opening += 1
            self.loop.create_task(self._grow())

    def lost(self, conn: _Connection) -> None:
        if conn in self.busy:
            self._end(conn, "connection closed before the answer")
        with contextlib.suppress(ValueError):
            self.idle.remove(conn)

    def take_window(self) -> dict[str, Any]:
        w, self.window = self.window, _Window()
        lat = np.asarray(w.latencies) * 1000.0
        pct = (lambda q: round(float(np.percentile(lat, q)), 3)) if lat.size else (lambda q: None)
        return {"t": time.time(), "sent": w.sent, "ok": w.ok, "shed": w.shed, "lost": w.lost,
                "p50_ms": pct(50), "p99_ms": pct(99), "max_ms": pct(100),
                "connections": len(self.busy) + len(self.idle), "outstanding": self.outstanding}  # fmt: skip


def _emit(report: Path, record: dict[str, Any]) -> None:
    with report.open("a") as fh:
        fh.write(json.dumps(record) + "\n")


async def _run_valid(port: int, rate: float, duration_s: float, window_s: float, report: Path):
    # Every connection is opened up front: the server's descriptor count then reflects the
    # server, not the client growing its pool after a stall.
    client = _ValidClient(port, max_connections=VALID_CONNECTIONS)
    await client.open(VALID_CONNECTIONS)
    rng = np.random.default_rng(11)
    start = time.perf_counter()
    end = start + duration_s
    next_window = start + window_s
    next_arrival = start + rng.exponential(1.0 / rate)
    while True:
        now = time.perf_counter()
        while next_arrival <= now and next_arrival < end:
            client.submit(next_arrival)
            next_arrival += rng.exponential(1.0 / rate)
        if now >= next_window:
            _emit(report, client.take_window())
            next_window += window_s
        if next_arrival >= end:
            break
        # At least TICK_S between wake-ups: arrivals due meanwhile go out together (their
        # latency still counts from their own scheduled time), so the client's cost per
        # request does not grow with the rate.
        await asyncio.sleep(max(TICK_S, min(next_arrival, next_window) - time.perf_counter()))
    deadline = time.perf_counter() + DRAIN_S
    while client.outstanding and time.perf_counter() < deadline:
        await asyncio.sleep(0.01)
    _emit(report, {**client.take_window(), "drain": True})
    unanswered = client.outstanding
    totals = dict(client.totals)
    totals["lost"] = totals.get("lost", 0) + unanswered
    if unanswered:
        totals["lost: no answer within the drain"] = unanswered
    _emit(report, {"final": True, "rate": rate, "duration_s": duration_s,
                   "cpu_s": time.process_time(), **totals})  # fmt: skip


async def _run_capacity(port: int, seconds: float, connections: int, report: Path) -> None:
    """Closed loop: each connection sends its next request as soon as it has an answer."""
    client = _ValidClient(port, max_connections=connections)
    await client.open(connections)
    warm_end = time.perf_counter() + min(2.0, seconds / 4)
    measure_end = warm_end + seconds
    done: list[int] = [0, 0]

    def refill() -> None:
        while client.idle and time.perf_counter() < measure_end:
            client.submit(time.perf_counter())

    original = client.finish

    def finish(conn: _Connection, ok: bool) -> None:
        original(conn, ok)
        if warm_end <= time.perf_counter() < measure_end:
            done[0 if ok else 1] += 1
        refill()

    client.finish = finish  # type: ignore[method-assign]
    refill()
    while time.perf_counter() < measure_end:
        await asyncio.sleep(0.05)
    window = client.take_window()
    while client.outstanding and time.perf_counter() < measure_end + 10:
        await asyncio.sleep(0.01)
    _emit(
        report,
        {"capacity_rps": done[0] / seconds, "not_ok": done[1], "p99_ms": window["p99_ms"],
         "connections": connections, "seconds": seconds},
    )  # fmt: skip


# ---------------------------------------------------------------------------- hostile load
@dataclass(frozen=True)
class _Hostile:
    """One kind of hostile client: what it sends and which answers are the right ones.

    ``expected`` empty: no answer is expected (the client leaves before reading one)."""

    name: str
    what: str
    expected: frozenset[str]


async def _read_answer(reader: asyncio.StreamReader, timeout_s: float) -> str:
    """The status of the first answer ('closed' without one, 'timeout' if none came)."""
    try:
        line = await asyncio.wait_for(reader.readline(), timeout_s)
    except TimeoutError:
        return "timeout"
    except (ConnectionError, OSError):
        return "closed"
    parts = line.split()
    if len(parts) >= 2 and parts[0].startswith(b"HTTP/"):
        return parts[1].decode()
    return "closed"


async def _exchange(payload: bytes, timeout_s: float = 30.0) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", _HOSTILE_PORT[0])
    try:
        writer.write(payload)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        return await _read_answer(reader, timeout_s)
    except (ConnectionError, OSError):
        return "closed"
    finally:
        writer.transport.abort()


_HOSTILE_PORT = [0]
_BOMB: list[bytes] = []


def _bomb() -> bytes:
    """A gzip body of 128 MiB of zeros (~130 KB on the wire), built once."""
    if not _BOMB:
        comp = zlib.compressobj(9, zlib.DEFLATED, 31)
        chunk = b"\0" * (1 << 20)
        parts = [comp.compress(chunk) for _ in range(128)]
        parts.append(comp.flush())
        _BOMB.append(b"".join(parts))
    return _BOMB[0]


def _tensor(**fields: Any) -> bytes:
    entry = {"name": "input", "shape": [1, 256], "datatype": "FP32", "data": [0.5] * 256}
    entry.update(fields)
    return json.dumps({"inputs": [entry]}).encode()


async def _malformed(body: bytes, extra: str = "") -> str:
    return await _exchange(_post(INFER_PATH, body, extra))


async def _huge_bytes_shape() -> str:
    header = json.dumps(
        {"inputs": [{"name": "input", "shape": [1, 1 << 30], "datatype": "BYTES",
                     "parameters": {"binary_data_size": 0}}]}
    ).encode()  # fmt: skip
    return await _malformed(header, f"Inference-Header-Content-Length: {len(header)}\r\n")


async def _disconnect_mid_body() -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", _HOSTILE_PORT[0])
    body = _valid_body()
    writer.write(_post(INFER_PATH, body)[: -len(body) // 2])
    with contextlib.suppress(ConnectionError):
        await writer.drain()
    await asyncio.sleep(0.05)
    writer.transport.abort()
    return "left"


async def _cancelled() -> str:
    """A whole valid request, then gone before the answer (a reset, not a clean close)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", _HOSTILE_PORT[0])
    writer.write(_post(INFER_PATH, _valid_body()))
    with contextlib.suppress(ConnectionError):
        await writer.drain()
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
    writer.transport.abort()
    return "left"


async def _pipelined_burst() -> str:
    """20 inferences and 20 GETs in one write: all 40 must be answered, in order."""
    one = _post(INFER_PATH, _valid_body())
    get = b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", _HOSTILE_PORT[0])
    try:
        writer.write((one + get) * 20)
        await writer.drain()
        answers = 0
        deadline = time.monotonic() + 30
        while answers < 40 and time.monotonic() < deadline:
            status = await _read_answer(reader, deadline - time.monotonic())
            if not status.isdigit():
                break
            while True:  # the rest of the head, then the body
                line = await reader.readline()
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
                if line in (b"\r\n", b""):
                    break
            await reader.readexactly(length)
            if status not in ("200", "503"):
                return status
            answers += 1
        return "all answered" if answers == 40 else f"{answers} of 40 answered"
    except (ConnectionError, OSError, asyncio.IncompleteReadError):
        return "closed"
    finally:
        writer.transport.abort()


async def _pipelined_unread() -> str:
    """2,000 pipelined GETs whose answers are not read for 5 s (write backpressure)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", _HOSTILE_PORT[0])
    writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n" * 2000)
    with contextlib.suppress(ConnectionError):
        await writer.drain()
    await asyncio.sleep(5)
    writer.transport.abort()
    return "left"


_SMUGGLE = (f"POST {INFER_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
            "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n").encode()  # fmt: skip
HOSTILE: dict[str, tuple[_Hostile, Callable[[], Awaitable[str]]]] = {
    name: (_Hostile(name, what, frozenset(expected)), run) for name, what, expected, run in (
        ("bad_json", "body that is not JSON", ("400",), lambda: _malformed(b'{"inputs": [{"na')),
        ("wrong_shape", "shape [1, 255] with 256 values", ("400",), lambda: _malformed(_tensor(shape=[1, 255]))),
        ("wrong_dtype", "INT64 and BYTES for an FP32 input", ("400",), lambda: _malformed(_tensor(datatype="INT64"))),
        ("string_values", '"0.5", null and true as FP32 values', ("400",),
         lambda: _malformed(_tensor(data=["0.5", None, True] + [0.5] * 253))),
        ("wrong_name", "an input the model does not have", ("400",), lambda: _malformed(_tensor(name="nope"))),
        ("huge_shape", "FP32 shape [1, 2^30] with no data", ("400", "413"),
         lambda: _malformed(_tensor(shape=[1, 1 << 30], data=[]))),
        ("huge_bytes_shape", "binary BYTES shape [1, 2^30] with 0 data bytes", ("400", "413"), _huge_bytes_shape),
        ("oversized_header", "one 100 KB header", ("431",),
         lambda: _exchange(_post(INFER_PATH, _valid_body(), f"X-Big: {'a' * 100_000}\r\n"))),
        ("many_headers", "300 headers", ("431",),
         lambda: _exchange(_post(INFER_PATH, _valid_body(), "".join(f"X-H{i}: v\r\n" for i in range(300))))),
        ("long_url", "a 20 KB URL", ("414",), lambda: _exchange(_post(INFER_PATH + "?" + "q" * 20_000, _valid_body()))),
        ("smuggling", "Content-Length and Transfer-Encoding together", ("400",), lambda: _exchange(_SMUGGLE)),
        ("gzip_bomb", "130 KB of gzip expanding to 128 MiB", ("413",),
         lambda: _malformed(_bomb(), "Content-Encoding: gzip\r\n")),
        ("disconnect_mid_body", "half a body, then a reset", (), _disconnect_mid_body),
        ("cancelled", "a whole valid request, reset before its answer", (), _cancelled),
        ("pipelined_burst", "20 inferences + 20 GETs in one write, all read", ("all answered",), _pipelined_burst),
        ("pipelined_unread", "2,000 pipelined GETs never read for 5 s", (), _pipelined_unread),
    )
}  # fmt: skip
# Slow-loris: expected answers are the timeouts' 408s.
SLOW = {
    "slow_head": _Hostile("slow_head", "a header line every 2 s, never ending the head",
                          frozenset({"408"})),
    "slow_body_silent": _Hostile("slow_body_silent", "head and 10 body bytes, then silence",
                                 frozenset({"408"})),
    "slow_body_drip": _Hostile("slow_body_drip", "1 body byte every 5 s; leaves after 60 s",
                               frozenset({"408", "held"})),
}  # fmt: skip
# Kinds that are expensive for the server (or this client): sent at most this often (s).
_PERIOD_S = {"gzip_bomb": 30.0, "pipelined_unread": 10.0, "huge_bytes_shape": 1.0}


async def _slow_client(kind: str, running: Callable[[], bool],
                       record: Callable[[str, str, float], None]) -> None:  # fmt: skip
    drip_cap_s = 60.0
    while running():
        began = time.monotonic()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", _HOSTILE_PORT[0])
        except OSError:
            record(kind, "connect failed", 0.0)
            await asyncio.sleep(1)
            continue
        status = "held"
        try:
            if kind == "slow_head":
                writer.write(f"POST {INFER_PATH} HTTP/1.1\r\nHost: x\r\n".encode())
                step, chunk = 2.0, b"X-Slow: 1\r\n"
            else:
                writer.write(
                    f"POST {INFER_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: 4096\r\n\r\n"
                    .encode() + b"{" * 10
                )  # fmt: skip
                step, chunk = (5.0, b" ") if kind == "slow_body_drip" else (3600.0, b"")
            answer = asyncio.ensure_future(_read_answer(reader, drip_cap_s + 60))
            next_drip = time.monotonic() + step
            while time.monotonic() - began < drip_cap_s:
                done, _ = await asyncio.wait({answer}, timeout=min(step, 0.5))
                if done:
                    status = answer.result()
                    break
                if not running():
                    status = ""  # the soak ended first: not counted
                    break
                if chunk and time.monotonic() >= next_drip:
                    writer.write(chunk)
                    next_drip += step
            answer.cancel()
        except (ConnectionError, OSError):
            status = "closed"
        finally:
            writer.transport.abort()
        if status:
            record(kind, status, time.monotonic() - began)


async def _run_hostile(port: int, stop_file: Path, slow: int, report: Path) -> None:
    """Hostile clients until ``stop_file`` exists."""
    _HOSTILE_PORT[0] = port
    _bomb()
    began_cpu = time.process_time()

    def running() -> bool:
        return not stop_file.exists()

    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    held: dict[str, list[float]] = collections.defaultdict(list)

    def record(kind: str, status: str, seconds: float) -> None:
        counts[kind][status] += 1
        held[kind].append(seconds)

    last_sent: dict[str, float] = {}

    async def worker(offset: int) -> None:
        names = list(HOSTILE)
        i = offset
        while running():
            name = names[i % len(names)]
            i += 1
            period = _PERIOD_S.get(name)
            if period is not None:
                if time.monotonic() - last_sent.get(name, 0.0) < period:
                    continue
                last_sent[name] = time.monotonic()
            began = time.monotonic()
            try:
                status = await HOSTILE[name][1]()
            except OSError as exc:
                status = f"connect failed: {exc.__class__.__name__}"
            counts[name][status] += 1
            held[name].append(time.monotonic() - began)
            await asyncio.sleep(0.05)

    tasks = [worker(i * 5) for i in range(3)]
    per_kind = max(1, slow // len(SLOW))
    for kind in SLOW:
        tasks += [_slow_client(kind, running, record) for _ in range(per_kind)]
    await asyncio.gather(*tasks)
    _emit(
        report,
        {
            "final": True,
            "counts": {k: dict(v) for k, v in counts.items()},
            "held_max_s": {k: round(max(v), 3) for k, v in held.items() if v},
            "held_median_s": {k: round(statistics.median(v), 3) for k, v in held.items() if v},
            "cpu_s": time.process_time() - began_cpu,
        },
    )


# ---------------------------------------------------------------------------- the server
def _start_server(workdir: Path) -> tuple[Server, int]:
    server, ports = procs.rtserve(workdir, "--model-repository", str(ROOT / "examples" / "repository"),
                                  "--model-control-mode", "explicit", "--load-model", MODEL,
                                  "--log-level", "warning")  # fmt: skip
    port = int(ports["http_port"])
    server.wait_ready(f"http://127.0.0.1:{port}/v2/models/{MODEL}/ready", 60)
    return server, port


def _child(role: str, report: Path, *args: str) -> subprocess.Popen[bytes]:
    report.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "bench.soak", "--role", role, "--report", str(report), *args]
    return subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL)


def _records(report: Path) -> list[dict[str, Any]]:
    if not report.exists():
        return []
    return [json.loads(line) for line in report.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------- verdicts
def flatness(values: list[float], slack: float) -> dict[str, Any]:
    """First-third and last-third medians of a series and whether it stayed flat: the last
    third's median at most ``FLAT_TOLERANCE`` above the first's, or at most ``slack`` above it
    (an absolute floor, for small values that move by a few units)."""
    clean = [v for v in values if v is not None]
    if len(clean) < 3:
        return {"first": None, "last": None, "max": None, "change": None, "flat": None}
    third = len(clean) // 3
    first = statistics.median(clean[:third])
    last = statistics.median(clean[-third:])
    change = (last - first) / first if first else 0.0
    flat = last <= first * (1 + FLAT_TOLERANCE) or last - first <= slack
    return {"first": first, "last": last, "max": max(clean), "change": change, "flat": flat}


def summarize(
    samples: list[dict[str, Any]],
    windows: list[dict[str, Any]],
    valid: dict[str, Any],
    hostile: dict[str, Any],
) -> dict[str, Any]:
    skip = 1 if len(windows) > 3 else 0  # the first window holds the client's warm-up
    series = {
        "rss_mib": flatness([s["rss_mib"] for s in samples], RSS_SLACK_MIB),
        "fds": flatness([s["fds"] for s in samples], FDS_SLACK),
        "p99_ms": flatness([w["p99_ms"] for w in windows[skip:]], P99_SLACK_MS),
    }
    unexpected: dict[str, dict[str, int]] = {}
    for name, statuses in hostile.get("counts", {}).items():
        spec = HOSTILE[name][0] if name in HOSTILE else SLOW[name]
        allowed = spec.expected or {"left"}
        bad = {s: n for s, n in statuses.items() if s not in allowed}
        if bad:
            unexpected[name] = bad
    lost = int(valid.get("lost", 0))
    sent = int(valid.get("sent", 0))
    answered = int(valid.get("ok", 0))
    shed = int(valid.get("shed", 0))
    checks = {
        "0 valid requests lost": lost == 0 and sent == answered + shed,
        "hostile clients got the expected answers": not unexpected,
        **{f"{k} flat": bool(v["flat"]) for k, v in series.items()},
    }
    return {
        "sent": sent,
        "answered": answered,
        "shed": shed,
        "lost": lost,
        "lost_reasons": {k[6:]: v for k, v in valid.items() if k.startswith("lost: ")},
        "series": series,
        "unexpected": unexpected,
        "checks": checks,
        "passed": all(checks.values()),
    }


# ---------------------------------------------------------------------------- report
def _duration(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms" if seconds < 10 else f"{seconds:,.0f} s"


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def plot(samples: list[dict[str, Any]], windows: list[dict[str, Any]], t0: float, path: Path):
    """RSS, descriptors, latency and the machine's load over the run, one panel each."""
    from bench.plots import plt, save

    fig, axes = plt.subplots(4, 1, figsize=(9, 9.5), sharex=True)
    minutes = [(s["t"] - t0) / 60 for s in samples]
    axes[0].plot(minutes, [s["rss_mib"] for s in samples], color="black")
    axes[0].set_ylabel("server RSS (MiB)")
    axes[0].set_ylim(bottom=0)
    axes[1].plot(minutes, [s["fds"] for s in samples], color="tab:blue")
    axes[1].set_ylabel("open descriptors")
    axes[1].set_ylim(bottom=0)
    shown = [w for w in windows if w["p99_ms"] is not None and w["t"] - t0 >= 0]
    w_min = [(w["t"] - t0) / 60 for w in shown]
    axes[2].plot(w_min, [w["p99_ms"] for w in shown], color="tab:red", label="p99")
    axes[2].plot(w_min, [w["p50_ms"] for w in shown], color="tab:gray", label="p50")
    axes[2].set_ylabel("valid requests (ms)")
    axes[2].set_yscale("log")
    axes[2].legend(loc="upper right")
    axes[3].plot(minutes, [s["load1"] for s in samples], color="tab:purple",
                 label="load average (1 min)")  # fmt: skip
    axes[3].plot(minutes, [s["server_cpu"] for s in samples], color="tab:green",
                 label="server CPU (cores)")  # fmt: skip
    axes[3].set_ylim(bottom=0)
    axes[3].legend(loc="upper right")
    axes[3].set_xlabel("minutes")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle("rtserve soak: MLP at ~70% of capacity next to hostile clients")
    save(fig, path, dpi=100)


def markdown(run: dict[str, Any], plot_path: Path | None, out: Path) -> str:
    s, cap, before, after = run["summary"], run["capacity"], run["baseline"], run["after"]
    loads = [x["load1"] for x in run["samples"]]
    cores_s = run["minutes"] * 60 * (os.cpu_count() or 1)
    machine_rows = [*run["machine"].items(), ("load average at the end", run["load_end"]),
                    ("CPU seconds during the soak", ", ".join(f"{k} {v:,.0f}" for k, v in run["cpu_s"].items()
                     if v is not None) + f" (of {cores_s:,.0f} core-seconds)")]  # fmt: skip
    if loads:
        machine_rows.insert(-2, ("load average (1 min) during the run",
                                 f"median {statistics.median(loads):.2f}, max {max(loads):.2f}"))  # fmt: skip
    valid_rows = [
        (f"capacity (closed loop, {cap['connections']} connections, {cap['seconds']:g} s)",
         f"{cap['capacity_rps']:,.0f} req/s"),
        (f"offered (open loop, Poisson, {VALID_CONNECTIONS} connections)",
         f"{run['rate']:,.0f} req/s ({run['load']:.0%} of capacity)"),
        ("sent", f"{s['sent']:,}"), ("answered 200", f"{s['answered']:,}"),
        ("shed (503/429 with Retry-After; not lost, counted apart)", f"{s['shed']:,}"),
        ("**lost** (no answer, a broken answer, any other status)", f"**{s['lost']:,}**"),
        *[(f"lost: {reason}", f"{n:,}") for reason, n in s["lost_reasons"].items()],
    ]  # fmt: skip
    names = {
        "rss_mib": "server RSS (MiB)",
        "fds": "open descriptors",
        "p99_ms": "p99 of valid requests (ms)",
    }
    series = [(names[k], _fmt(v["first"], 2), _fmt(v["last"], 2),
               "-" if v["change"] is None else f"{v['change']:+.1%}", _fmt(v["max"], 2),
               "-" if v["flat"] is None else ("yes" if v["flat"] else "**no**"))
              for k, v in s["series"].items()]  # fmt: skip
    hostile, kinds = run["hostile"], [(n, HOSTILE[n][0]) for n in HOSTILE] + list(SLOW.items())
    medians, maxima = hostile.get("held_median_s", {}), hostile.get("held_max_s", {})
    hostile_rows = [
        (name, spec.what,
         ", ".join(f"{st}: {n:,}" for st, n in sorted(hostile.get("counts", {}).get(name, {}).items())) or "-",
         ", ".join(sorted(spec.expected)) or "none (leaves)",
         f"{_duration(medians[name])} / {_duration(maxima[name])}" if name in medians else "-")
        for name, spec in kinds
    ]  # fmt: skip
    log = run["server_log"]
    lines = [
        f"# Soak: {run['load']:.0%} load next to hostile clients", "",
        "rtserve serves the example MLP on 127.0.0.1 (default limits) while an open-loop client "
        "offers valid V2 JSON requests (Poisson) at ~70% of the capacity measured first, beside "
        "hostile clients (malformed bodies, slow-loris, disconnects, oversized heads, pipelined "
        "bursts, gzip bombs), all on one machine. `make soak`, i.e.:", "",
        "```bash", run["command"], "```", "",
        *([f"**Note:** {run['note']}", ""] if run.get("note") else []),
        f"**Result: {'PASS' if s['passed'] else 'FAIL'}** ({run['started']} UTC, {run['minutes']:g} minutes).", "",
        *markdown_table(["check", "result"], [(k, "pass" if v else "FAIL") for k, v in s["checks"].items()]),
        "", "## Machine", "", *markdown_table(["", ""], machine_rows),
        "", "A load average above the core count means other work competed for the cores: it shows "
        "in the latencies, not in the counts.",
        "", "## Valid requests", "", *markdown_table(["", ""], valid_rows),
        "", "## Flat over time", "",
        f"Over the samples (every {run['sample_s']:g} s; p99 per window, the first left out) the "
        f"last third's median is at most {FLAT_TOLERANCE:.0%} above the first third's, or within "
        f"{RSS_SLACK_MIB:g} MiB RSS, {FDS_SLACK} descriptors, {P99_SLACK_MS:g} ms p99.", "",
        *markdown_table(["series", "first third (median)", "last third (median)", "change", "max", "flat"], series),
        "", f"Server before the load: {before['rss_mib']:.1f} MiB RSS, {before['fds']:.0f} descriptors; "
        f"after the clients left: {after['rss_mib']:.1f} MiB, {after['fds']:.0f} descriptors; "
        f"peak RSS (VmHWM) {after['hwm_mib']:.1f} MiB.", "",
    ]  # fmt: skip
    if plot_path is not None:
        lines += [
            f"![RSS, descriptors and latency over the soak]({os.path.relpath(plot_path, out.parent)})",
            "",
        ]
    lines += [
        "## Hostile clients", "",
        "Three clients in turn through the kinds below, plus long-lived slow-loris connections; "
        "a client that leaves before its answer expects none.", "",
        *markdown_table(["kind", "what it sends", "answers seen", "expected",
                         "time to answer or close: median / max"], hostile_rows),
        "", "The head and body timeouts close `slow_head` and `slow_body_silent` with 408; a body "
        "dripping faster than `http_body_timeout_s` is held until the client leaves "
        "(`http_max_connections` bounds how many).",
        *(["", f"Unexpected answers: `{json.dumps(s['unexpected'])}`."] if s["unexpected"] else []),
        "", "## Server log", "",
        f"{log['lines']:,} lines at `--log-level warning`; {log['tracebacks']} tracebacks; {log['errors']} "
        f"ERROR lines. The server exited {log['exit']} after SIGTERM in {log['stop_s']:.1f} s.", "",
    ]  # fmt: skip
    return "\n".join(lines)


# ---------------------------------------------------------------------------- orchestration
def _end_child(proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    if proc is None:
        return
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def soak(args: argparse.Namespace) -> dict[str, Any]:
    """Start the server and the clients, sample, stop; the run's record (also in soak.json)."""
    workdir: Path = args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.UTC)
    facts = machine.facts()
    facts["rtserve source"] = machine.source_state()
    stop_file = workdir / "stop"
    stop_file.unlink(missing_ok=True)
    for stale in workdir.glob("*.jsonl"):
        stale.unlink()
    capacity_rec = workdir / "capacity.jsonl"
    valid_rec, hostile_rec = workdir / "valid.jsonl", workdir / "hostile.jsonl"
    duration = args.minutes * 60
    samples: list[dict[str, Any]] = []
    valid = hostile = None
    server, port = _start_server(workdir)
    try:
        time.sleep(1)
        baseline = procs.proc_status(server.pid)
        # The hostile clients run from before the capacity measurement to the end, so the
        # capacity is what the server sustains for valid requests next to them.
        hostile = _child("hostile", hostile_rec, "--port", str(port), "--stop-file",
                         str(stop_file), "--slow", str(args.slow))  # fmt: skip
        time.sleep(2)
        _child(
            "capacity", capacity_rec, "--port", str(port), "--seconds", str(args.capacity_s)
        ).wait()
        if not _records(capacity_rec):
            raise RuntimeError("the capacity measurement produced nothing")
        capacity = _records(capacity_rec)[-1]
        rate = capacity["capacity_rps"] * args.load
        print(f"soak: capacity {capacity['capacity_rps']:,.0f} req/s, offering {rate:,.0f} req/s "
              f"for {args.minutes:g} min", flush=True)  # fmt: skip
        t0 = time.time()
        cpu0 = cpu_seconds(server.pid)
        valid = _child("valid", valid_rec, "--port", str(port), "--rate", f"{rate:.1f}",
                       "--seconds", str(duration), "--sample-s", str(args.sample_s))  # fmt: skip
        next_sample = time.monotonic() + args.sample_s
        last_cpu, last_t = cpu0, t0
        while time.time() - t0 < duration and valid.poll() is None:
            time.sleep(max(0.0, next_sample - time.monotonic()))
            next_sample += args.sample_s
            now, cpu = time.time(), cpu_seconds(server.pid)
            sample = {"t": now, **procs.proc_status(server.pid), "load1": os.getloadavg()[0],
                      "server_cpu": (cpu - last_cpu) / (now - last_t)}  # fmt: skip
            last_cpu, last_t = cpu, now
            samples.append(sample)
        server_cpu_s = cpu_seconds(server.pid) - cpu0
        _end_child(valid, DRAIN_S + 30)
        stop_file.touch()
        _end_child(hostile, 90)
        time.sleep(min(5.0, 2 * args.sample_s))  # what the server holds once the clients left
        after = procs.proc_status(server.pid)
    finally:
        stop_file.touch()
        for child in (valid, hostile):
            if child is not None and child.poll() is None:
                child.kill()
        stop_began = time.monotonic()
        server.stop(grace_s=40)
        stop_s = time.monotonic() - stop_began
    log_text = (workdir / "server.log").read_text(errors="replace")
    windows = [r for r in _records(valid_rec) if not r.get("final") and not r.get("drain")]
    finals = [r for r in _records(valid_rec) if r.get("final")]
    valid_totals = finals[-1] if finals else {"lost": -1}
    hostile_final = (_records(hostile_rec) or [{}])[-1]
    summary = summarize(samples, windows, valid_totals, hostile_final)
    run = {
        "started": started.strftime("%Y-%m-%d %H:%M"),
        "command": args.command_line,
        "note": args.note,
        "minutes": args.minutes,
        "t0": t0,
        "load": args.load,
        "sample_s": args.sample_s,
        "machine": facts,
        "load_end": " / ".join(f"{v:.2f}" for v in os.getloadavg()),
        "capacity": capacity,
        "rate": rate,
        "baseline": baseline,
        "after": after,
        "cpu_s": {
            "server": server_cpu_s,
            "valid client": valid_totals.get("cpu_s"),
            "hostile clients": hostile_final.get("cpu_s"),
        },  # fmt: skip
        "samples": samples,
        "windows": windows,
        "valid": valid_totals,
        "hostile": hostile_final,
        "server_log": {
            "lines": len(log_text.splitlines()),
            "tracebacks": log_text.count("Traceback"),
            "errors": sum(1 for line in log_text.splitlines() if " ERROR " in line),
            "exit": server.proc.returncode,
            "stop_s": stop_s,
        },
        "summary": summary,
    }
    (workdir / "soak.json").write_text(json.dumps(run, indent=1))
    write_report(run, args.out, args.plot)
    return run


def write_report(run: dict[str, Any], out: Path | None, plot_path: Path | None) -> None:
    if plot_path:
        plot(run["samples"], run["windows"], run["t0"], plot_path)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(markdown(run, plot_path, out))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--minutes", type=float, default=30.0)
    add("--load", type=float, default=0.7, help="fraction of the capacity offered")
    add("--capacity-s", type=float, default=15.0, help="closed-loop capacity measurement")
    add("--sample-s", type=float, default=5.0)
    add("--slow", type=int, default=12, help="slow-loris connections")
    add("--out", type=Path, help="markdown report (e.g. docs/soak.md)")
    add("--plot", type=Path, help="PNG plot (e.g. docs/img/soak.png)")
    add("--note", default="", help="a line for the report")
    add("--workdir", type=Path, default=WORK / "soak", help="server log, client records, soak.json")
    add("--render", type=Path, help="write --out/--plot from this soak.json")
    for hidden in ("--role", "--report", "--port", "--rate", "--seconds", "--stop-file"):
        add(hidden, type={"--port": int, "--rate": float, "--seconds": float}.get(hidden, str),
            help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args(argv)
    if args.render:  # the report again from a finished run's record
        run = json.loads(args.render.read_text())
        if args.note:
            run["note"] = args.note
        write_report(run, args.out, args.plot)
        return 0
    if args.role == "valid":
        uvloop.run(_run_valid(args.port, args.rate, args.seconds, args.sample_s, Path(args.report)))
        return 0
    if args.role == "capacity":
        uvloop.run(_run_capacity(args.port, args.seconds, 32, Path(args.report)))
        return 0
    if args.role == "hostile":
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        uvloop.run(_run_hostile(args.port, Path(args.stop_file), args.slow, Path(args.report)))
        return 0
    args.command_line = "python -m bench.soak " + " ".join(argv or sys.argv[1:])
    run = soak(args)
    s = run["summary"]
    print(json.dumps({"passed": s["passed"], "checks": s["checks"], "sent": s["sent"],
                      "answered": s["answered"], "shed": s["shed"], "lost": s["lost"],
                      "unexpected": s["unexpected"]}))  # fmt: skip
    return 0 if s["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
