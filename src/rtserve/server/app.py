"""Server lifecycle: listen, load and warm up models, serve, drain on SIGTERM/SIGINT, stop.

Liveness answers as soon as the HTTP listener is up; readiness only after every model has
been loaded and warmed up. On a stop signal readiness turns false, new inference requests
are refused (503 / UNAVAILABLE), every accepted request is answered, then the process exits
within the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import multiprocessing
import os
import queue
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rtserve.config import ServerConfig
from rtserve.engine import Engine, failed_message
from rtserve.errors import ConfigError
from rtserve.observability.logs import configure_logging
from rtserve.protocol.shared_memory import SharedMemoryRegions
from rtserve.server.grpc import GrpcFrontend, GrpcServers, start_grpc_server
from rtserve.server.grpc_h2 import GrpcH2Server, start_grpc_h2
from rtserve.server.http1 import HttpLimits, HttpServer
from rtserve.server.rest import HttpFrontend
from rtserve.server.security import (
    Guard,
    grpc_credentials,
    server_ssl_context,
)

log = logging.getLogger("rtserve")

# After the grace period, how long the models may take to stop (release their sessions and
# threads): with nothing in flight, milliseconds. Past it a model's code is stuck (a request
# that never returns), and the process exits (status 1) without it rather than never.
STOP_MODELS_S = 2.0


class Server:
    def __init__(
        self,
        config: ServerConfig,
        ports_file: Path | None = None,
        http_sock: socket.socket | None = None,
        on_ready: Callable[[dict[str, str]], None] | None = None,
    ) -> None:
        self.config = config
        self.ports_file = ports_file
        self.http_sock = http_sock  # set in worker processes: the listening socket they share
        self.on_ready = on_ready
        self.http_server: HttpServer | None = None
        # The core, shared by both frontends; the transports feed its idleness hint.
        self.engine = engine = Engine(config)
        self.metrics = engine.metrics
        self.registry = engine.registry
        self.workers = engine.workers
        self.tracer = engine.tracer
        self.dataplane = engine.dataplane
        self.control = engine.control
        guard = _guard(config)
        self.shm = (
            SharedMemoryRegions(config.shared_memory_max_regions, config.max_request_bytes)
            if config.shared_memory == "system"
            else None
        )
        self.http = HttpFrontend(
            self.dataplane,
            config.max_request_bytes,
            control=self.control,
            guard=guard,
            max_decompressed_bytes=config.max_decompressed_bytes,
            shm=self.shm,
        )
        self.grpc = GrpcFrontend(
            self.dataplane,
            config.max_request_bytes,
            control=self.control,
            guard=guard,
            shm=self.shm,
        )
        engine.add_activity(self._http_idle_clients)
        engine.add_activity(self._grpc_recent)
        self._stop = asyncio.Event()
        self.http_port = 0
        self.grpc_port = 0

    def _http_idle_clients(self) -> bool:
        """An HTTP client holds an idle keep-alive connection: it may send again soon."""
        return self.http_server is not None and self.http_server.idle_connections > 0

    def _grpc_recent(self) -> bool:
        """gRPC clients multiplex one connection, so idleness is unknown: calls a moment ago
        stand for more to come."""
        return time.monotonic() - self.grpc.last_request_s < 1.0

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop)
        cfg = self.config
        tls = bool(cfg.tls_cert)
        http_server = self.http_server = HttpServer(
            self.http.handle,
            cfg.max_request_bytes,
            limits=HttpLimits.from_config(cfg),
            ssl=server_ssl_context(*_tls_files(cfg)) if tls else None,
            head=self.http.check_head,
        )
        self.http_port = await http_server.start(cfg.host, cfg.http_port, self.http_sock)
        grpc_server: GrpcServers | GrpcH2Server
        if cfg.grpc_server == "grpcio":
            grpc_server, self.grpc_port = await start_grpc_server(
                self.grpc,
                cfg.host,
                cfg.grpc_port,
                reuse_port=self.http_sock is not None,
                credentials=grpc_credentials(*_tls_files(cfg)) if tls else None,
            )
        else:
            grpc_server, self.grpc_port = await start_grpc_h2(
                self.grpc,
                cfg.host,
                cfg.grpc_port,
                reuse_port=self.http_sock is not None,
                ssl_context=server_ssl_context(*_tls_files(cfg), alpn="h2") if tls else None,
            )
        log.info("listening: %s", _addresses(cfg, self.http_port, self.grpc_port))
        engine = self.engine
        engine.add_transport(_HttpTransport(http_server))
        engine.add_transport(_GrpcTransport(grpc_server, self.grpc))
        await engine.start()  # (--exit-on-error: a ConfigError, the transports closed)
        failed = self.registry.failed()
        gc.collect()
        gc.freeze()  # models, sessions and config never die: keep them out of GC scans
        # Per-request garbage is freed by reference counting; cyclic collections only need to
        # run rarely, and each full one walks every live object (a large response cache too).
        gc.set_threshold(50_000, 20, 100)
        if self.on_ready is not None:
            self.on_ready(failed)
        else:
            models = {
                name: (sorted(m.versions) if not m.error else f"FAILED: {m.error}")
                for name, m in self.registry.models.items()
            }
            announce(self.config, self.http_port, self.grpc_port, models, self.ports_file, failed)
        await self._stop.wait()

        stuck = await engine.stop(models_timeout_s=STOP_MODELS_S)
        if self.shm is not None:
            self.shm.close()
        if stuck:
            log.error(
                "models still running requests %.1f s after the grace period (%s): exiting "
                "without waiting for them",
                STOP_MODELS_S,
                ", ".join(stuck),
            )
            logging.shutdown()
            os._exit(1)  # a thread stuck in a model's code would block the interpreter's exit
        log.info("stopped")


class _HttpTransport:
    """The HTTP/1.1 server as the engine's shutdown drives it."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server

    def begin_drain(self) -> None:
        self.server.begin_drain()

    @property
    def busy(self) -> bool:
        return self.server.busy

    async def close(self, grace_s: float) -> None:
        await self.server.close()


class _GrpcTransport:
    """The gRPC server (grpcio or the own HTTP/2 one) as the engine's shutdown drives it:
    new calls are refused by the draining dataplane; ``close`` ends the server."""

    def __init__(self, server: GrpcServers | GrpcH2Server, frontend: GrpcFrontend) -> None:
        self.server = server
        self.frontend = frontend

    def begin_drain(self) -> None:
        pass

    @property
    def busy(self) -> bool:
        return self.frontend.in_flight > 0

    async def close(self, grace_s: float) -> None:
        await self.server.stop(grace_s)


def _guard(config: ServerConfig) -> Guard | None:
    """Authentication and rate limits, if configured (errors name the setting)."""
    return Guard.from_config(config)


def _tls_files(config: ServerConfig) -> tuple[Path, Path, Path | None]:
    if not config.tls_key:
        raise ConfigError("tls_key: expected the private key of tls_cert (--tls-key)")
    for name in ("tls_cert", "tls_key", "tls_client_ca"):
        value = getattr(config, name)
        if value and not Path(value).is_file():
            raise ConfigError(f"{name}: no such file: {value}")
    ca = Path(config.tls_client_ca) if config.tls_client_ca else None
    return Path(config.tls_cert), Path(config.tls_key), ca


def _addresses(config: ServerConfig, http_port: int, grpc_port: int) -> str:
    """Where clients connect: ``https://`` and ``grpc (TLS)`` when serving TLS."""
    tls = bool(config.tls_cert)
    scheme, grpc = ("https", "grpc (TLS)") if tls else ("http", "grpc")
    return f"{scheme}://{config.host}:{http_port} {grpc} {config.host}:{grpc_port}"


def announce(
    config: ServerConfig,
    http_port: int,
    grpc_port: int,
    models: Any,
    ports_file: Path | None,
    failed: dict[str, str] | None = None,
    workers: int = 1,
) -> None:
    """Say that the server has started: the ports file (for scripts) and one log line,
    "ready" or, under strict readiness with ``failed`` models, "not ready" and why."""
    info = {"host": config.host, "http_port": http_port, "grpc_port": grpc_port, "workers": workers}
    if ports_file is not None:
        ports_file.write_text(json.dumps(info))
    where = _addresses(config, http_port, grpc_port)
    if failed and config.strict_readiness:
        log.warning(
            "not ready (strict readiness; --strict-readiness false serves the others): %s "
            "models %s: %s",
            where,
            json.dumps(models),
            failed_message(failed),
        )
    else:
        log.info("ready: %s models %s", where, json.dumps(models))


def _run(server: Server) -> None:
    try:
        import uvloop

        uvloop.run(server.run())
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(server.run())


def serve(config: ServerConfig, ports_file: Path | None = None, workers: int = 1) -> int:
    configure_logging(config.log_level, config.log_format)
    if workers > 1 and config.shared_memory != "none":
        # Each worker would hold its own regions: one registered through a connection to one
        # worker would be unknown to the worker that gets the inference request.
        raise ConfigError(
            f"shared_memory: {config.shared_memory} needs --workers 1 (regions registered "
            f"with one of {workers} worker processes would be unknown to the others)"
        )
    if workers <= 1:
        _run(Server(config, ports_file))
        return 0
    return _serve_workers(config, ports_file, workers)


def _worker(config: ServerConfig, sock: socket.socket, ready: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent turns Ctrl-C into SIGTERM
    try:
        _run(Server(config, http_sock=sock, on_ready=ready.put))
    except ConfigError as exc:  # --exit-on-error: the parent sees the exit and stops
        log.error("%s", exc)
        raise SystemExit(1) from None


def _serve_workers(config: ServerConfig, ports_file: Path | None, workers: int) -> int:
    """Several independent server processes (each with its own batchers) sharing the ports:
    HTTP through one inherited listening socket, gRPC through SO_REUSEPORT."""
    http_sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    http_sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    http_sock.bind((config.host, config.http_port))
    http_sock.listen(65535)
    http_sock.setblocking(False)
    grpc_port = config.grpc_port
    reservation = None
    if grpc_port == 0:  # pick a free port and hold it until the workers have bound it too
        reservation = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        reservation.bind((config.host, 0))
        grpc_port = reservation.getsockname()[1]
    shared = tempfile.TemporaryDirectory(prefix="rtserve-workers-")
    worker_config = dataclasses.replace(config, grpc_port=grpc_port, shared_dir=shared.name)
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(dataclasses.replace(worker_config, worker_index=i), http_sock, ready),
        )
        for i in range(workers)
    ]
    for p in procs:
        p.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    started = 0
    failed: dict[str, str] = {}  # models that failed to load (each worker loads the same)
    deadline = time.monotonic() + 600
    while started < workers and not stop.is_set() and time.monotonic() < deadline:
        try:
            failed = ready.get(timeout=0.2)
            started += 1
        except queue.Empty:
            if any(not p.is_alive() for p in procs):
                log.error("a worker exited during start-up")
                stop.set()
    if reservation is not None:
        reservation.close()
    if started == workers:
        models = f"loaded by each of {workers} workers"
        http_port = http_sock.getsockname()[1]
        announce(config, http_port, grpc_port, models, ports_file, failed, workers)
    while not stop.wait(0.5):
        if any(not p.is_alive() for p in procs):
            log.error("a worker exited; stopping the others")
            break
    for p in procs:
        if p.is_alive() and p.pid is not None:
            os.kill(p.pid, signal.SIGTERM)
    for p in procs:
        p.join(config.grace_period_s + 5)
        if p.is_alive():
            p.kill()
            p.join()
    shared.cleanup()
    return 0 if all(p.exitcode == 0 for p in procs) else 1
