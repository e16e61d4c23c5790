"""The circuit breaker's states, and single-flight's sharing and hand-over."""

from __future__ import annotations

import asyncio

import pytest

from rtserve.cache.breaker import BreakerState, CircuitBreaker
from rtserve.cache.singleflight import SingleFlight


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_consecutive_failures_and_probes_after_cooldown() -> None:
    clock = Clock()
    b = CircuitBreaker(3, cooldown_s=2.0, clock=clock)
    assert b.allow()
    assert not b.record_failure()
    b.record_success()  # resets the count
    assert not b.record_failure() and not b.record_failure()
    assert b.record_failure()
    assert b.state is BreakerState.OPEN and not b.allow()
    assert not b.probe_due()
    clock.now = 2.0
    assert b.probe_due()
    assert b.state is BreakerState.HALF_OPEN and not b.allow()
    assert not b.probe_due()  # one probe per cool-down
    assert b.record_failure()  # the probe failed: open again, cool-down restarts
    clock.now = 3.0
    assert not b.probe_due()
    clock.now = 4.0
    assert b.probe_due()
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.allow()


def test_singleflight_runs_once_for_concurrent_callers() -> None:
    async def main() -> None:
        sf: SingleFlight[str, int] = SingleFlight()
        runs = 0
        gate = asyncio.Event()

        async def work() -> int:
            nonlocal runs
            runs += 1
            await gate.wait()
            return 42

        tasks = [asyncio.create_task(sf.do("k", work)) for _ in range(10)]
        await asyncio.sleep(0.01)
        gate.set()
        results = await asyncio.gather(*tasks)
        assert runs == 1
        assert sorted(r[1] for r in results) == [False] + [True] * 9
        assert {r[0] for r in results} == {42}
        assert len(sf) == 0

    asyncio.run(main())


def test_singleflight_shares_errors_and_hands_over_when_the_leader_is_cancelled() -> None:
    async def main() -> None:
        sf: SingleFlight[str, int] = SingleFlight()
        gate = asyncio.Event()
        runs = 0

        async def fails() -> int:
            await gate.wait()
            raise RuntimeError("model failed")

        tasks = [asyncio.create_task(sf.do("e", fails)) for _ in range(3)]
        await asyncio.sleep(0.01)
        gate.set()
        for r in await asyncio.gather(*tasks, return_exceptions=True):
            assert isinstance(r, RuntimeError)

        async def slow() -> int:
            nonlocal runs
            runs += 1
            await asyncio.sleep(0.05)
            return runs

        leader = asyncio.create_task(sf.do("c", slow))
        await asyncio.sleep(0.01)
        waiters = [asyncio.create_task(sf.do("c", slow)) for _ in range(3)]
        await asyncio.sleep(0.01)
        leader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leader
        results = await asyncio.gather(*waiters)
        assert runs == 2  # one waiter took over; the others shared its run
        assert {v for v, _ in results} == {2}

    asyncio.run(main())
