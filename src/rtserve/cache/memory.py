"""L1: an in-process LRU bounded by bytes, with a TTL per entry; get and put are O(1)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

V = TypeVar("V")

# Book-keeping per entry (OrderedDict node, tuple, key object) counted against max_bytes, so
# that many tiny entries cannot grow the process far past the bound.
ENTRY_OVERHEAD_BYTES = 200


class MemoryCache(Generic[V]):
    """Least-recently-used first out once the entries' sizes pass ``max_bytes``.

    Expired entries are dropped when read, and (being the least recently used) are the
    first to go when room is needed. Single-threaded: call it from the event loop only.
    """

    __slots__ = ("max_bytes", "ttl_s", "_clock", "_entries", "_meta", "_bytes")

    def __init__(
        self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        # Values and (expiry, size) apart: no wrapper tuple around a value, so a value that the
        # garbage collector does not track stays untracked (see response_cache).
        self._entries: OrderedDict[bytes, V] = OrderedDict()
        self._meta: dict[bytes, tuple[float, int]] = {}
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        """Bytes accounted to the live entries (sizes plus per-entry overhead)."""
        return self._bytes

    def get(self, key: bytes) -> V | None:
        value = self._entries.get(key)
        if value is None:
            return None
        expires_at, size = self._meta[key]
        if self._clock() >= expires_at:
            del self._entries[key], self._meta[key]
            self._bytes -= size
            return None
        self._entries.move_to_end(key)
        return value

    def put(self, key: bytes, value: V, nbytes: int) -> bool:
        """Store ``value`` (``nbytes`` large); False when it alone exceeds ``max_bytes``."""
        size = nbytes + len(key) + ENTRY_OVERHEAD_BYTES
        entries, meta = self._entries, self._meta
        if entries.pop(key, None) is not None:
            self._bytes -= meta.pop(key)[1]
        if size > self.max_bytes:
            return False
        while self._bytes + size > self.max_bytes:
            evicted, _ = entries.popitem(last=False)
            self._bytes -= meta.pop(evicted)[1]
        entries[key] = value
        meta[key] = (self._clock() + self.ttl_s, size)
        self._bytes += size
        return True

    def clear(self) -> None:
        self._entries.clear()
        self._meta.clear()
        self._bytes = 0
