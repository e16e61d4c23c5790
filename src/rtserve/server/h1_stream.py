"""A streamed HTTP/1.1 answer: a body that arrives in pieces (server-sent events of
generated tokens), sent as each piece comes and no faster than the peer reads."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rtserve.server.h1_parse import Request
    from rtserve.server.http1 import Connection

log = logging.getLogger(__name__)

LAST_CHUNK = b"0\r\n\r\n"  # ends a chunked body
_CLOSING: set[asyncio.Task[None]] = set()  # bodies being closed, held until they are


def chunk(piece: bytes) -> bytes:
    """One piece of a body as a chunk of chunked transfer encoding."""
    return b"%x\r\n%b\r\n" % (len(piece), piece)


async def pump(
    conn: Connection, request: Request, body: AsyncIterator[bytes], chunked: bool
) -> None:
    """Send ``body``'s pieces while the connection lives (the task is cancelled when it is
    lost), then end the answer (``Connection.end_stream``); the body is closed either way."""
    ok = False
    try:
        if request.method != b"HEAD":
            flow = conn.flow
            async for piece in body:
                transport = conn.transport
                if transport is None or transport.is_closing():
                    return
                if piece:
                    transport.write(chunk(piece) if chunked else piece)
                    conn.last_active = conn.server.clock
                if flow.write_paused:
                    await flow.drain()
        ok = True
    except Exception as exc:  # the body failed after its head went out: cut it short
        log.error("error streaming %r %s", request.method, request.path, exc_info=exc)
    finally:
        await close_quietly(body)
    conn.end_stream(request, chunked, ok)


async def close_quietly(body: AsyncIterator[bytes]) -> None:
    """Close a streamed body's iterator (an async generator's ``aclose``); a failure while
    it cleans up is logged, never raised into the transport."""
    aclose = getattr(body, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception as exc:
        log.error("error closing a streamed body", exc_info=exc)


def close_soon(body: AsyncIterator[bytes]) -> None:
    """Close a body that will not be sent (its connection is gone), in a task held here."""
    closing = asyncio.get_running_loop().create_task(close_quietly(body))
    _CLOSING.add(closing)
    closing.add_done_callback(_CLOSING.discard)
