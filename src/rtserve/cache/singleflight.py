"""Single-flight: identical calls in flight at once run once and all get the result.

The first caller of a key (the leader) runs the function; later callers wait on its
future. A waiter that is cancelled leaves the leader alone (``asyncio.shield``); a leader
that is cancelled (its client went away) hands the work on: the waiters start over and
one of them leads. An exception from the function reaches every caller; it is not kept.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _LeaderCancelled(Exception):
    pass


class SingleFlight(Generic[K, V]):
    __slots__ = ("_calls",)

    def __init__(self) -> None:
        self._calls: dict[K, asyncio.Future[V]] = {}

    def __len__(self) -> int:
        return len(self._calls)

    async def do(self, key: K, fn: Callable[..., Awaitable[V]], *args: Any) -> tuple[V, bool]:
        """``(fn(*args) result, shared)``: shared is True when another caller's run made it."""
        while (fut := self._calls.get(key)) is not None:
            try:
                return await asyncio.shield(fut), True
            except _LeaderCancelled:
                continue
        fut = asyncio.get_running_loop().create_future()
        self._calls[key] = fut
        try:
            value = await fn(*args)
        except asyncio.CancelledError:
            _fail(fut, _LeaderCancelled())
            raise
        except BaseException as e:
            _fail(fut, e)
            raise
        finally:
            if self._calls.get(key) is fut:
                del self._calls[key]
        fut.set_result(value)
        return value, False


def _fail(fut: asyncio.Future[V], exc: BaseException) -> None:
    fut.set_exception(exc)
    fut.exception()  # mark retrieved: no "exception was never retrieved" when nobody waited
