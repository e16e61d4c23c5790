"""Open-loop HTTP client: Poisson arrivals at a fixed rate, latency from each scheduled send.

wrk is closed loop (a request waits for the previous one on its connection), which hides
queueing delay. Here every request has an arrival time drawn in advance; when all connections
are busy it waits in the client and that wait counts in its latency, so a server past saturation
shows a growing p99 instead of a flat throughput. Runs in the project's venv:

    python -m bench.clients.openloop URL BODY_FILE --rate 2000 --duration 5

and prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import resource
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import httptools
import numpy as np
import uvloop


@dataclass
class _Stats:
    latencies: list[float] = field(default_factory=list)
    lags: list[float] = field(default_factory=list)
    errors: int = 0
    sent: int = 0
    last_done: float = 0.0
    codes: collections.Counter[int] = field(default_factory=collections.Counter)


class _Connection(asyncio.Protocol):
    def __init__(self, client: _Client) -> None:
        self.client = client
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.scheduled = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.client.finish(self, ok=False)
            if self.transport is not None:
                self.transport.close()

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        if self in self.client.busy:
            self.client.stats.codes[status] += 1
        self.client.finish(self, ok=status == 200)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.lost(self)


class _Client:
    connection: type[_Connection] = _Connection

    def __init__(self, host: str, port: int, request: bytes, max_connections: int) -> None:
        self.host, self.port, self.request = host, port, request
        self.max_connections = max_connections
        self.idle: collections.deque[_Connection] = collections.deque()
        self.waiting: collections.deque[float] = collections.deque()
        self.busy: set[_Connection] = set()
        self.opening = 0
        self.stats = _Stats()
        self.loop = asyncio.get_running_loop()

    async def open(self, count: int) -> None:
        for _ in range(count):
            _, conn = await self.loop.create_connection(
                lambda: self.connection(self), self.host, self.port
            )
            self.idle.append(conn)

    def submit(self, scheduled: float) -> None:
        if self.idle:
            self._send(self.idle.popleft(), scheduled)
            return
        self.waiting.append(scheduled)
        if len(self.busy) + self.opening < self.max_connections:
            self.opening += 1
            self.loop.create_task(self._grow())

    async def _grow(self) -> None:
        try:
            _, conn = await self.loop.create_connection(
                lambda: self.connection(self), self.host, self.port
            )
        except OSError:
            self.stats.errors += 1
            return
        finally:
            self.opening -= 1
        self._release(conn)

    def _send(self, conn: _Connection, scheduled: float) -> None:
        conn.scheduled = scheduled
        self.busy.add(conn)
        self.stats.sent += 1
        self.stats.lags.append(time.perf_counter() - scheduled)
        if conn.transport is not None:
            conn.transport.write(self.request)

    def _release(self, conn: _Connection) -> None:
        if self.waiting:
            self._send(conn, self.waiting.popleft())
        else:
            self.idle.append(conn)

    def finish(self, conn: _Connection, ok: bool) -> None:
        if conn not in self.busy:
            return
        self.busy.discard(conn)
        now = time.perf_counter()
        if ok:
            self.stats.latencies.append(now - conn.scheduled)
            self.stats.last_done = now
        else:
            self.stats.errors += 1
        self._release(conn)

    def lost(self, conn: _Connection) -> None:
        if conn in self.busy:
            self.busy.discard(conn)
            self.stats.errors += 1
        if conn in self.idle:
            self.idle.remove(conn)

    @property
    def outstanding(self) -> int:
        return len(self.busy) + len(self.waiting)


def arrivals(rate: float, duration_s: float, seed: int = 1) -> np.ndarray:
    """Poisson arrival offsets (seconds) in ``[0, duration_s)``."""
    rng = np.random.default_rng(seed)
    count = int(rate * duration_s * 1.2) + 16
    times = np.cumsum(rng.exponential(1.0 / rate, size=count))
    return times[times < duration_s]


def post_request(host: str, port: int, path: str, body: bytes) -> bytes:
    """The raw HTTP/1.1 POST of ``body`` every request on a connection reuses."""
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def offer(client: _Client, offsets: np.ndarray, drain_s: float) -> float:
    """Submit one request at each scheduled offset (seconds from now), then wait up to
    ``drain_s`` for the answers still out; returns the start time (``perf_counter``)."""
    times = offsets.tolist()  # Python floats: numpy scalars make each step several times dearer
    count = len(times)
    clock = time.perf_counter
    start = clock()
    index = 0
    while index < count:
        now = clock() - start
        while index < count and times[index] <= now:
            client.submit(start + times[index])
            index += 1
        if index < count:
            await asyncio.sleep(max(0.0, times[index] - (clock() - start)))
    deadline = time.perf_counter() + drain_s
    while client.outstanding and time.perf_counter() < deadline:
        await asyncio.sleep(0.005)
    return start


async def run(
    url: str, body: bytes, rate: float, duration_s: float, drain_s: float, max_connections: int,
    seed: int = 1, open_all: bool = False, record: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Offer ``rate`` requests/s for ``duration_s``; a summary, or with ``record`` the C
    client's result (``elapsed``, ``lag_p99_ms``, ``scheduled``, ``unfinished``, ``errors``,
    ``codes``, ``latency_ms``). ``open_all``: the whole pool is opened before the first arrival
    (opened on demand, a few requests per hundred came back seconds late on a 2-core VM)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    client = _Client(host, port, post_request(host, port, parts.path or "/", body), max_connections)
    await client.open(max_connections if open_all else min(32, max_connections))
    offsets = arrivals(rate, duration_s, seed)
    start = await offer(client, offsets, drain_s)
    unfinished = client.outstanding
    stats = client.stats
    elapsed = max((stats.last_done or time.perf_counter()) - start, 1e-9)
    lat = np.asarray(stats.latencies) * 1000
    lag = np.asarray(stats.lags) * 1000
    pct = lambda a, q: float(np.percentile(a, q)) if a.size else float("nan")  # noqa: E731
    if record:
        return {"elapsed": elapsed, "lag_p99_ms": pct(lag, 99) if lag.size else 0.0,
                "scheduled": int(len(offsets)), "unfinished": unfinished, "errors": stats.errors,
                "codes": {str(k): v for k, v in stats.codes.items()}, "latency_ms": lat.tolist()}  # fmt: skip
    return {
        "offered": rate,
        "scheduled": int(len(offsets)),
        "sent": stats.sent,
        "completed": int(lat.size),
        "errors": stats.errors + unfinished,
        "unfinished": unfinished,
        "rps": lat.size / elapsed,
        "p50_ms": pct(lat, 50),
        "p90_ms": pct(lat, 90),
        "p99_ms": pct(lat, 99),
        "send_lag_p99_ms": pct(lag, 99),
    }


def command(url: str, body: Path, rate: float, seconds: float, seed: int, conns: int,
            drain_s: float, result: Path) -> list[str]:  # fmt: skip
    """The command line of this client that writes ``run(..., record=True)`` to ``result``."""
    return [sys.executable, "-m", "bench.clients.openloop", url, str(body), "--rate", str(rate),
            "--duration", str(seconds), "--seed", str(seed), "--connections", str(conns),
            "--drain", str(drain_s), "--open-all", "--result", str(result)]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("body_file", type=Path)
    parser.add_argument("--rate", type=float, required=True)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--drain", type=float, default=3.0)
    parser.add_argument("--connections", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--open-all", action="store_true", help="open every connection first")
    parser.add_argument("--result", type=Path, help="write the full record (latencies) here")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # a socket per request in flight
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, args.connections + 256)), hard))
    gc.disable()  # a short-lived process: a collection's pause would count in every latency
    result = uvloop.run(
        run(args.url, args.body_file.read_bytes(), args.rate, args.duration, args.drain,
            args.connections, args.seed, args.open_all, args.result is not None)
    )  # fmt: skip
    if args.result is not None:
        args.result.write_text(json.dumps(result))
    else:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
