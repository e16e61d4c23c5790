"""A call and its reply: what every entry (HTTP/1.1, Ray's ASGI, Lambda) hands the
application and gets back, with no socket in sight.

A call is anything with the attributes of ``Call`` (the HTTP/1.1 server's parsed request
has them, so its hot path allocates nothing more); an adapter that builds its own uses
``CallData``. A reply is a whole ``Answer``, a ``Streamed`` answer of server-sent events, or
a ``Pending`` one that an adapter awaits (``settle``) or gathers into one body (``gather``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol

Headers = list[tuple[bytes, bytes]]
Answer = tuple[int, bytes, Headers]


class Call(Protocol):
    """One request: ``path`` canonical (``server/paths.py``), ``headers`` by lower-case
    name, ``received_ns`` from ``time.perf_counter_ns``; ``checked``: the keys and rate
    limit were applied at its head already."""

    method: bytes
    path: str
    headers: dict[bytes, bytes]
    body: bytes
    received_ns: int
    checked: bool


@dataclass(slots=True)
class CallData:
    """A call an adapter builds from its own I/O (an ASGI scope, a Lambda event)."""

    method: bytes
    path: str
    headers: dict[bytes, bytes]
    body: bytes
    received_ns: int
    checked: bool = True


class Responder(Protocol):
    """Where an answer is sent when it is ready (the HTTP/1.1 connection is one):
    ``on_lost`` is called if the client goes away first."""

    on_lost: Callable[[], object] | None

    def respond(
        self, status: int, body: bytes, headers: Headers, encoded: bytes | None = None
    ) -> None: ...


@dataclass(slots=True)
class Streamed:
    """A 200 answer of server-sent events, each sent as ``chunks`` yields it; closing
    ``chunks`` (the client went away) aborts the generation."""

    headers: Headers
    chunks: AsyncGenerator[bytes, None]


@dataclass(slots=True)
class Pending:
    """An answer sent whole once ``answer()`` returns; cancelling the task that awaits it
    (the client went away) aborts what it waits on, unless ``abort_on_lost`` is false (a
    model load runs to its end)."""

    answer: Callable[[], Awaitable[Answer | Streamed]]
    abort_on_lost: bool = True


Reply = Answer | Streamed | Pending


class FutureResponder:
    """A ``Responder`` for adapters that await: the answer lands in ``future``."""

    __slots__ = ("future", "on_lost")

    def __init__(self) -> None:
        self.future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self.on_lost: Callable[[], object] | None = None

    def respond(
        self, status: int, body: bytes, headers: Headers, encoded: bytes | None = None
    ) -> None:
        if not self.future.done():
            self.future.set_result((status, body, headers))


async def settle(reply: Reply) -> Answer | Streamed:
    """The reply with a pending answer awaited (for a transport that awaits in place)."""
    return await reply.answer() if isinstance(reply, Pending) else reply


async def gather(reply: Reply) -> Answer:
    """The whole answer, a stream's events gathered into one body (for a transport that
    cannot stream, such as API Gateway)."""
    done = await settle(reply)
    if isinstance(done, Streamed):
        async with aclosing(done.chunks):
            return 200, b"".join([chunk async for chunk in done.chunks]), done.headers
    return done
