"""Single-flight: identical calls in flight at once run once and all get the result.

The first caller of a key (the leader) runs the function; later callers wait on its
future. A waiter that is cancelled leaves the leader alone (``asyncio.shield``). A leader
whose failure belongs to its own request, not to the work (it was cancelled because its
client went away, or it raised one of the ``handoff`` errors, such as its own deadline),
hands the work on: the waiters start over and one of them leads. Any other exception
from the function reaches every caller; it is not kept.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _LeaderGone(Exception):
    pass


class WaitTimeout(TimeoutError):
    """A waiter's own ``wait_s`` ran out before the leader finished."""


class SingleFlight(Generic[K, V]):
    __slots__ = ("_calls", "_handoff")

    def __init__(self, handoff: tuple[type[BaseException], ...] = ()) -> None:
        """``handoff``: errors of the leader's own request (its deadline, its client),
        which its waiters do not inherit."""
        self._calls: dict[K, asyncio.Future[V]] = {}
        self._handoff = handoff

    def __len__(self) -> int:
        return len(self._calls)

    async def do(
        self, key: K, fn: Callable[..., Awaitable[V]], *args: Any, wait_s: float = 0.0
    ) -> tuple[V, bool]:
        """``(fn(*args) result, shared)``: shared is True when another caller's run made it.

        ``wait_s`` > 0 bounds the time this caller waits on other callers' runs (its own
        deadline): past it, :class:`WaitTimeout`. A run of its own is not bounded here.
        """
        deadline = 0.0
        while (fut := self._calls.get(key)) is not None:
            if wait_s > 0 and not deadline:
                deadline = asyncio.get_running_loop().time() + wait_s
            try:
                return await _wait(fut, deadline), True
            except _LeaderGone:
                continue
        fut = asyncio.get_running_loop().create_future()
        self._calls[key] = fut
        try:
            value = await fn(*args)
        except asyncio.CancelledError:
            _fail(fut, _LeaderGone())
            raise
        except BaseException as e:
            _fail(fut, _LeaderGone() if isinstance(e, self._handoff) else e)
            raise
        finally:
            if self._calls.get(key) is fut:
                del self._calls[key]
        fut.set_result(value)
        return value, False


async def _wait(fut: asyncio.Future[V], deadline: float) -> V:
    if not deadline:
        return await asyncio.shield(fut)
    cm = asyncio.timeout_at(deadline)
    try:
        async with cm:
            return await asyncio.shield(fut)
    except TimeoutError:
        if cm.expired():
            raise WaitTimeout from None
        raise


def _fail(fut: asyncio.Future[V], exc: BaseException) -> None:
    fut.set_exception(exc)
    fut.exception()  # mark retrieved: no "exception was never retrieved" when nobody waited
