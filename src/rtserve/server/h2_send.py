"""Answer frames held back by HTTP/2 flow control, per stream, and the connection's send
window. The connection hands each answer frame here with the function that writes
frames; what the windows allow goes out now, the rest waits on its stream until a
WINDOW_UPDATE or SETTINGS makes room. Nothing here calls back into the connection: a
method reports the frames it sent and whether the stream's last frame was among them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from rtserve.server.h2_call import Stream
from rtserve.server.h2_frames import DATA, frame
from rtserve.server.h2_windows import DEFAULT_WINDOW, MIN_SEND, send_size

Send = Callable[[bytes], None]
MAX_OUT_PENDING = 1 << 20  # answer bytes a stream handler may queue before it waits


class Outbox:
    """The connection's send window (``window``), the peer's frame size, the streams with
    answer data waiting (``blocked``) and, of those, the ones the connection's window
    holds, in turn (``ready``)."""

    __slots__ = ("window", "max_frame", "blocked", "ready")

    def __init__(self) -> None:
        self.window = DEFAULT_WINDOW  # what the peer lets us send on the connection
        self.max_frame = 16384  # the peer's SETTINGS_MAX_FRAME_SIZE
        self.blocked: set[Stream] = set()
        self.ready: deque[Stream] = deque()

    def headers(self, st: Stream, headers: bytes, ends: bool, send: Send) -> bool:
        """A HEADERS frame, after the stream's answer data still waiting for window.
        True if it went out now and ends the stream."""
        if st.pending:
            st.pending.append((False, headers, ends))
            return False
        send(headers)
        return ends

    def data(self, st: Stream, payload: bytes, send: Send) -> tuple[int, bool]:
        """A DATA frame's payload: sent now if the windows hold it all, else queued on the
        stream. Returns (frames sent, whether the stream ended)."""
        n = len(payload)
        if not st.pending and n <= st.send_window and n <= self.window and n <= self.max_frame:
            st.send_window -= n
            self.window -= n
            send(frame(DATA, 0, st.id, payload))
            return 1, False
        st.pending.append((True, payload, False))
        st.pending_bytes += n
        self.blocked.add(st)
        if st.queued:
            return 0, False
        return self.drain(st, send)

    def drain(self, st: Stream, send: Send) -> tuple[int, bool]:
        """Send what the windows allow of ``st``'s queued answer (a DATA frame once the
        window holds MIN_SEND bytes, or all that is left); while the connection's window is
        what holds it, ``st`` waits in ``ready``. Returns (frames sent, whether the stream
        ended); a handler waiting for its queue to shrink is woken."""
        pending = st.pending
        sent = 0
        ended = False
        while pending:
            is_data, data, ends = pending[0]
            if not is_data:
                pending.popleft()
                send(data)
                sent += 1
                ended = ended or ends
                continue
            n = len(data)
            room = send_size(st.send_window, self.window, self.max_frame, n)
            if not room:
                if st.send_window >= min(n, MIN_SEND) and not st.queued:
                    st.queued = True
                    self.ready.append(st)
                break
            st.send_window -= room
            self.window -= room
            st.pending_bytes -= room
            send(frame(DATA, 0, st.id, data[:room] if room < n else data))
            sent += 1
            if room < n:
                pending[0] = (True, data[room:], False)
            else:
                pending.popleft()
        if not pending:
            self.blocked.discard(st)
        drained = st.drained
        if drained is not None and st.pending_bytes <= MAX_OUT_PENDING // 2:
            if not drained.done():
                drained.set_result(None)
            st.drained = None
        return sent, ended

    def initial_window(self, streams: dict[int, Stream], delta: int) -> None:
        """The peer changed its initial stream window by ``delta``: every stream's changes."""
        for st in streams.values():
            st.send_window += delta

    def drop(self, st: Stream) -> None:
        """The stream is gone: its queued answer with it."""
        st.pending.clear()
        st.pending_bytes = 0
        self.blocked.discard(st)

    def clear(self) -> None:
        self.blocked.clear()
        self.ready.clear()
