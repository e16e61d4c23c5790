"""Direct runs: an idle inline batcher whose one-row batches are cheap runs a request on
arrival (inside ``submit``); one per event loop step, so concurrent requests still batch."""

from __future__ import annotations

import asyncio

import numpy as np

from rtserve.config import DynamicBatching
from rtserve.errors import InferenceFailed
from rtserve.protocol.types import Timings
from rtserve.scheduling import batcher as batcher_module
from rtserve.scheduling.batcher import Batcher
from rtserve.scheduling.policy import DynamicBatchPolicy
from rtserve.scheduling.window import WindowPolicy
from tests.fakes import DoublingRuntime, FakeClock, run_async


class TimedRuntime(DoublingRuntime):
    """Each batch advances the fake clock by ``us_per_batch``."""

    def __init__(self, clock: FakeClock, us_per_batch: float) -> None:
        super().__init__()
        self.clock = clock
        self.us = us_per_batch

    def run(self, instance: int, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.clock.advance_ms(self.us / 1000)
        return super().run(instance, feeds)


def make(
    rt: DoublingRuntime,
    clock: FakeClock,
    inline: bool = True,
    delay_us: int = 0,
    bound_us: int = 200,
) -> Batcher:
    """A batcher made with ``RTSERVE_DIRECT_MAX_US=bound_us`` (read at import: set here)."""
    policy = DynamicBatchPolicy(
        rt.max_batch_size, DynamicBatching(max_queue_delay_us=delay_us, adaptive_delay=False)
    )
    saved = batcher_module.DIRECT_MAX_NS
    batcher_module.DIRECT_MAX_NS = bound_us * 1000
    try:
        return Batcher(
            "m:1", rt, WindowPolicy(policy, 64, lambda: True), batched=True, inline=inline,
            clock=clock,
        )  # fmt: skip
    finally:
        batcher_module.DIRECT_MAX_NS = saved


def row(value: float = 1.0) -> dict[str, np.ndarray]:
    return {"x": np.full((1, 4), value, dtype=np.float32)}


async def settle(steps: int = 5) -> None:
    for _ in range(steps):
        await asyncio.sleep(0)


async def first_batch(b: Batcher) -> None:
    """One request through the gather loop: the batcher learns the one-row time."""
    assert not b.direct
    fut = b.submit(row(), 1, Timings())
    assert not fut.done()  # nothing measured yet: the gather loop runs it
    await fut
    await settle()


@run_async
async def test_a_cheap_model_answers_a_lone_request_before_submit_returns() -> None:
    clock = FakeClock()
    rt = TimedRuntime(clock, us_per_batch=20)
    b = make(rt, clock)
    b.start()
    await first_batch(b)
    assert b.direct and b.solo_ns == 20_000
    called: list[asyncio.Future] = []
    t = Timings()
    fut = b.submit(row(3.0), 1, t, timeout_s=5.0, on_done=called.append)
    assert fut.done() and called == [fut]  # answered, its done callback called once, now
    assert np.all(fut.result()["y"] == 6.0)
    assert t.batch_size == 1 and t.batch_end - t.batch_start == 20_000
    assert b.direct_runs == 1 and rt.batches == [1, 1]
    await settle()
    assert called == [fut]  # (not called again as a scheduled callback)
    assert not b.busy
    await b.stop()


@run_async
async def test_requests_arriving_in_the_same_step_after_a_direct_run_are_batched() -> None:
    clock = FakeClock()
    rt = TimedRuntime(clock, us_per_batch=20)
    b = make(rt, clock)
    b.start()
    await first_batch(b)
    futures = [b.submit(row(float(i)), 1, Timings()) for i in range(4)]
    assert futures[0].done() and not any(f.done() for f in futures[1:])
    results = await asyncio.gather(*futures)
    assert rt.batches == [1, 1, 3]  # the first alone, the other three as one batch
    for i, out in enumerate(results):
        assert np.all(out["y"] == 2 * i)
    await settle()
    fut = b.submit(row(), 1, Timings())  # a later step: direct again
    assert fut.done() and b.direct_runs == 2
    await b.stop()


@run_async
async def test_a_slow_model_a_threaded_one_or_a_zero_bound_never_runs_directly() -> None:
    clock = FakeClock()
    slow = TimedRuntime(clock, us_per_batch=500)  # over the 200 us bound
    b = make(slow, clock)
    b.start()
    for _ in range(3):
        fut = b.submit(row(), 1, Timings())
        assert not fut.done()
        await fut
        await settle()
    assert not b.direct and b.direct_runs == 0 and b.solo_ns == 500_000
    await b.stop()

    clock = FakeClock()
    threaded = make(TimedRuntime(clock, us_per_batch=5), clock, inline=False)
    threaded.start()
    for _ in range(3):
        fut = threaded.submit(row(), 1, Timings())
        assert not fut.done()
        await fut
    assert threaded.direct_runs == 0
    await threaded.stop()

    clock = FakeClock()
    off = make(TimedRuntime(clock, us_per_batch=5), clock, bound_us=0)  # the default
    off.start()
    for _ in range(3):
        fut = off.submit(row(), 1, Timings())
        assert not fut.done()
        await fut
        await settle()
    assert off.direct_runs == 0 and not off.direct
    await off.stop()


@run_async
async def test_a_model_that_turns_slow_stops_running_directly() -> None:
    clock = FakeClock()
    rt = TimedRuntime(clock, us_per_batch=20)
    b = make(rt, clock)
    b.start()
    await first_batch(b)
    rt.us = 2000
    runs = 0
    while b.direct:
        fut = b.submit(row(), 1, Timings())
        assert fut.done()
        runs += 1
        await settle()
    # The estimate climbs 5% a run: from 20 us past 1.5 x 200 us in about 56 runs.
    assert 45 < runs < 65
    fut = b.submit(row(), 1, Timings())
    assert not fut.done()
    await fut
    await b.stop()


@run_async
async def test_a_delay_window_the_policy_keeps_is_not_bypassed() -> None:
    clock = FakeClock()
    rt = TimedRuntime(clock, us_per_batch=20)
    b = make(rt, clock, delay_us=50_000)  # the policy waits 50 ms for more rows
    b.start()
    first = b.submit(row(), 1, Timings())
    await settle()
    clock.advance_ms(60)
    b._wake()
    await first
    await settle()
    assert b.direct  # cheap, but the policy wants to wait: no direct run
    fut = b.submit(row(), 1, Timings())
    assert not fut.done() and b.direct_runs == 0
    await settle()
    second = b.submit(row(2.0), 1, Timings())
    await settle()
    clock.advance_ms(60)
    b._wake()
    await asyncio.gather(fut, second)
    assert rt.batches == [1, 2]
    await b.stop()


@run_async
async def test_a_direct_run_that_fails_answers_its_request_with_the_error() -> None:
    clock = FakeClock()
    rt = TimedRuntime(clock, us_per_batch=20)
    b = make(rt, clock)
    b.start()
    await first_batch(b)
    rt.fail_next = RuntimeError("boom")  # (a failed run teaches nothing about its time)
    fut = b.submit(row(), 1, Timings())
    assert fut.done() and isinstance(fut.exception(), InferenceFailed)
    assert "m:1" in str(fut.exception())
    await settle()
    ok = b.submit(row(4.0), 1, Timings())
    assert ok.done() and np.all(ok.result()["y"] == 8.0)
    await b.stop()


@run_async
async def test_one_preempted_run_delays_direct_runs_only_a_few_requests() -> None:
    clock = FakeClock()
    rt = TimedRuntime(clock, us_per_batch=5000)  # the first run was preempted: 5 ms
    b = make(rt, clock)
    b.start()
    await first_batch(b)
    rt.us = 20
    gathered = 0
    while not b.direct:
        fut = b.submit(row(), 1, Timings())
        await fut
        await settle()
        gathered += 1
    assert gathered <= 8  # (halving: 5 ms to under 200 us in 5 runs)
    assert b.submit(row(), 1, Timings()).done()
    await b.stop()
