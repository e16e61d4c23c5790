"""Server lifecycle: listen, load and warm up models, serve, drain on SIGTERM/SIGINT, stop.

Liveness answers as soon as the HTTP listener is up; readiness only after every model has
been loaded and warmed up. On a stop signal readiness turns false, new inference requests
are refused (503 / UNAVAILABLE), every accepted request is answered, then the process exits
within the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from pathlib import Path

from rtserve.config import ServerConfig
from rtserve.core.dataplane import DataPlane
from rtserve.observability.metrics import Metrics
from rtserve.repository import ModelRepository
from rtserve.server.grpc import GrpcFrontend, start_grpc_server
from rtserve.server.http import HttpFrontend
from rtserve.server.httpserver import HttpServer

log = logging.getLogger("rtserve")


class Server:
    def __init__(self, config: ServerConfig, ports_file: Path | None = None) -> None:
        self.config = config
        self.ports_file = ports_file
        self.metrics = Metrics()
        self.repository = ModelRepository(
            config.model_repository, self.metrics, cache_default=config.response_cache
        )
        self.dataplane = DataPlane(self.repository)
        self.http = HttpFrontend(self.dataplane, self.metrics, config.max_request_bytes)
        self.grpc = GrpcFrontend(self.dataplane, self.metrics, config.max_request_bytes)
        self._stop = asyncio.Event()
        self.http_port = 0
        self.grpc_port = 0

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop)
        cfg = self.config
        self.http_server = HttpServer(self.http.handle, cfg.max_request_bytes)
        self.http_port = await self.http_server.start(cfg.host, cfg.http_port)
        grpc_server, self.grpc_port = await start_grpc_server(self.grpc, cfg.host, cfg.grpc_port)
        log.info(
            "listening: http://%s:%d grpc %s:%d", cfg.host, self.http_port, cfg.host, self.grpc_port
        )

        await self.repository.load_all()
        self.dataplane.started = True
        self._announce()
        await self._stop.wait()

        await self._drain(grpc_server)
        await self.http_server.close()
        await self.repository.stop()
        log.info("stopped")

    def _announce(self) -> None:
        cfg = self.config
        models = {
            name: (sorted(m.versions) if not m.error else f"FAILED: {m.error}")
            for name, m in self.repository.models.items()
        }
        info = {"host": cfg.host, "http_port": self.http_port, "grpc_port": self.grpc_port}
        if self.ports_file is not None:
            self.ports_file.write_text(json.dumps(info))
        log.info("ready: models %s", models)
        print(
            f"rtserve ready: http://{cfg.host}:{self.http_port} grpc {cfg.host}:{self.grpc_port} "
            f"models {json.dumps(models)}",
            flush=True,
        )

    async def _drain(self, grpc_server: object) -> None:
        cfg = self.config
        deadline = time.monotonic() + cfg.grace_period_s
        self.dataplane.begin_drain()
        self.http_server.begin_drain()
        log.info("draining: readiness false, finishing accepted requests")

        def busy() -> bool:
            return (
                self.http_server.busy
                or self.grpc.in_flight > 0
                or any(mv.batcher.busy for mv in self.repository.loaded_versions())
            )

        while busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if busy():
            log.error(
                "grace period of %.1f s ended with requests still in flight", cfg.grace_period_s
            )
        remaining = max(0.0, deadline - time.monotonic())
        await grpc_server.stop(remaining)  # type: ignore[attr-defined]


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def serve(config: ServerConfig, ports_file: Path | None = None) -> None:
    configure_logging(config.log_level)
    server = Server(config, ports_file)
    try:
        import uvloop

        uvloop.run(server.run())
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(server.run())
