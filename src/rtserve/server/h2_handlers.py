"""A call's handler at work: the request messages it is given, the answers it returns, sent
through its connection (``Answering``), and how its failures end the call."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import aclosing
from typing import Any, Protocol

import grpc

from rtserve.api.grpc_service import Method
from rtserve.server.errors import grpc_error, grpc_trailers
from rtserve.server.h2_call import (
    GRPC_PREFIX,
    OK,
    Abort,
    Stream,
    header_block,
    message,
    metadata_bytes,
)
from rtserve.server.h2_send import MAX_OUT_PENDING

log = logging.getLogger("rtserve.server.grpc_h2")  # (where these failures were logged)


class Answering(Protocol):
    """What a handler's call needs of its connection."""

    def head(self, st: Stream) -> None: ...
    def data_out(self, st: Stream, payload: bytes) -> None: ...
    def trailers(self, st: Stream, block: bytes) -> None: ...
    def status(
        self,
        st: Stream,
        code: grpc.StatusCode,
        details: str,
        metadata: Any = (),
        started: bool = False,
    ) -> None: ...
    def taken(self, st: Stream, n: int) -> None: ...


class Requests:
    """A streaming call's requests, as the handler's async iterator; taking one gives its
    bytes back to the client's window."""

    def __init__(
        self, conn: Answering, st: Stream, parse: Callable[[bytes], Any], max_message: int
    ) -> None:
        self.conn, self.st, self.parse, self.max_message = conn, st, parse, max_message

    def __aiter__(self) -> Requests:
        return self

    async def __anext__(self) -> Any:
        st = self.st
        while not st.queue:
            if st.remote_closed:
                raise StopAsyncIteration
            st.waiter = asyncio.get_running_loop().create_future()
            await st.waiter
        data = st.queue.popleft()
        self.conn.taken(st, len(data) + 5)
        return self.parse(await message(data, st.encoding, self.max_message))


async def unary(conn: Answering, st: Stream, method: Method, data: bytes, max_message: int) -> None:
    """Run a unary call's handler on its one request and send its answer."""
    call = st.call
    if call is None or st.local_closed:  # ended before its handler ran
        return
    try:
        request = method.parse(await message(data, st.encoding, max_message))
        reply = await method.fn(request, call)
        body = method.serialize(reply)
    except Abort as exc:
        conn.status(st, exc.code, exc.details, exc.metadata)
        return
    except asyncio.CancelledError:
        return
    except Exception as exc:
        log.exception("gRPC call failed")
        conn.status(st, *grpc_error(exc), grpc_trailers(exc))
        return
    if st.local_closed:
        return
    if len(body) > max_message:
        details = f"response larger than max ({len(body)} vs. {max_message})"
        conn.status(st, grpc.StatusCode.RESOURCE_EXHAUSTED, details)
        return
    conn.head(st)
    conn.data_out(st, GRPC_PREFIX.pack(0, len(body)) + body)
    trailers = OK + header_block(metadata_bytes(call.trailers)) if call.trailers else OK
    conn.trailers(st, trailers)


async def streaming(conn: Answering, st: Stream, method: Method, max_message: int) -> None:
    """Run a streaming call's handler over its requests, sending each answer as it comes
    (waiting while more than MAX_OUT_PENDING bytes of them wait for window)."""
    call = st.call
    if call is None or st.local_closed:
        return
    started = False
    requests = Requests(conn, st, method.parse, max_message)
    try:
        async with aclosing(method.fn(requests, call)) as replies:
            async for reply in replies:
                if st.local_closed:
                    return
                if not started:
                    conn.head(st)
                    started = True
                body = method.serialize(reply)
                conn.data_out(st, GRPC_PREFIX.pack(0, len(body)) + body)
                if st.pending_bytes > MAX_OUT_PENDING:
                    st.drained = asyncio.get_running_loop().create_future()
                    await st.drained
    except Abort as exc:
        conn.status(st, exc.code, exc.details, exc.metadata, started)
        return
    except asyncio.CancelledError:
        return
    except Exception as exc:
        log.exception("gRPC stream failed")
        conn.status(st, *grpc_error(exc), grpc_trailers(exc), started)
        return
    if not st.local_closed:
        if not started:
            conn.head(st)
        conn.trailers(st, OK)
