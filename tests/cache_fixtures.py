"""A real redis-server on a free 127.0.0.1 port for the cache tests; stopped by PID."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One redis-server process without persistence; ``kill`` and ``start`` reuse the port."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.mkdtemp(prefix="rtserve-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        self.proc = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self._dir,
                "--daemonize",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            if self.command(b"PING") == b"+PONG":
                return
            time.sleep(0.01)
        self.kill()
        raise RuntimeError(f"redis-server did not answer PING on port {self.port}")

    def kill(self) -> None:
        """SIGKILL, as a crash would; wait until the process is gone."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        self.proc = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def command(self, *args: bytes) -> bytes | None:
        """Send one RESP command over a plain socket and return the first reply line."""
        reply = self.reply(*args)
        return None if reply is None else reply.split(b"\r\n", 1)[0]

    def reply(self, *args: bytes) -> bytes | None:
        """Send one RESP command and return the raw reply (a bulk string read in full)."""
        payload = b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
                s.sendall(payload)
                data = s.recv(65536)
                if data.startswith(b"$") and not data.startswith(b"$-1"):
                    head, _, _ = data.partition(b"\r\n")
                    total = len(head) + 2 + int(head[1:]) + 2
                    while len(data) < total and (chunk := s.recv(65536)):
                        data += chunk
                return data
        except OSError:
            return None

    def command_calls(self, name: str) -> int:
        """How many times Redis ran ``name`` since the last CONFIG RESETSTAT."""
        info = (self.reply(b"INFO", b"commandstats") or b"").decode()
        for line in info.splitlines():
            if line.startswith(f"cmdstat_{name.lower()}:calls="):
                return int(line.split("calls=", 1)[1].split(",", 1)[0])
        return 0


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    if not os.path.exists(REDIS_SERVER):
        pytest.fail("redis-server is not installed (make system-deps installs it)")
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis(redis_server: RedisServer) -> Iterator[RedisServer]:
    """The module's redis-server, running (started again if a test killed it) and empty."""
    if redis_server.proc is None or redis_server.proc.poll() is not None:
        redis_server.start()
    assert redis_server.command(b"FLUSHALL") == b"+OK"
    yield redis_server
