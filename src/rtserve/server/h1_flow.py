"""Flow control of one HTTP/1.1 connection's transport.

Reading is paused by the connection (answers pile up, or the peer does not read them);
writing is paused by the transport (its buffer passed the high-water mark) until it drains.
A streamed answer waits in ``drain`` for the peer to read.
"""

from __future__ import annotations

import asyncio


class FlowControl:
    """The read and write state of one transport (``transport`` is None once it is lost)."""

    __slots__ = ("transport", "read_paused", "write_paused", "write_paused_at", "_drained")

    def __init__(self, transport: asyncio.Transport | None = None) -> None:
        self.transport = transport
        self.read_paused = False  # the transport's reads, paused by us
        self.write_paused = False  # by the transport: its buffer is above the high-water mark
        self.write_paused_at = 0.0
        self._drained: asyncio.Future[None] | None = None  # a stream waits for the peer

    def pause_reading(self) -> None:
        if not self.read_paused and self.transport is not None:
            self.transport.pause_reading()
            self.read_paused = True

    def resume_reading(self) -> None:
        if self.read_paused and self.transport is not None:
            self.transport.resume_reading()
            self.read_paused = False

    def pause_writing(self, now: float) -> None:
        self.write_paused = True
        self.write_paused_at = now

    def resume_writing(self) -> None:
        self.write_paused = False
        drained = self._drained
        if drained is not None:
            self._drained = None
            if not drained.done():
                drained.set_result(None)

    async def drain(self) -> None:
        """Wait until the transport takes writes again (at once if it does)."""
        if self.write_paused:
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained
