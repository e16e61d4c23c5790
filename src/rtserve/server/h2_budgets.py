"""What a gRPC client over HTTP/2 may cost, per connection and per server.

``FrameBudget``: frames that make no progress and streams reset, per connection, past which
the connection gets GOAWAY ``ENHANCE_YOUR_CALM``. ``CallBudget``: calls in progress per server
and per client address, and request bytes held for handlers across all connections (past
``max_buffered`` a partial message gets no more window; the connections held are woken in
turn once room is made). ``stall_limit``: how long a request may make no progress.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from rtserve.errors import RTServeError
from rtserve.server.h2_frames import ENHANCE_YOUR_CALM, ConnectionError_

MAX_CALLS = 10_000  # calls in progress in this process; more are RESOURCE_EXHAUSTED
MAX_CALLS_PER_ADDRESS = MAX_CALLS // 4  # calls in progress from one client address
MAX_RESETS = 10_000  # streams reset per SWEEP_S (by the client or for its errors), then GOAWAY
# What one stream may send ahead of its handler: INITIAL_WINDOW (SETTINGS), and STREAM_WINDOW
# for the connection's one partial message let through (``Connection.leader``).
INITIAL_WINDOW = 64 << 10
STREAM_WINDOW = 1 << 20
CONN_WINDOW = 16 << 20  # granted once a call on the connection passed authentication
# Requests received and not yet taken by a handler (partial and whole messages): past
# CONN_BUFFER on a connection only its leader is given more window (the others wait their
# turn); past SERVER_BUFFER (at least twice the message limit) for all connections, none is.
CONN_BUFFER = 4 << 20


def _env_bytes(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit():
        raise RTServeError(
            f"{name} must be a number of bytes (a non-negative integer), got {value!r}"
        )
    return int(value)


SERVER_BUFFER = _env_bytes("RTSERVE_H2_SERVER_BUFFER", 256 << 20)  # (the variable: tests, tuning)
REQUEST_STALL_S = 5.0  # a request (headers, or a partial message) without progress is ended
WINDOW_STALL_S = 30.0  # the same while it has no window to send in (the budgets hold it)
# Frames without progress (PING, PRIORITY, SETTINGS, WINDOW_UPDATE, RST_STREAM, GOAWAY,
# CONTINUATION, empty or tiny DATA, refused calls) spend a connection's budget: CALM_BURST at
# once, CALM_RATE more per second; each accepted call earns CALL_CREDIT, each answer frame one.
# A call reset before its answer (by the client, or for its errors) gives its credit back.
CALM_BURST = 1000
CALM_RATE = 100.0
CALL_CREDIT = 4
TINY_DATA = 64  # a DATA frame this small that completes no message is no progress


class FrameBudget:
    """One connection's allowance of frames without progress (a token bucket: ``burst`` at
    once, ``rate`` more per second, earned back by progress) and of reset streams."""

    __slots__ = ("left", "at", "clock", "burst", "rate", "resets", "max_resets")

    def __init__(
        self,
        clock: Callable[[], float],
        burst: float = CALM_BURST,
        rate: float = CALM_RATE,
        max_resets: int = MAX_RESETS,
    ) -> None:
        self.clock = clock
        self.burst = burst
        self.rate = rate
        self.left = burst  # frames without progress still allowed
        self.at = clock()  # when it was last refilled
        self.resets = 0  # streams reset (by the client or for its errors) this period
        self.max_resets = max_resets

    def spend(self, cost: float = 1.0) -> None:
        """A frame that makes no progress; past the budget, ENHANCE_YOUR_CALM."""
        self.left -= cost
        if self.left < 0:
            now = self.clock()
            self.left = min(self.burst, self.left + (now - self.at) * self.rate)
            self.at = now
            if self.left < 0:
                raise ConnectionError_(ENHANCE_YOUR_CALM, "too many frames without progress")

    def earn(self, n: float) -> None:
        """Progress (a call accepted, answer frames sent) earns ``n`` frames back."""
        left = self.left + n
        self.left = left if left < self.burst else self.burst

    def reset(self) -> None:
        """A stream was reset: "rapid reset", and "made you reset", end the connection."""
        self.resets += 1
        if self.resets > self.max_resets:
            raise ConnectionError_(ENHANCE_YOUR_CALM, "too many reset streams")

    def new_period(self) -> None:
        self.resets = 0


class CallBudget:
    """One server's calls in progress (in all, and per client address) and the request
    bytes its connections hold for handlers."""

    __slots__ = (
        "max_calls",
        "max_address_calls",
        "calls",
        "by_address",
        "buffered",
        "max_buffered",
    )

    def __init__(self, max_calls: int, max_message: int) -> None:
        self.max_calls = max_calls
        self.max_address_calls = max(1, max_calls * MAX_CALLS_PER_ADDRESS // MAX_CALLS)
        self.calls = 0
        self.by_address: dict[str, int] = {}  # calls in progress per client address
        self.buffered = 0  # request bytes held for handlers, all connections
        self.max_buffered = max(SERVER_BUFFER, 2 * (max_message + 5))

    def refusal(self, address: str) -> str | None:
        """Why one more call from ``address`` is refused (RESOURCE_EXHAUSTED), None if not."""
        if self.calls >= self.max_calls:
            return "too many calls in progress"
        if self.by_address.get(address, 0) >= self.max_address_calls:
            return "too many calls in progress from this address"
        return None

    def begin(self, address: str) -> None:
        self.calls += 1
        self.by_address[address] = self.by_address.get(address, 0) + 1

    def end(self, address: str) -> None:
        self.calls -= 1
        left = self.by_address[address] - 1
        if left:
            self.by_address[address] = left
        else:
            del self.by_address[address]

    @property
    def full(self) -> bool:
        """Whether the bytes held for handlers are past ``max_buffered``."""
        return self.buffered > self.max_buffered


def stall_limit(window_open: bool) -> tuple[float, str]:
    """How long a request may make no progress (and the limit's name): REQUEST_STALL_S, or
    WINDOW_STALL_S while it has no window to send in (the server's budgets hold it)."""
    if window_open:
        return REQUEST_STALL_S, "REQUEST_STALL_S"
    return WINDOW_STALL_S, "WINDOW_STALL_S"
