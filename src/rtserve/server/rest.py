"""The HTTP/1.1 adapter: requests from rtserve's own server (``server/http1.py``) into the
application (``rtserve.api``), replies back onto the connection.

Inference is answered straight onto the connection, with no task and no coroutine (see
``Application.infer``); other routes reply whole, streamed (server-sent events, written no
faster than the client reads) or later (a task, cancelled when the client goes away).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

from rtserve.api import routes
from rtserve.api.application import Application
from rtserve.api.call import Pending, Reply, Streamed
from rtserve.api.context import error_reply
from rtserve.api.v2 import config_json, infer_target, metadata_json
from rtserve.core.control import ModelControl
from rtserve.core.dataplane import DataPlane
from rtserve.protocol.shared_memory import SharedMemoryRegions
from rtserve.server.http1 import Connection, Request, response_bytes
from rtserve.server.security import Guard

__all__ = ["HttpFrontend", "config_json", "infer_target", "metadata_json"]

# The kernel's send buffer of a connection streaming tokens (it grows to megabytes by
# itself): a client that stops reading backs its stream up into the engine soon, which
# pauses it (``llm.unread_timeout_s``) instead of decoding on into the kernel.
STREAM_SEND_BUFFER = 128 << 10


def _peer(conn: Connection) -> str:
    peer = conn.transport.get_extra_info("peername") if conn.transport is not None else None
    return str(peer[0]) if peer else "?"


def _keep_alive_bytes(status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    return response_bytes(status, body, headers, True, False)


class HttpFrontend:
    def __init__(
        self,
        dataplane: DataPlane,
        max_request_bytes: int,
        control: ModelControl | None = None,
        guard: Guard | None = None,
        max_decompressed_bytes: int = 64 * 1024 * 1024,
        shm: SharedMemoryRegions | None = None,
    ) -> None:
        """``guard``: authentication and rate limits (None: open, as by default); ``shm``:
        the system shared memory regions (None: the extension is off, as by default)."""
        self.app = Application(
            dataplane, max_request_bytes, control, guard, max_decompressed_bytes, shm
        )
        self.app.encode_answer = _keep_alive_bytes
        self.guard = guard
        self.dataplane = dataplane
        self.generative = self.app.generative
        self._tasks: set[asyncio.Task[None]] = set()

    def check_head(
        self, conn: Connection, method: bytes, path: str, headers: dict[bytes, bytes]
    ) -> int | None:
        """The application's head check (keys, rate limit, route, model), before a large or
        chunked body is read: the server answers a refusal at once and closes, so a refused
        client cannot make it buffer an upload."""
        return self.app.check_head(method, path, headers, _peer(conn) if self.guard else "?")

    def handle(self, conn: Connection, request: Request) -> None:
        app = self.app
        try:
            if app.guard is not None and not request.checked:
                app.check_credentials(_peer(conn), request.path, request.headers)
            route = routes.find(request.method, request.path)
        except Exception as exc:
            conn.respond(*error_reply(request.path, exc))
            return
        if route is routes.INFER:  # the hot path: answered on the connection
            app.infer(request, conn)
            return
        self.send(conn, route.handler(app, request, _peer(conn)))

    def send(self, conn: Connection, reply: Reply) -> None:
        """Send a reply: whole, streamed, or when it is ready."""
        if isinstance(reply, Streamed):
            _bound_send_buffer(conn)
            conn.respond_stream(200, reply.headers, reply.chunks)
        elif isinstance(reply, Pending):
            self._send_later(conn, reply)
        else:
            conn.respond(*reply)

    def _send_later(self, conn: Connection, pending: Pending) -> None:
        """Send the answer when it is ready; the client going away first cancels it (and
        with it a generation), unless the reply runs to its end (a model load)."""

        async def run() -> None:
            self.send(conn, await pending.answer())

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if pending.abort_on_lost:
            conn.on_lost = task.cancel


def _bound_send_buffer(conn: Connection) -> None:
    sock = conn.transport.get_extra_info("socket") if conn.transport is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SEND_BUFFER)
