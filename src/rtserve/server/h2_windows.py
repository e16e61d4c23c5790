"""HTTP/2 flow-control windows, as plain arithmetic (no frames are sent here).

``ReceiveWindow``: what the client may still send on the connection, and the WINDOW_UPDATE
owed once enough was processed. ``window_increment``: what a stream's window is given back.
``send_size``: how much of an answer the windows let out now. ``grown``: a send window
after a WINDOW_UPDATE.
"""

from __future__ import annotations

from rtserve.server.h2_frames import FLOW_CONTROL_ERROR, ConnectionError_

DEFAULT_WINDOW = 65535  # every window's size until SETTINGS or WINDOW_UPDATE says otherwise
MAX_WINDOW = 0x7FFFFFFF
MIN_SEND = 512  # an answer waits for this much window, unless the window holds all of it


class ReceiveWindow:
    """The connection's receive window. Bytes received ``consume`` it; bytes processed are
    ``release``d and given back in WINDOW_UPDATEs of at least ``update_at`` bytes."""

    __slots__ = ("available", "unacked", "update_at")

    def __init__(self, size: int = DEFAULT_WINDOW, update_at: int = DEFAULT_WINDOW // 2 + 1):
        self.available = size
        self.unacked = 0  # processed, not yet given back
        self.update_at = update_at

    def consume(self, n: int) -> None:
        self.available -= n
        if self.available < 0:
            raise ConnectionError_(FLOW_CONTROL_ERROR, "connection window exceeded")

    def grow(self, n: int) -> None:
        """The window is enlarged by ``n`` (sent in a WINDOW_UPDATE by the caller)."""
        self.available += n

    def release(self, n: int) -> int:
        """``n`` more bytes processed: the WINDOW_UPDATE increment due now, 0 if none."""
        unacked = self.unacked + n
        if unacked >= self.update_at:
            self.unacked = 0
            self.available += unacked
            return unacked
        self.unacked = unacked
        return 0


def window_increment(target: int, window: int, held: int, withheld: int, partial: bool) -> int:
    """What a stream's receive ``window`` is given back to reach ``target``, less the bytes
    its handler has not taken (``held``) and those ``withheld`` (a partial message waiting
    for room): 0 unless it is worth a frame (a quarter of the target), or the stream holds
    only a partial message (its sender waits for this window to finish it)."""
    give = target - held - window - withheld
    if give >= target // 4 or (give > 0 and held == 0 and partial):
        return give
    return 0


def send_size(stream_window: int, conn_window: int, max_frame: int, n: int) -> int:
    """How many of an answer's ``n`` waiting bytes to send in one DATA frame now: what the
    windows and the frame size allow, 0 (wait) while that is under MIN_SEND and not all."""
    room = min(stream_window, conn_window, max_frame, n)
    if room < n and room < MIN_SEND:
        return 0
    return room


def grown(window: int, increment: int) -> int:
    """The connection's send window after a WINDOW_UPDATE; past 2^31-1 is an error."""
    window += increment
    if window > MAX_WINDOW:
        raise ConnectionError_(FLOW_CONTROL_ERROR, "window too large")
    return window
