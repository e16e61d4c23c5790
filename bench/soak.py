"""Soak: rtserve at ~70% of its capacity of valid requests, with hostile clients alongside.

    python -m bench.soak [--minutes 30] [--out docs/soak.md] [--plot docs/img/soak.png]

rtserve serves the example MLP. After a closed-loop capacity measurement (wrk), an open-loop
client offers 70% of it (Poisson) while hostile clients send malformed bodies, slow-loris
drips, disconnects, oversized heads, pipelined bursts and gzip bombs. A valid request is
*lost* without an answer or with a status other than 200, 503, 429 (503/429: *shed*). The run
passes when nothing is lost, every hostile client gets its expected answer, and the server's
RSS, descriptors and the p99 stay flat. The clients run as child processes (``--role``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime as dt
import functools
import itertools
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import uvloop

from bench import machine, procs, results
from bench.clients import wrk
from bench.clients.openloop import _Client, _Connection
from bench.procs import cpu_seconds
from bench.report import markdown_table
from bench.results import Measurement
from bench.workloads import ROOT, WORK

MODEL = "mlp"
INFER_PATH = f"/v2/models/{MODEL}/infer"
LOAD = 0.7  # the share of the capacity offered
CAPACITY_CONNECTIONS = 32
VALID_CONNECTIONS = 256  # of the open-loop client (a request waits in it when all are busy)
TICK_S = 0.0005  # the open-loop client wakes at most this often
DRAIN_S = 30.0  # valid answers still missing this long after the last send are lost
# Flat: the last third's median at most FLAT_TOLERANCE above the first third's, or at most
# the series' slack above it (for small values that move by a few units).
FLAT_TOLERANCE = 0.20
SLACK = {"rss_mib": 8.0, "fds": 8, "p99_ms": 1.0}


def _valid_body() -> bytes:
    row = [round(float(v), 4) for v in np.random.default_rng(7).uniform(-1.0, 1.0, size=256)]
    return _tensor(data=row)


def _tensor(**fields: Any) -> bytes:
    entry = {"name": "input", "shape": [1, 256], "datatype": "FP32", "data": [0.5] * 256}
    return json.dumps({"inputs": [{**entry, **fields}]}).encode()


def _post(path: str, body: bytes, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"{extra}Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def _emit(report: Path, record: dict[str, Any]) -> None:
    with report.open("a") as fh:
        fh.write(json.dumps(record) + "\n")


# ---------------------------------------------------------------------------- valid load
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

    def __init__(self, port: int) -> None:
        request = _post(INFER_PATH, _valid_body())
        super().__init__("127.0.0.1", port, request, VALID_CONNECTIONS)
        self.window: collections.Counter[str] = collections.Counter()  # since the last sample
        self.totals: collections.Counter[str] = collections.Counter()
        self.latencies: list[float] = []  # the window's, of answers with outputs

    def submit(self, scheduled: float) -> None:
        self.totals["sent"] += 1
        self.window["sent"] += 1
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
        outcome = cast(_ValidConnection, conn).outcome  # "ok" exactly when ok
        kind = outcome if outcome in ("ok", "shed") else "lost"
        self.window[kind] += 1
        self.totals[kind] += 1
        if ok:
            self.latencies.append(time.perf_counter() - conn.scheduled)
        elif kind == "lost":
            self.totals[f"lost: {outcome}"] += 1
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
        w, lat = self.window, np.asarray(self.latencies) * 1000.0
        self.window, self.latencies = collections.Counter(), []
        pct = (lambda q: round(float(np.percentile(lat, q)), 3)) if lat.size else (lambda q: None)
        return {"t": time.time(), **{k: w[k] for k in ("sent", "ok", "shed", "lost")},
                "p50_ms": pct(50), "p99_ms": pct(99), "max_ms": pct(100),
                "connections": len(self.busy) + len(self.idle), "outstanding": self.outstanding}  # fmt: skip


async def _run_valid(port: int, rate: float, duration_s: float, window_s: float, report: Path):
    # Every connection is opened up front: the server's descriptor count then reflects the
    # server, not the client growing its pool after a stall.
    client = _ValidClient(port)
    await client.open(VALID_CONNECTIONS)
    rng = np.random.default_rng(11)
    start = time.perf_counter()
    end, next_window = start + duration_s, start + window_s
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
        # At least TICK_S between wake-ups: arrivals due meanwhile go out together (timed
        # from their own scheduled time), so the client's cost per request stays flat.
        await asyncio.sleep(max(TICK_S, min(next_arrival, next_window) - time.perf_counter()))
    deadline = time.perf_counter() + DRAIN_S
    while client.outstanding and time.perf_counter() < deadline:
        await asyncio.sleep(0.01)
    _emit(report, {**client.take_window(), "drain": True})
    totals, unanswered = dict(client.totals), client.outstanding
    totals["lost"] = totals.get("lost", 0) + unanswered
    if unanswered:
        totals["lost: no answer within the drain"] = unanswered
    _emit(report, {"final": True, "cpu_s": time.process_time(), **totals})


def _capacity(port: int, seconds: float, workdir: Path) -> dict[str, Any]:
    """Closed loop (wrk): answers per second to connections that each wait for their answer."""
    script = workdir / "capacity.lua"
    script.write_text(wrk.lua_script(_valid_body()))
    url = f"http://127.0.0.1:{port}{INFER_PATH}"
    m = Measurement("rtserve", MODEL, "wrk", "closed", CAPACITY_CONNECTIONS)
    m = wrk.measure(url, script, CAPACITY_CONNECTIONS, seconds, m)
    if m.error or not m.requests:
        raise RuntimeError(f"the capacity measurement failed: {m.error or 'no request'}")
    ok = (m.requests - m.errors) / m.requests * (m.rps or 0.0)
    return {"capacity_rps": ok, "not_ok": m.errors, "p99_ms": m.p99_ms,
            "connections": CAPACITY_CONNECTIONS, "seconds": seconds}  # fmt: skip


# ---------------------------------------------------------------------------- hostile load
_PORT = [0]  # the server's, in the hostile clients' process


async def _read_answer(reader: asyncio.StreamReader, timeout_s: float) -> str:
    """The status of the first answer ('closed' without one, 'timeout' if none came)."""
    try:
        line = await asyncio.wait_for(reader.readline(), timeout_s)
    except TimeoutError:
        return "timeout"
    except (ConnectionError, OSError):
        return "closed"
    parts = line.split()
    return parts[1].decode() if len(parts) >= 2 and parts[0].startswith(b"HTTP/") else "closed"


async def _exchange(payload: bytes, timeout_s: float = 30.0) -> str:
    """Send ``payload``; the status of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", _PORT[0])
    try:
        writer.write(payload)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        return await _read_answer(reader, timeout_s)
    except (ConnectionError, OSError):
        return "closed"
    finally:
        writer.transport.abort()


async def _leave(payload: bytes, after_s: float = 0.0) -> str:
    """Send ``payload``, wait ``after_s`` without reading, then reset the connection."""
    _, writer = await asyncio.open_connection("127.0.0.1", _PORT[0])
    writer.write(payload)
    with contextlib.suppress(ConnectionError):
        await writer.drain()
    await asyncio.sleep(after_s)
    sock = writer.get_extra_info("socket")
    if sock is not None:  # linger 0: the close is a reset
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
    writer.transport.abort()
    return "left"


async def _pipelined_burst() -> str:
    """20 inferences and 20 GETs in one write: all 40 must be answered, in order."""
    get = b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", _PORT[0])
    try:
        writer.write((_VALID + get) * 20)
        await writer.drain()
        answers, deadline = 0, time.monotonic() + 30
        while answers < 40 and time.monotonic() < deadline:
            status = await _read_answer(reader, deadline - time.monotonic())
            if not status.isdigit():
                break
            while (line := await reader.readline()) not in (b"\r\n", b""):  # the rest of the head
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            if status not in ("200", "503"):
                return status
            answers += 1
        return "all answered" if answers == 40 else f"{answers} of 40 answered"
    except (ConnectionError, OSError, asyncio.IncompleteReadError):
        return "closed"
    finally:
        writer.transport.abort()


@functools.cache
def _bomb() -> bytes:
    """A gzip body of 128 MiB of zeros (~130 KB on the wire)."""
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)
    return b"".join([comp.compress(b"\0" * (1 << 20)) for _ in range(128)] + [comp.flush()])


def _malformed(body: bytes, extra: str = "") -> Callable[[], Awaitable[str]]:
    return lambda: _exchange(_post(INFER_PATH, body, extra))


@dataclass(frozen=True)
class Kind:
    """A hostile client: what it sends, the answers that are right (empty: it leaves before
    reading one), and how it runs (None: a slow-loris, run by ``_slow_client``)."""

    what: str
    expected: frozenset[str]
    run: Callable[[], Awaitable[str]] | None = None
    period_s: float = 0.0  # sent at most this often (dear for the server or the client)


_BYTES = json.dumps({"inputs": [{"name": "input", "shape": [1, 1 << 30], "datatype": "BYTES",
                                 "parameters": {"binary_data_size": 0}}]}).encode()  # fmt: skip
_SMUGGLE = (f"POST {INFER_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
            "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n").encode()  # fmt: skip
_BODY = _valid_body()
_VALID = _post(INFER_PATH, _BODY)
KINDS = {name: Kind(what, frozenset(expected), *rest) for name, what, expected, *rest in (
    ("bad_json", "body that is not JSON", ("400",), _malformed(b'{"inputs": [{"na')),
    ("wrong_shape", "shape [1, 255] with 256 values", ("400",), _malformed(_tensor(shape=[1, 255]))),
    ("wrong_dtype", "INT64 and BYTES for an FP32 input", ("400",), _malformed(_tensor(datatype="INT64"))),
    ("string_values", '"0.5", null and true as FP32 values', ("400",),
     _malformed(_tensor(data=["0.5", None, True] + [0.5] * 253))),
    ("wrong_name", "an input the model does not have", ("400",), _malformed(_tensor(name="nope"))),
    ("huge_shape", "FP32 shape [1, 2^30] with no data", ("400", "413"),
     _malformed(_tensor(shape=[1, 1 << 30], data=[]))),
    ("huge_bytes_shape", "binary BYTES shape [1, 2^30] with 0 data bytes", ("400", "413"),
     _malformed(_BYTES, f"Inference-Header-Content-Length: {len(_BYTES)}\r\n"), 1.0),
    ("oversized_header", "one 100 KB header", ("431",), _malformed(_BODY, f"X-Big: {'a' * 100_000}\r\n")),
    ("many_headers", "300 headers", ("431",), _malformed(_BODY, "".join(f"X-H{i}: v\r\n" for i in range(300)))),
    ("long_url", "a 20 KB URL", ("414",), lambda: _exchange(_post(INFER_PATH + "?" + "q" * 20_000, _BODY))),
    ("smuggling", "Content-Length and Transfer-Encoding together", ("400",), lambda: _exchange(_SMUGGLE)),
    ("gzip_bomb", "130 KB of gzip expanding to 128 MiB", ("413",),
     lambda: _exchange(_post(INFER_PATH, _bomb(), "Content-Encoding: gzip\r\n")), 30.0),
    ("disconnect_mid_body", "half a body, then a reset", (), lambda: _leave(_VALID[: -len(_BODY) // 2], 0.05)),
    ("cancelled", "a whole valid request, reset before its answer", (), lambda: _leave(_VALID)),
    ("pipelined_burst", "20 inferences + 20 GETs in one write, all read", ("all answered",), _pipelined_burst),
    ("pipelined_unread", "2,000 pipelined GETs never read for 5 s", (),
     lambda: _leave(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n" * 2000, 5.0), 10.0),
    # Slow-loris: the head and body timeouts answer 408.
    ("slow_head", "a header line every 2 s, never ending the head", ("408",)),
    ("slow_body_silent", "head and 10 body bytes, then silence", ("408",)),
    ("slow_body_drip", "1 body byte every 5 s; leaves after 60 s", ("408", "held")),
)}  # fmt: skip


async def _slow_client(kind: str, running: Callable[[], bool], record: Callable) -> None:
    """One slow-loris connection after another until the soak ends; each held at most 60 s."""
    cap_s = 60.0
    while running():
        began = time.monotonic()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", _PORT[0])
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
                head = f"POST {INFER_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: 4096\r\n\r\n"
                writer.write(head.encode() + b"{" * 10)
                step, chunk = (5.0, b" ") if kind == "slow_body_drip" else (3600.0, b"")
            answer = asyncio.ensure_future(_read_answer(reader, cap_s + 60))
            next_drip = time.monotonic() + step
            while time.monotonic() - began < cap_s:
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
    """Three clients in turn through the kinds, and ``slow`` slow-loris connections, until
    ``stop_file`` exists."""
    _PORT[0] = port
    _bomb()
    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    held: dict[str, list[float]] = collections.defaultdict(list)
    last_sent: dict[str, float] = {}

    def running() -> bool:
        return not stop_file.exists()

    def record(kind: str, status: str, seconds: float) -> None:
        counts[kind][status] += 1
        held[kind].append(seconds)

    async def worker(offset: int) -> None:
        names = [name for name, kind in KINDS.items() if kind.run is not None]
        for i in itertools.count(offset):
            if not running():
                return
            name = names[i % len(names)]
            kind = KINDS[name]
            if kind.period_s and time.monotonic() - last_sent.get(name, 0.0) < kind.period_s:
                continue
            began = last_sent[name] = time.monotonic()
            try:
                status = await kind.run()  # type: ignore[misc]
            except OSError as exc:
                status = f"connect failed: {exc.__class__.__name__}"
            record(name, status, time.monotonic() - began)
            await asyncio.sleep(0.05)

    slow_kinds = [name for name, kind in KINDS.items() if kind.run is None]
    per_kind = max(1, slow // len(slow_kinds))
    tasks = [worker(i * 5) for i in range(3)]
    tasks += [_slow_client(k, running, record) for k in slow_kinds for _ in range(per_kind)]
    await asyncio.gather(*tasks)
    _emit(report, {
        "final": True,
        "counts": {k: dict(v) for k, v in counts.items()},
        "held_max_s": {k: round(max(v), 3) for k, v in held.items() if v},
        "held_median_s": {k: round(statistics.median(v), 3) for k, v in held.items() if v},
        "cpu_s": time.process_time(),
    })  # fmt: skip


# ---------------------------------------------------------------------------- verdicts
def flatness(values: list[float], slack: float) -> dict[str, Any]:
    """First-third and last-third medians of a series, and whether it stayed flat."""
    clean = [v for v in values if v is not None]
    if len(clean) < 3:
        return {"first": None, "last": None, "max": None, "change": None, "flat": None}
    third = len(clean) // 3
    first, last = statistics.median(clean[:third]), statistics.median(clean[-third:])
    flat = last <= first * (1 + FLAT_TOLERANCE) or last - first <= slack
    change = (last - first) / first if first else 0.0
    return {"first": first, "last": last, "max": max(clean), "change": change, "flat": flat}


def summarize(samples: list[dict], windows: list[dict], valid: dict, hostile: dict) -> dict:
    skip = 1 if len(windows) > 3 else 0  # the first window holds the client's warm-up
    series = {k: flatness([s[k] for s in samples], SLACK[k]) for k in ("rss_mib", "fds")}
    series["p99_ms"] = flatness([w["p99_ms"] for w in windows[skip:]], SLACK["p99_ms"])
    unexpected = {}
    for name, statuses in hostile.get("counts", {}).items():
        allowed = KINDS[name].expected or {"left"}
        if bad := {s: n for s, n in statuses.items() if s not in allowed}:
            unexpected[name] = bad
    sent, answered, shed, lost = (int(valid.get(k, 0)) for k in ("sent", "ok", "shed", "lost"))
    checks = {
        "0 valid requests lost": lost == 0 and sent == answered + shed,
        "hostile clients got the expected answers": not unexpected,
        **{f"{k} flat": bool(v["flat"]) for k, v in series.items()},
    }
    lost_reasons = {k[6:]: v for k, v in valid.items() if k.startswith("lost: ")}
    return {"sent": sent, "answered": answered, "shed": shed, "lost": lost,
            "lost_reasons": lost_reasons, "series": series, "unexpected": unexpected,
            "checks": checks, "passed": all(checks.values())}  # fmt: skip


# ---------------------------------------------------------------------------- report
def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def _duration(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms" if seconds < 10 else f"{seconds:,.0f} s"


def plot(run: dict[str, Any], path: Path) -> None:
    """RSS, descriptors, latency and the machine's load over the run, one panel each."""
    from bench.plots import plt, save

    t0, samples = run["t0"], run["samples"]
    windows = [w for w in run["windows"] if w["p99_ms"] is not None and w["t"] >= t0]
    panels: list[tuple[list[dict], str | None, list[tuple[str, str | None, str]]]] = [
        # (points, y label, [(key, legend label, colour)])
        (samples, "server RSS (MiB)", [("rss_mib", None, "black")]),
        (samples, "open descriptors", [("fds", None, "tab:blue")]),
        (windows, "valid requests (ms)", [("p99_ms", "p99", "tab:red"), ("p50_ms", "p50", "tab:gray")]),
        (samples, None, [("load1", "load average (1 min)", "tab:purple"),
                         ("server_cpu", "server CPU (cores)", "tab:green")]),
    ]  # fmt: skip
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 9.5), sharex=True)
    for ax, (points, ylabel, lines) in zip(axes, panels, strict=True):
        minutes = [(p["t"] - t0) / 60 for p in points]
        for key, label, colour in lines:
            ax.plot(minutes, [p[key] for p in points], color=colour, label=label)
        if points is windows:
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
        if ylabel:
            ax.set_ylabel(ylabel)
        if len(lines) > 1:
            ax.legend(loc="upper right")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("minutes")
    fig.suptitle("rtserve soak: MLP at ~70% of capacity next to hostile clients")
    save(fig, path, dpi=100)


def markdown(run: dict[str, Any], plot_path: Path | None, out: Path) -> str:
    s, cap, before, after = run["summary"], run["capacity"], run["baseline"], run["after"]
    loads = [x["load1"] for x in run["samples"]]
    cores_s = run["minutes"] * 60 * (os.cpu_count() or 1)
    cpu = ", ".join(f"{k} {v:,.0f}" for k, v in run["cpu_s"].items() if v is not None)
    machine_rows = [
        *run["machine"].items(),
        *([("load average (1 min) during the run",
            f"median {statistics.median(loads):.2f}, max {max(loads):.2f}")] if loads else []),
        ("load average at the end", run["load_end"]),
        ("CPU seconds during the soak", f"{cpu} (of {cores_s:,.0f} core-seconds)"),
    ]  # fmt: skip
    valid_rows = [
        (f"capacity (closed loop, wrk -c{cap['connections']}, {cap['seconds']:g} s)",
         f"{cap['capacity_rps']:,.0f} req/s"),
        (f"offered (open loop, Poisson, {VALID_CONNECTIONS} connections)",
         f"{run['rate']:,.0f} req/s ({run['load']:.0%} of capacity)"),
        ("sent", f"{s['sent']:,}"), ("answered 200", f"{s['answered']:,}"),
        ("shed (503/429 with Retry-After; not lost, counted apart)", f"{s['shed']:,}"),
        ("**lost** (no answer, a broken answer, any other status)", f"**{s['lost']:,}**"),
        *[(f"lost: {reason}", f"{n:,}") for reason, n in s["lost_reasons"].items()],
    ]  # fmt: skip
    names = {"rss_mib": "server RSS (MiB)", "fds": "open descriptors", "p99_ms": "p99 of valid requests (ms)"}  # fmt: skip
    series = [(names[k], _fmt(v["first"]), _fmt(v["last"]),
               "-" if v["change"] is None else f"{v['change']:+.1%}", _fmt(v["max"]),
               "-" if v["flat"] is None else ("yes" if v["flat"] else "**no**"))
              for k, v in s["series"].items()]  # fmt: skip
    hostile = run["hostile"]
    seen, medians, maxima = (hostile.get(k, {}) for k in ("counts", "held_median_s", "held_max_s"))
    hostile_rows = [
        (name, kind.what,
         ", ".join(f"{st}: {n:,}" for st, n in sorted(seen.get(name, {}).items())) or "-",
         ", ".join(sorted(kind.expected)) or "none (leaves)",
         f"{_duration(medians[name])} / {_duration(maxima[name])}" if name in medians else "-")
        for name, kind in KINDS.items()
    ]  # fmt: skip
    log = run["server_log"]
    image = os.path.relpath(plot_path, out.parent) if plot_path else None
    lines = [
        f"# Soak: {run['load']:.0%} load next to hostile clients", "",
        "rtserve serves the example MLP on 127.0.0.1 (default limits) while an open-loop client "
        f"offers valid V2 JSON requests (Poisson) at ~{run['load']:.0%} of the capacity measured "
        "first, beside hostile clients (malformed bodies, slow-loris, disconnects, oversized heads, "
        "pipelined bursts, gzip bombs), all on one machine. `make soak`, i.e.:", "",
        "```bash", run["command"], "```", "",
        f"**Result: {'PASS' if s['passed'] else 'FAIL'}** ({run['started']} UTC, {run['minutes']:g} minutes).", "",
        *markdown_table(["check", "result"], [(k, "pass" if v else "FAIL") for k, v in s["checks"].items()]),
        "", "## Machine", "", *markdown_table(["", ""], machine_rows),
        "", "A load average above the core count means other work competed for the cores: it shows "
        "in the latencies, not in the counts.",
        "", "## Valid requests", "", *markdown_table(["", ""], valid_rows),
        "", "## Flat over time", "",
        f"Over the samples (every {run['sample_s']:g} s; p99 per window, the first left out) the "
        f"last third's median is at most {FLAT_TOLERANCE:.0%} above the first third's, or within "
        f"{SLACK['rss_mib']:g} MiB RSS, {SLACK['fds']} descriptors, {SLACK['p99_ms']:g} ms p99.", "",
        *markdown_table(["series", "first third (median)", "last third (median)", "change", "max", "flat"], series),
        "", f"Server before the load: {before['rss_mib']:.1f} MiB RSS, {before['fds']:.0f} descriptors; "
        f"after the clients left: {after['rss_mib']:.1f} MiB, {after['fds']:.0f} descriptors; "
        f"peak RSS (VmHWM) {after['hwm_mib']:.1f} MiB.", "",
        *([f"![RSS, descriptors and latency over the soak]({image})", ""] if image else []),
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
def _child(role: str, report: Path, *args: str) -> subprocess.Popen[bytes]:
    report.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "bench.soak", "--role", role, "--report", str(report), *args]
    return subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL)


def _end_child(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _sample(pid: int, duration_s: float, every_s: float, valid: subprocess.Popen[bytes]):
    """The server's RSS, descriptors and CPU, and the machine's load, every ``every_s``."""
    samples, t0, cpu0 = [], time.time(), cpu_seconds(pid)
    last_t, last_cpu = t0, cpu0
    next_sample = time.monotonic() + every_s
    while time.time() - t0 < duration_s and valid.poll() is None:
        time.sleep(max(0.0, next_sample - time.monotonic()))
        next_sample += every_s
        now, cpu = time.time(), cpu_seconds(pid)
        samples.append({"t": now, **procs.proc_status(pid), "load1": os.getloadavg()[0],
                        "server_cpu": (cpu - last_cpu) / (now - last_t)})  # fmt: skip
        last_t, last_cpu = now, cpu
    return t0, samples, cpu_seconds(pid) - cpu0


def soak(args: argparse.Namespace) -> dict[str, Any]:
    """Start the server and the clients, sample, stop; the run's record (also in soak.json)."""
    work: Path = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M")
    facts = {**machine.facts(), "rtserve source": machine.source_state()}
    stop_file, valid_rec, hostile_rec = work / "stop", work / "valid.jsonl", work / "hostile.jsonl"
    stop_file.unlink(missing_ok=True)
    duration = args.minutes * 60
    valid = hostile = None
    server, ports = procs.rtserve(work, "--model-repository", str(ROOT / "examples" / "repository"),
                                  "--model-control-mode", "explicit", "--load-model", MODEL,
                                  "--log-level", "warning")  # fmt: skip
    port = int(ports["http_port"])
    try:
        server.wait_ready(f"http://127.0.0.1:{port}/v2/models/{MODEL}/ready", 60)
        time.sleep(1)
        baseline = procs.proc_status(server.pid)
        # The hostile clients run from before the capacity measurement to the end, so the
        # capacity is what the server sustains for valid requests next to them.
        hostile = _child("hostile", hostile_rec, "--port", str(port), "--stop-file",
                         str(stop_file), "--slow", str(args.slow))  # fmt: skip
        time.sleep(2)
        capacity = _capacity(port, args.capacity_s, work)
        rate = capacity["capacity_rps"] * LOAD
        print(f"soak: capacity {capacity['capacity_rps']:,.0f} req/s, offering {rate:,.0f} req/s "
              f"for {args.minutes:g} min", flush=True)  # fmt: skip
        valid = _child("valid", valid_rec, "--port", str(port), "--rate", f"{rate:.1f}",
                       "--seconds", str(duration), "--sample-s", str(args.sample_s))  # fmt: skip
        t0, samples, server_cpu_s = _sample(server.pid, duration, args.sample_s, valid)
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
    log = (work / "server.log").read_text(errors="replace").splitlines()
    records = results.read_jsonl(valid_rec)
    windows = [r for r in records if not r.get("final") and not r.get("drain")]
    valid_totals = next((r for r in reversed(records) if r.get("final")), {"lost": -1})
    hostile_final = (results.read_jsonl(hostile_rec) or [{}])[-1]
    run = {
        "started": started, "command": args.command_line, "minutes": args.minutes, "t0": t0,
        "load": LOAD, "sample_s": args.sample_s, "machine": facts,
        "load_end": " / ".join(f"{v:.2f}" for v in os.getloadavg()),
        "capacity": capacity, "rate": rate, "baseline": baseline, "after": after,
        "cpu_s": {"server": server_cpu_s, "valid client": valid_totals.get("cpu_s"),
                  "hostile clients": hostile_final.get("cpu_s")},
        "samples": samples, "windows": windows, "valid": valid_totals, "hostile": hostile_final,
        "server_log": {"lines": len(log), "tracebacks": sum("Traceback" in x for x in log),
                       "errors": sum(" ERROR " in x for x in log), "exit": server.proc.returncode,
                       "stop_s": stop_s},
        "summary": summarize(samples, windows, valid_totals, hostile_final),
    }  # fmt: skip
    (work / "soak.json").write_text(json.dumps(run, indent=1))
    if args.plot:
        plot(run, args.plot)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(markdown(run, args.plot, args.out))
    return run


def main(argv: list[str] | None = None) -> int:
    parser = results.parser("python -m bench soak", __doc__)
    add = parser.add_argument
    add("--minutes", type=float, default=30.0)
    add("--capacity-s", type=float, default=15.0, help="closed-loop capacity measurement")
    add("--sample-s", type=float, default=5.0)
    add("--slow", type=int, default=12, help="slow-loris connections")
    add("--out", type=Path, help="markdown report (e.g. docs/soak.md)")
    add("--plot", type=Path, help="PNG plot (e.g. docs/img/soak.png)")
    add("--workdir", type=Path, default=WORK / "soak", help="server log, client records, soak.json")
    for hidden, kind in (("--role", str), ("--report", Path), ("--port", int), ("--rate", float),
                         ("--seconds", float), ("--stop-file", Path)):  # fmt: skip
        add(hidden, type=kind, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "valid":
        uvloop.run(_run_valid(args.port, args.rate, args.seconds, args.sample_s, args.report))
        return 0
    if args.role == "hostile":
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        uvloop.run(_run_hostile(args.port, args.stop_file, args.slow, args.report))
        return 0
    args.command_line = results.command_line("python -m bench.soak", argv)
    s = soak(args)["summary"]
    print(json.dumps({k: s[k] for k in ("passed", "checks", "sent", "answered", "shed", "lost", "unexpected")}))  # fmt: skip
    return 0 if s["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
