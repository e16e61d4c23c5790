"""TLS on our own listening sockets, with handshakes counted against the connection cap.

Given ``ssl=``, asyncio and uvloop tell a server's protocol of a connection only once its
handshake is done, so a cap counted in ``connection_made`` missed every handshake in
progress: clients that connected and never sent a ClientHello held descriptors without
bound. A TLS port is therefore listened on plain: :class:`TlsAcceptor` takes each accepted
TCP connection, counts it, closes it at once past the cap, and otherwise puts the event
loop's own TLS protocol (the one ``ssl=`` would have used, with its handshake timeout) in
its place on the transport, with the server's protocol inside."""

from __future__ import annotations

import asyncio
import ssl
from asyncio import sslproto
from collections.abc import Callable
from typing import Any, cast


class TlsAcceptor(asyncio.Protocol):
    """One accepted connection on a TLS port; in the transport's hands only until
    ``connection_made`` has swapped in the TLS protocol."""

    __slots__ = ("context", "timeout", "make", "pending", "room")

    def __init__(
        self,
        context: ssl.SSLContext,
        timeout: float,
        make: Callable[[], asyncio.Protocol],
        pending: set[TlsAcceptor],
        room: Callable[[], bool],
    ) -> None:
        self.context = context
        self.timeout = timeout  # the handshake's (then the connection is aborted)
        self.make = make  # the server's protocol, told of the connection after the handshake
        self.pending = pending  # this server's handshakes in progress (``room`` counts them)
        self.room = room  # whether one more connection fits the server's cap

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tcp = cast(asyncio.Transport, transport)
        if not self.room():
            tcp.abort()  # past the cap: closed at once, no handshake
            return
        self.pending.add(self)
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        waiter.add_done_callback(self._handshake_ended)
        tls = _tls_protocol(loop)(
            loop, self.make(), self.context, waiter, server_side=True,
            ssl_handshake_timeout=self.timeout,
        )  # fmt: skip
        # (in place at once: bytes already read go to the handshake, not to this protocol)
        tcp.set_protocol(tls)
        tls.connection_made(tcp)

    def _handshake_ended(self, waiter: asyncio.Future[None]) -> None:
        self.pending.discard(self)
        if not waiter.cancelled():
            waiter.exception()  # (a failed handshake is the client's: nothing to log)


def _tls_protocol(loop: asyncio.AbstractEventLoop) -> Any:
    """The TLS protocol class of ``loop``: uvloop's own, else asyncio's."""
    if type(loop).__module__.startswith("uvloop"):
        from uvloop.loop import SSLProtocol  # type: ignore[import-not-found, attr-defined, unused-ignore]

        return SSLProtocol
    return sslproto.SSLProtocol
