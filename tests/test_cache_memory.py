"""L1: LRU by bytes with TTL."""

from __future__ import annotations

from rtserve.cache.memory import ENTRY_OVERHEAD_BYTES, MemoryCache


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def k(i: int) -> bytes:
    return i.to_bytes(32, "little")


ENTRY = 32 + ENTRY_OVERHEAD_BYTES  # accounted size of a zero-byte value under a 32-byte key


def test_hit_miss_and_ttl_expiry() -> None:
    clock = Clock()
    c: MemoryCache[str] = MemoryCache(10_000, ttl_s=5.0, clock=clock)
    assert c.get(k(1)) is None
    c.put(k(1), "a", 10)
    assert c.get(k(1)) == "a"
    clock.now += 4.9
    assert c.get(k(1)) == "a"
    clock.now += 0.2
    assert c.get(k(1)) is None
    assert len(c) == 0 and c.size_bytes == 0


def test_byte_bound_evicts_least_recently_used_first() -> None:
    c: MemoryCache[int] = MemoryCache(3 * (ENTRY + 100), ttl_s=60)
    for i in range(3):
        assert c.put(k(i), i, 100)
    assert c.get(k(0)) == 0  # 0 is now most recent; 1 is the oldest
    c.put(k(3), 3, 100)
    assert c.get(k(1)) is None
    assert [c.get(k(i)) for i in (0, 2, 3)] == [0, 2, 3]
    assert c.size_bytes == 3 * (ENTRY + 100) <= c.max_bytes
    c.put(k(4), 4, 250)  # needs the room of two entries
    assert len(c) == 2 and c.size_bytes <= c.max_bytes
    assert c.get(k(4)) == 4


def test_oversized_value_is_not_stored_and_replacing_updates_size() -> None:
    c: MemoryCache[str] = MemoryCache(1000, ttl_s=60)
    assert not c.put(k(1), "big", 1000)
    assert len(c) == 0
    c.put(k(1), "a", 100)
    c.put(k(1), "b", 50)
    assert c.get(k(1)) == "b" and c.size_bytes == ENTRY + 50


def test_many_entries_stay_within_the_bound() -> None:
    c: MemoryCache[int] = MemoryCache(100_000, ttl_s=60)
    for i in range(20_000):
        c.put(k(i), i, i % 500)
        assert c.size_bytes <= c.max_bytes
    assert c.get(k(19_999)) == 19_999
