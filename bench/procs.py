"""Start a server in its own session, wait until it answers, stop it and every descendant.

Also redis-server on a free loopback port (:class:`RedisServer`) and a process's CPU time.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

LOCK = Path("/tmp/bench.lock")


@contextlib.contextmanager
def bench_lock() -> Iterator[None]:
    """The machine-wide benchmark lock (``flock /tmp/bench.lock``), held while measuring
    (``BENCH_LOCK_HELD=1``: a wrapper such as /tmp/quiet.sh holds it for the whole run)."""
    if os.environ.get("BENCH_LOCK_HELD") == "1":
        yield
        return
    with LOCK.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_status(url: str, timeout: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return None


def metrics(base: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of ``base``/metrics (Prometheus text): (name, labels, value)."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = []
    for line in text.splitlines():
        if line and not line.startswith("#"):
            head, _, value = line.rpartition(" ")
            name, _, labels = head.partition("{")
            found.append((name, dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value)))
    return found


def http_post(url: str, body: bytes, timeout: float = 30.0) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def _stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of ``/proc/<pid>/stat`` after the command name) of every process."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                yield int(entry), Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue


def same_session(sid: int) -> list[int]:
    """Processes whose session id is ``sid`` (orphans that kept the session are found too)."""
    return [pid for pid, fields in _stats() if int(fields[3]) == sid]


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for child, fields in _stats():
        children.setdefault(int(fields[1]), []).append(child)
    found: list[int] = []
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Server:
    """A server process started in a new session so that it and its children can be stopped."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        cwd: Path,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            self.argv,
            env=dict(env),
            cwd=str(cwd),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.pid = self.proc.pid
        self._known: set[int] = set()

    def wait_ready(self, url: str, timeout_s: float) -> None:
        """Poll ``url`` until it answers 200; raise RuntimeError with the log's tail if not."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._known.update(descendants(self.pid))
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode}: {self.log_tail()}")
            if http_status(url) == 200:
                return
            time.sleep(0.25)
        raise RuntimeError(f"not ready after {timeout_s:.0f}s: {self.log_tail()}")

    def log_tail(self, lines: int = 3) -> str:
        self._log.flush()
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        kept = [line.strip() for line in text.splitlines() if line.strip()]
        return " | ".join(kept[-lines:])

    def stop(self, grace_s: float = 15.0) -> list[int]:
        """SIGTERM the process group, then SIGKILL whatever of it and its descendants is left.

        Returns the PIDs that had to be killed.
        """
        self._known.update(descendants(self.pid))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            self._known.update(descendants(self.pid))
            left = self._known | set(same_session(self.pid))
            if self.proc.poll() is not None and not any(alive(p) for p in left):
                break
            time.sleep(0.1)
        candidates = {self.pid, *self._known, *descendants(self.pid), *same_session(self.pid)}
        killed = [p for p in candidates if alive(p)]
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        for pid in killed:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self._log.close()
        return killed


def cpu_split(pid: int) -> tuple[float, float]:
    """User and system (kernel) CPU time of a process, all its threads included."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads included."""
    return sum(cpu_split(pid))


def proc_status(pid: int) -> dict[str, float]:
    """A process's resident and peak memory (MiB), threads and open descriptors."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "Threads"):
            fields[key] = float(value.split()[0])
    return {"rss_mib": fields.get("VmRSS", 0.0) / 1024, "hwm_mib": fields.get("VmHWM", 0.0) / 1024,
            "threads": fields.get("Threads", 0.0), "fds": float(len(os.listdir(f"/proc/{pid}/fd")))}  # fmt: skip


class RedisServer:
    """redis-server on a free 127.0.0.1 port, without persistence, stopped by its process group.

    Raises RuntimeError with the log's tail when it does not answer PING within ``timeout_s``.
    """

    def __init__(self, folder: Path, timeout_s: float = 10.0) -> None:
        import redis

        self.port = free_port()
        folder.mkdir(parents=True, exist_ok=True)
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "no", "--dir", str(folder)]
        self.server = Server("redis", argv, dict(os.environ), folder / "redis.log", cwd=folder)
        self.client: Any = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.client.ping()
                return
            except redis.RedisError as exc:
                if time.monotonic() > deadline or self.server.proc.poll() is not None:
                    tail = self.server.log_tail()
                    self.stop()
                    raise RuntimeError(f"redis-server did not start: {tail}") from exc
                time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def flush(self) -> None:
        self.client.flushall()

    def stop(self) -> None:
        self.client.close()
        self.server.stop(grace_s=5)


def rtserve(
    workdir: Path, *args: str, cpus: str = "", src: Path | None = None, timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> tuple[Server, dict[str, int]]:  # fmt: skip
    """``rtserve serve ARGS`` on 127.0.0.1 with ports the OS picks (read from its ports file),
    pinned to ``cpus`` (taskset), run from the source tree ``src`` when given, with ``env``
    added to the environment."""
    root = Path(__file__).resolve().parent.parent
    ports = workdir / "ports.json"
    ports.unlink(missing_ok=True)
    argv = [*(["taskset", "-c", cpus] if cpus else []), sys.executable, "-m", "rtserve.cli",
            "serve", "--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0",
            "--ports-file", str(ports), *args]  # fmt: skip
    environ = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    if src is not None:
        environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(src.resolve()), environ.get("PYTHONPATH")])
        )
    server = Server("rtserve", argv, environ, workdir / "server.log", cwd=root)
    deadline = time.monotonic() + timeout_s
    while not (ports.exists() and ports.stat().st_size):
        if server.proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"rtserve did not start: {server.log_tail()}")
        time.sleep(0.1)
    time.sleep(0.05)
    return server, json.loads(ports.read_text())
