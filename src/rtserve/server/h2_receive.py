"""The receive side of one HTTP/2 connection, as bookkeeping (no socket): what each stream
and the connection may still send, the request bytes held for handlers, and the
WINDOW_UPDATEs that give window back.

A stream's window is given back as its handler takes its messages, never for requests
still queued; a partial message (one not yet whole) gets window only within the budgets:
one per connection, the *leader*, may grow to ``STREAM_WINDOW``; the others' partial
messages together stay within ``CONN_BUFFER``; all connections' within the server's
``CallBudget.max_buffered``. A partial message that finds no room waits, in turn, until a
handler takes something (``promote``); past the server's budget its connection waits in
the server's ``held`` until room is made anywhere.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

from rtserve.server.h2_budgets import (
    CONN_BUFFER,
    CONN_WINDOW,
    INITIAL_WINDOW,
    STREAM_WINDOW,
    CallBudget,
)
from rtserve.server.h2_call import Stream
from rtserve.server.h2_frames import U32, WINDOW_UPDATE, frame
from rtserve.server.h2_windows import DEFAULT_WINDOW, ReceiveWindow, window_increment


class Owner(Protocol):
    """What the receive side needs of its connection: its open streams (by id), whether it
    is closed (nothing is given back then), and a way to send a frame."""

    closed: bool
    streams: dict[int, Stream]

    def send(self, data: bytes) -> None: ...


class Holder(Protocol):
    """What the receive side needs of its server: the server-wide budget, the connections
    held for room, and the wake-up once room is made."""

    budget: CallBudget
    held: dict[Any, None]

    def wake(self) -> None: ...


class Receiver:
    """One connection's (``conn``) receive bookkeeping, within ``server``'s budget."""

    __slots__ = ("inbound", "granted", "buffered", "leader", "waiting", "conn", "server")

    def __init__(self, conn: Owner, server: Holder) -> None:
        self.inbound = ReceiveWindow()  # connection-level, what the peer may still send us
        self.granted = False  # CONN_WINDOW granted
        self.buffered = 0  # request bytes held for handlers (Stream.buffered, summed)
        self.leader: Stream | None = None  # the partial message let past CONN_BUFFER
        self.waiting: deque[Stream] = deque()  # partial messages waiting for room, in turn
        self.conn = conn
        self.server = server

    def grant(self) -> None:
        """The connection's full window (at once without keys, else after a call passed
        them: until then a client has the protocol's 64 KiB)."""
        self.granted = True
        self.inbound.update_at = CONN_WINDOW // 4
        self.inbound.grow(CONN_WINDOW - DEFAULT_WINDOW)
        self.conn.send(frame(WINDOW_UPDATE, 0, 0, U32.pack(CONN_WINDOW - DEFAULT_WINDOW)))

    def received(self, st: Stream, n: int) -> bool:
        """``n`` bytes of DATA on ``st`` (the connection's window already consumed them):
        False if they overran the stream's window (a stream error)."""
        st.recv_window -= n
        st.unreleased += n
        return st.recv_window >= 0

    def buffer(self, st: Stream, n: int) -> None:
        """``n`` more (or fewer) request bytes held for ``st``'s handler."""
        st.buffered += n
        self.buffered += n
        server = self.server
        budget = server.budget
        budget.buffered += n
        if n < 0 and server.held and not budget.full:
            server.wake()

    def room(self, st: Stream) -> bool:
        """Whether ``st``'s partial message may be given more window: as the connection's
        one message let through (the leader, with STREAM_WINDOW), or within CONN_BUFFER;
        never past the server's budget (then the connection waits in ``server.held``)."""
        server = self.server
        if server.budget.full:
            server.held[self.conn] = None  # woken when room is made (server.wake)
            return False
        leader = self.leader
        if leader is None or not leader.buf or not leader.open:
            self.leader = leader = st
        return leader is st or self.buffered <= CONN_BUFFER

    def credit(self, st: Stream) -> None:
        """Give the client back the window of what the handler took (and of partial
        messages, within the budgets), never of requests still queued. Only the leader's
        window grows past INITIAL_WINDOW: other streams' partial messages hold little."""
        if not st.open:
            return
        partial = st.buffered - st.held
        room = not partial or self.room(st)
        target = STREAM_WINDOW if room and self.leader is st else INITIAL_WINDOW
        if not room and not st.waits:  # the partial message waits for room
            st.waits = True
            self.waiting.append(st)
        give = window_increment(
            target, st.recv_window, st.held, 0 if room else partial, bool(st.buf)
        )
        if give:
            st.recv_window += give
            self.conn.send(frame(WINDOW_UPDATE, 0, st.id, U32.pack(give)))
            self.release(st, give)

    def taken(self, st: Stream, n: int) -> None:
        """A streaming call's handler took a message of ``n`` bytes (with its prefix)."""
        st.held -= n
        self.buffer(st, -n)
        if not st.open:
            self.release(st, n)
        else:
            self.credit(st)
        if self.waiting:
            self.promote()

    def promote(self) -> None:
        """Room was made: the partial messages that wait for it get window, in turn, until
        one still finds none (a leader is chosen among them)."""
        waiting = self.waiting
        conn = self.conn
        while waiting and not conn.closed:
            st = waiting.popleft()
            st.waits = False
            if st.id in conn.streams and st.buf and st.open:
                self.credit(st)
                if st.waits:
                    break

    def release(self, st: Stream, n: int) -> None:
        """Give the connection's window back for ``n`` of the bytes received on ``st``."""
        n = min(n, st.unreleased)
        st.unreleased -= n
        self.conn_credit(n)

    def conn_credit(self, n: int) -> None:
        """``n`` bytes received on the connection were processed (or discarded)."""
        if n < 0 or self.conn.closed:
            return
        increment = self.inbound.release(n)
        if increment:
            self.conn.send(frame(WINDOW_UPDATE, 0, 0, U32.pack(increment)))

    def unary_taken(self, st: Stream) -> None:
        """A unary call's one message went to its handler: nothing of it is held any more,
        and the connection's window comes back (the stream's is not needed again)."""
        if st.buffered:
            self.buffer(st, -st.buffered)
        if st.unreleased:
            self.conn_credit(st.unreleased)
            st.unreleased = 0
        if self.waiting:
            self.promote()

    def window_open(self, st: Stream) -> bool:
        """Whether the client has window to send more of ``st``'s request."""
        return self.inbound.available > 0 and st.recv_window > 0

    def end(self, st: Stream) -> None:
        """``st`` ended: what it held is released, its window given back."""
        if st.buffered:
            self.buffer(st, -st.buffered)
        if st.unreleased:
            self.release(st, st.unreleased)
        if self.leader is st:
            self.leader = None
        if self.waiting:
            self.promote()
