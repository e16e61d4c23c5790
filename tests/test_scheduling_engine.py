"""The batcher as an execution engine alone: a scripted policy decides, a fake runtime
runs, a clock tests move. What is checked is what the engine does with the decisions."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from rtserve.errors import DeadlineExceeded, Overloaded, RTServeError, ShuttingDown
from rtserve.protocol.types import Timings
from rtserve.scheduling.base import WAIT_INSTANCE, Request, SchedulingPolicy, Step
from rtserve.scheduling.batcher import Batcher
from tests.fakes import DoublingRuntime, FakeClock, run_async


class ScriptedPolicy(SchedulingPolicy):
    """A FIFO that runs what is queued once ``release`` is set (else waits until
    ``until``), refuses past ``limit`` requests, and records every call the engine makes."""

    def __init__(self, limit: int = 100) -> None:
        self.queue: list[Request] = []
        self.limit = limit
        self.release = True
        self.until = 0
        self.wake = False
        self.asked: list[int] = []  # the instance of each ``next``
        self.finished_calls: list[tuple[int, int, int, int, bool]] = []
        self.resumed_at: list[int] = []

    @property
    def queue_depth(self) -> int:
        return len(self.queue)

    def add(self, request: Request, timeout_s: float, priority: object) -> None:
        if len(self.queue) >= self.limit:
            raise Overloaded("full")
        request.enqueued_ns = request.timings.enqueued = self.engine.clock()
        self.queue.append(request)

    def wake_now(self) -> bool:
        return self.wake

    def next(self, now_ns: int, instance: int) -> Step | None:
        self.asked.append(instance)
        for dead in [p for p in self.queue if p.future.done()]:
            self.queue.remove(dead)
            self.engine.dropped(dead)
        if not self.queue:
            return None
        if instance < 0:
            return WAIT_INSTANCE
        if not self.release:
            return Step([], self.until)
        batch, self.queue = self.queue, []
        return Step(batch)

    def finished(
        self,
        batch: list[Request],
        rows: int,
        instance: int,
        start_ns: int,
        end_ns: int,
        failed: bool = False,
    ) -> None:
        answered = any(p.future.done() for p in batch)
        self.finished_calls.append((len(batch), rows, instance, end_ns - start_ns, answered))

    def resumed(self, yielded_ns: int) -> None:
        self.resumed_at.append(yielded_ns)

    def refuse_early(self, received_ns: int) -> RTServeError | None:
        return Overloaded("early") if received_ns < 0 else None


def engine(
    policy: ScriptedPolicy,
    rt: DoublingRuntime | None = None,
    inline: bool = True,
    held: bool = False,
) -> tuple[Batcher, DoublingRuntime, FakeClock]:
    """``held``: the policy waits (on a timer that will not fire during a test)."""
    rt = rt or DoublingRuntime()
    clock = FakeClock()
    if held:
        policy.release = False
        policy.until = clock.ns + 1_000_000_000
    b = Batcher("m:1", rt, policy, batched=True, inline=inline, clock=clock)
    b.start()
    return b, rt, clock


def rows(n: int, value: float = 1.0) -> dict[str, np.ndarray]:
    return {"x": np.full((n, 4), value, dtype=np.float32)}


async def settle(steps: int = 5) -> None:
    for _ in range(steps):
        await asyncio.sleep(0)


@run_async
async def test_the_policys_batch_is_concatenated_run_once_and_split_back_by_rows() -> None:
    policy = ScriptedPolicy()
    b, rt, clock = engine(policy)
    futures = [b.submit(rows(n, value=n), n, Timings()) for n in (1, 3, 2)]
    results = await asyncio.gather(*futures)
    assert rt.batches == [6]
    assert [r["y"].shape for r in results] == [(1, 4), (3, 4), (2, 4)]
    assert [float(r["y"][0, 0]) for r in results] == [2.0, 6.0, 4.0]
    # Told before any request was answered: 3 requests, 6 rows, instance 0.
    assert policy.finished_calls == [(3, 6, 0, 0, False)]
    assert policy.resumed_at == [clock.ns]  # an inline batch yields the loop once
    await b.stop()


@run_async
async def test_a_refusal_from_the_policy_reaches_the_caller_and_nothing_is_queued() -> None:
    policy = ScriptedPolicy(limit=1)
    b, _, _ = engine(policy, held=True)
    kept = b.submit(rows(1), 1, Timings())
    with pytest.raises(Overloaded, match="full"):
        b.submit(rows(1), 1, Timings(), timeout_s=5.0)
    assert b.queue_depth == 1 and b.busy
    policy.release = True
    b._wake()
    assert (await kept)["y"].shape == (1, 4)
    await b.stop()


@run_async
async def test_refuse_early_is_the_policys_own() -> None:
    policy = ScriptedPolicy()
    b, _, _ = engine(policy)
    assert b.refuse_early(1) is None
    assert isinstance(b.refuse_early(-1), Overloaded)
    await b.stop()


@run_async
async def test_a_wait_ends_when_the_policy_says_wake_after_an_arrival() -> None:
    policy = ScriptedPolicy()
    b, rt, _ = engine(policy, held=True)
    first = b.submit(rows(1), 1, Timings())
    await settle()
    asked = len(policy.asked)
    b.submit(rows(1), 1, Timings())  # the policy does not want to wake: no new decision
    await settle()
    assert len(policy.asked) == asked and rt.batches == []
    policy.wake = True
    policy.release = True
    third = b.submit(rows(1), 1, Timings())  # now it does: the engine asks again
    await asyncio.gather(first, third)
    assert rt.batches == [3]
    await b.stop()


@run_async
async def test_a_wait_ends_at_the_time_the_policy_gave() -> None:
    policy = ScriptedPolicy()
    b, rt, clock = engine(policy, held=True)
    policy.until = clock.ns + 2_000_000  # 2 ms after the engine's (fake) now
    b.submit(rows(1), 1, Timings())
    await settle()
    asked = len(policy.asked)
    await asyncio.sleep(0.05)
    assert len(policy.asked) > asked and rt.batches == []  # woken by the timer, asked again
    policy.release = True
    await b.stop()
    assert rt.batches == [1]


@run_async
async def test_with_every_instance_busy_the_engine_waits_for_one() -> None:
    policy = ScriptedPolicy()
    rt = DoublingRuntime()
    rt.gate = threading.Event()
    b, _, _ = engine(policy, rt, inline=False)
    first = b.submit(rows(1), 1, Timings())
    await settle()
    second = b.submit(rows(1), 1, Timings())
    await settle()
    assert policy.asked[-1] == -1  # asked with no free instance: told to wait for one
    rt.gate.set()
    await asyncio.gather(first, second)
    assert rt.batches == [1, 1] and not policy.resumed_at  # threaded: no loop yield timed
    await b.stop()


@run_async
async def test_a_timed_out_request_is_answered_and_dropped_by_the_policy() -> None:
    policy = ScriptedPolicy()
    b, rt, clock = engine(policy, held=True)
    late = b.submit(rows(1), 1, Timings(), timeout_s=0.001)
    with pytest.raises(DeadlineExceeded, match="timed out"):
        await late
    assert b.stats.shed[("expired", 1)] == 1
    policy.wake = policy.release = True
    kept = b.submit(rows(1), 1, Timings())
    await kept
    assert rt.batches == [1]  # the expired one never ran
    await b.stop()


@run_async
async def test_run_now_answers_in_the_callers_step_on_a_free_instance() -> None:
    policy = ScriptedPolicy()
    b, rt, clock = engine(policy, held=True)
    future = b.submit(rows(1, value=4), 1, Timings())
    batch, policy.queue = policy.queue, []
    b.run_now(batch)  # what a policy does from a frontend's callback
    assert future.done() and float(future.result()["y"][0, 0]) == 8.0
    assert rt.batches == [1] and b.free == [0] and not b.busy
    await b.stop()


@run_async
async def test_stop_drains_what_was_admitted_then_refuses() -> None:
    policy = ScriptedPolicy()
    b, _, _ = engine(policy, DoublingRuntime(instance_count=2), inline=False)
    futures = [b.submit(rows(1, value=i), 1, Timings()) for i in range(6)]
    await b.stop()
    assert all(f.done() and not f.exception() for f in futures) and not b.busy
    with pytest.raises(ShuttingDown):
        b.submit(rows(1), 1, Timings())
