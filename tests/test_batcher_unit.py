"""The batcher alone: a fake runtime, an injectable clock, no sleeps."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import numpy as np
import pytest

from rtserve.config import DynamicBatching
from rtserve.errors import (
    DeadlineExceeded,
    InferenceFailed,
    ObjectiveRefused,
    Overloaded,
    ShuttingDown,
)
from rtserve.protocol.types import Timings
from rtserve.scheduling import slo
from rtserve.scheduling.batcher import Batcher
from rtserve.scheduling.policy import DynamicBatchPolicy
from rtserve.scheduling.slo_policy import (
    OVERDUE_SHARE,
    REFUSAL_HOLD,
    BatchTimeModel,
    SLOController,
    SLOPolicy,
)
from rtserve.scheduling.window import WindowPolicy
from tests.fakes import DoublingRuntime, FakeClock, run_async


def make(
    runtime: DoublingRuntime,
    clock: FakeClock,
    delay_us: int = 0,
    max_queue: int = 64,
    inline: bool = True,
    more_expected: bool = True,
    adaptive: bool = False,
) -> Batcher:
    policy = DynamicBatchPolicy(
        runtime.max_batch_size,
        DynamicBatching(max_queue_delay_us=delay_us, adaptive_delay=adaptive),
    )
    return Batcher(
        "m:1",
        runtime,
        WindowPolicy(policy, max_queue, lambda: more_expected),
        batched=True,
        inline=inline,
        clock=clock,
    )


def make_slo(
    runtime: DoublingRuntime,
    clock: FakeClock,
    p99_ms: float,
    model: BatchTimeModel,
    overdue_share: float = OVERDUE_SHARE,
) -> tuple[Batcher, SLOController]:
    """An inline batcher under a latency objective, with its controller."""
    controller = SLOController(slo.Objective(p99_ns=int(p99_ms * slo.MS)), model)
    policy = SLOPolicy(controller, runtime.max_batch_size, 64, overdue_share)
    batcher = Batcher("m:1", runtime, policy, batched=True, inline=True, clock=clock)
    return batcher, controller


def rows(n: int, value: float = 1.0, width: int = 4) -> dict[str, np.ndarray]:
    return {"x": np.full((n, width), value, dtype=np.float32)}


async def settle(steps: int = 5) -> None:
    for _ in range(steps):
        await asyncio.sleep(0)


@run_async
async def test_requests_queued_together_run_as_one_batch_and_split_back() -> None:
    rt, clock = DoublingRuntime(), FakeClock()
    b = make(rt, clock)
    b.start()
    futures = [b.submit(rows(n, value=n), n, Timings()) for n in (1, 2, 3)]
    results = await asyncio.gather(*futures)
    assert rt.batches == [6]
    for n, out in zip((1, 2, 3), results, strict=True):
        assert out["y"].shape == (n, 4)
        assert np.all(out["y"] == 2 * n)
    await b.stop()


@run_async
async def test_waits_for_the_delay_by_the_clock_then_dispatches() -> None:
    rt, clock = DoublingRuntime(), FakeClock()
    b = make(rt, clock, delay_us=50_000)  # 50 ms window, measured by the fake clock
    b.start()
    fut = b.submit(rows(1), 1, Timings())
    await settle()
    assert rt.batches == [] and not fut.done()
    clock.advance_ms(50)
    b._wake()  # what the loop timer does when the window ends
    await settle()
    assert rt.batches == [1] and fut.done()
    await b.stop()


@run_async
async def test_full_batch_dispatches_without_waiting_for_the_delay() -> None:
    rt, clock = DoublingRuntime(max_batch_size=4), FakeClock()
    b = make(rt, clock, delay_us=10_000_000)
    b.start()
    futures = [b.submit(rows(1), 1, Timings()) for _ in range(4)]
    await asyncio.gather(*futures)
    assert rt.batches == [4]
    await b.stop()


@run_async
async def test_adaptive_delay_skips_the_wait_when_no_more_requests_are_expected() -> None:
    rt, clock = DoublingRuntime(), FakeClock()
    b = make(rt, clock, delay_us=10_000_000, more_expected=False, adaptive=True)
    b.start()
    out = await b.submit(rows(1), 1, Timings())
    assert rt.batches == [1] and out["y"].shape == (1, 4)
    await b.stop()


@run_async
async def test_batches_never_exceed_max_batch_size() -> None:
    rt, clock = DoublingRuntime(max_batch_size=4), FakeClock()
    b = make(rt, clock)
    b.start()
    await asyncio.gather(*[b.submit(rows(3), 3, Timings()) for _ in range(3)])
    assert rt.batches == [3, 3, 3]
    await b.stop()


@run_async
async def test_full_queue_refuses_at_once() -> None:
    rt, clock = DoublingRuntime(), FakeClock()
    b = make(rt, clock, delay_us=10_000_000, max_queue=2)
    b.start()
    b.submit(rows(1), 1, Timings())
    b.submit(rows(1), 1, Timings())
    with pytest.raises(Overloaded, match="queue is full"):
        b.submit(rows(1), 1, Timings())
    clock.advance_ms(10_000)
    b._wake()
    await b.drain()
    await b.stop()


@run_async
async def test_deadline_expires_a_queued_request_and_it_is_never_run() -> None:
    rt, clock = DoublingRuntime(), FakeClock()
    b = make(rt, clock, delay_us=10_000_000)
    b.start()
    fut = b.submit(rows(1), 1, Timings(), timeout_s=0.001)
    with pytest.raises(DeadlineExceeded, match="timed out"):
        await fut
    clock.advance_ms(10_000)
    b._wake()
    await settle()
    assert rt.batches == []
    await b.stop()


@run_async
async def test_a_failing_batch_fails_each_request_with_the_model_named() -> None:
    rt, clock = DoublingRuntime(), FakeClock()
    rt.fail_negative = True
    b = make(rt, clock)
    b.start()
    futures = [b.submit(rows(1, value=-1), 1, Timings()) for _ in range(2)]
    results = await asyncio.gather(*futures, return_exceptions=True)
    assert rt.batches == [2, 1, 1]  # the batch, then each request alone
    for r in results:
        assert isinstance(r, InferenceFailed)
        assert "m:1" in r.message and "ValueError" in r.message
        assert "/secret" not in r.message  # details go to the log, not to clients
    # The batcher keeps serving.
    out = await b.submit(rows(1), 1, Timings())
    assert np.all(out["y"] == 2)
    await b.stop()


@run_async
async def test_one_request_that_fails_does_not_fail_the_others_in_its_batch() -> None:
    rt, clock = DoublingRuntime(), FakeClock()
    rt.fail_negative = True
    b = make(rt, clock)
    b.start()
    values = (1.0, 2.0, -1.0, 3.0)
    futures = [b.submit(rows(2, value=v), 2, Timings()) for v in values]
    results = await asyncio.gather(*futures, return_exceptions=True)
    assert rt.batches == [8, 2, 2, 2, 2]
    for v, r in zip(values, results, strict=True):
        if v < 0:
            assert isinstance(r, InferenceFailed)
        else:
            assert isinstance(r, dict) and r["y"].shape == (2, 4) and np.all(r["y"] == 2 * v)
    # A failure once, for the whole batch, is retried request by request: all answered.
    rt.fail_next = RuntimeError("a passing fault")
    results = await asyncio.gather(*(b.submit(rows(1), 1, Timings()) for _ in range(3)))
    assert all(np.all(r["y"] == 2) for r in results)
    await b.stop()


@run_async
async def test_ragged_requests_of_different_lengths_are_never_mixed() -> None:
    rt, clock = DoublingRuntime(ragged=True), FakeClock()
    b = make(rt, clock)
    b.start()
    short = b.submit(rows(1, width=3), 1, Timings())
    long = b.submit(rows(1, width=5), 1, Timings())
    short2 = b.submit(rows(1, width=3), 1, Timings())
    out = await asyncio.gather(short, long, short2)
    assert [o["y"].shape[1] for o in out] == [3, 5, 3]
    assert sum(rt.batches) == 3 and max(rt.batches) <= 2
    await b.stop()


@run_async
async def test_threaded_instances_complete_and_stop_drains_admitted_requests() -> None:
    rt, clock = DoublingRuntime(instance_count=2), FakeClock()
    b = make(rt, clock, inline=False)
    b.start()
    futures = [b.submit(rows(1, value=i), 1, Timings()) for i in range(10)]
    await b.stop()  # drains first: every admitted request is answered
    assert all(f.done() and not f.exception() for f in futures)
    assert [float(f.result()["y"][0, 0]) for f in futures] == [2.0 * i for i in range(10)]
    with pytest.raises(ShuttingDown):
        b.submit(rows(1), 1, Timings())


def _recorder(calls: list[tuple[object, asyncio.Future]]):  # type: ignore[no-untyped-def]
    """A done callback that records the task it ran in and its future."""

    def on_done(future: asyncio.Future) -> None:
        calls.append((asyncio.current_task(), future))

    return on_done


@run_async
async def test_a_completed_batch_calls_its_requests_done_callbacks_at_once_and_once() -> None:
    # A done callback scheduled by the future would run outside any task, after the loop's
    # next poll; called by the batch's completion it runs in the gather task's own step.
    for controller in (False, True):
        rt, clock = DoublingRuntime(), FakeClock()
        if controller:
            b, _ = make_slo(rt, clock, 50, BatchTimeModel(1e5, 1e4))
        else:
            b = make(rt, clock)
        b.start()
        calls: list[tuple[object, asyncio.Future]] = []
        futures = [
            b.submit(rows(1, value=i), 1, Timings(), on_done=_recorder(calls)) for i in (1, 2, 3)
        ]
        await asyncio.gather(*futures)
        await settle()
        assert rt.batches == [3]
        assert [task for task, _ in calls] == [b._task] * 3  # in the batch's step, once each
        assert [float(f.result()["y"][0, 0]) for _, f in calls] == [2.0, 4.0, 6.0]
        await b.stop()


@run_async
async def test_queued_work_that_waited_a_quarter_of_the_budget_runs_from_the_next_callback() -> (
    None
):
    """On a saturated event loop the gather task gets one turn per round of HTTP work;
    queued requests of an inline model that have waited ``overdue_share`` of the budget run
    from the next admission or early check, without the new request, in batches of at most
    the limit. (A share under the default: the round here, which never yields, must stay
    short enough for admission to let requests in.)"""
    rt, clock = DoublingRuntime(), FakeClock()
    share = 0.15
    b, controller = make_slo(rt, clock, 10, BatchTimeModel(20_000, 2_000), share)
    b.start()
    await settle()
    calls: list[tuple[object, asyncio.Future]] = []
    first = [b.submit(rows(1, value=i), 1, Timings(), on_done=_recorder(calls)) for i in (1, 2)]
    # (no await: the gather task has not run; the loop is busy elsewhere)
    overdue_ns = int(controller.objective.budget_ns * share)
    clock.advance_ms(overdue_ns / 1e6 * 0.9)
    assert b.refuse_early(clock.ns) is None
    third = b.submit(rows(1, value=3), 1, Timings(), on_done=_recorder(calls))
    assert rt.batches == [] and not any(f.done() for f in first)  # not overdue yet
    clock.advance_ms(overdue_ns / 1e6 * 0.2)
    assert b.refuse_early(clock.ns) is None  # the first two are overdue now: run here
    assert rt.batches == [3] and all(f.done() for f in [*first, third])
    assert [task for task, _ in calls] == [asyncio.current_task()] * 3  # in the caller's step
    assert [float(f.result()["y"][0, 0]) for f in [*first, third]] == [2.0, 4.0, 6.0]
    assert b.stats.overdue_batches == 1
    fourth = b.submit(rows(1, value=4), 1, Timings())
    assert not fourth.done()  # a submit never answers its own request from inside itself
    clock.advance_ms(overdue_ns / 1e6 * 1.1)
    fifth = b.submit(rows(1, value=5), 1, Timings())
    assert fourth.done() and not fifth.done() and rt.batches == [3, 1]
    assert float((await fifth)["y"][0, 0]) == 10.0  # the gather task still runs the rest
    await b.stop()


@run_async
async def test_a_loop_round_still_running_counts_as_lag_before_it_is_measured() -> None:
    """Under overload the event loop can poll again and again without yielding (every poll
    fills its event buffer): one round outlasts every lag measured before it. The probe
    queued at the round's first admission has waited as long as the round has run, and
    admission counts that, refusing once the round has used half the budget."""
    rt, clock = DoublingRuntime(), FakeClock()
    b, controller = make_slo(rt, clock, 10, BatchTimeModel(20_000, 2_000), 0.9)
    b.start()
    await settle()
    first = b.submit(rows(1), 1, Timings())  # the round's first admission queues the probe
    clock.advance_ms(3)  # the round runs on: 2 x 3 ms of loop ahead still fits 8.5 ms
    assert b.refuse_early(clock.ns) is None
    clock.advance_ms(2)  # 2 x 5 ms does not
    refusal = b.refuse_early(clock.ns)
    assert isinstance(refusal, ObjectiveRefused)
    with pytest.raises(ObjectiveRefused):
        b.submit(rows(1), 1, Timings())
    assert controller.loop.current(clock.ns) == 0  # no measurement knew of it
    await first  # the round ends: the loop yields, the probe and the gather task run
    await settle()
    assert b.refuse_early(clock.ns) is None
    await b.stop()


@run_async
async def test_a_cancelled_or_failing_request_still_gets_its_done_callback_once() -> None:
    rt, clock = DoublingRuntime(), FakeClock()
    b = make(rt, clock, inline=False)
    b.start()
    calls: list[tuple[object, asyncio.Future]] = []

    def broken(future: asyncio.Future) -> None:
        calls.append((None, future))
        raise RuntimeError("a frontend's bug")

    rt.gate = threading.Event()  # the first batch blocks until released
    first = b.submit(rows(1), 1, Timings(), on_done=broken)
    await settle()
    gone = b.submit(rows(1), 1, Timings(), on_done=_recorder(calls))
    kept = b.submit(rows(1, value=5), 1, Timings(), on_done=_recorder(calls))
    gone.cancel()  # the client went away while its request was queued
    rt.gate.set()
    assert float((await kept)["y"][0, 0]) == 10.0  # the raising callback stopped nothing
    await settle()
    called = [f for _, f in calls]
    assert len(called) == 3 and {id(f) for f in called} == {id(first), id(gone), id(kept)}
    assert gone.cancelled() and rt.batches == [1, 1]  # the cancelled one never ran
    await b.stop()


@run_async
async def test_timings_carry_the_batch() -> None:
    rt, clock = DoublingRuntime(), FakeClock()
    b = make(rt, clock)
    b.start()
    t = Timings()
    await b.submit(rows(2), 2, t)
    assert t.enqueued == clock.ns and t.batch_size == 2 and t.batch_start and t.batch_end
    await b.stop()


@run_async
async def test_under_an_objective_timings_carry_the_batch_not_the_reception() -> None:
    rt, clock = DoublingRuntime(), FakeClock()
    b, controller = make_slo(rt, clock, 50, BatchTimeModel(1e5, 1e4))
    b.start()
    t = Timings()
    t.received = clock.ns - 5_000_000  # decoded for 5 ms before it reached the queue
    await b.submit(rows(1), 1, t)
    assert t.batch_start == t.batch_end == t.enqueued == clock.ns  # the batch's own times
    assert b.stats.budget_factor == 1.0 and sum(b.stats.observed.counts) == 1
    await b.stop()


@run_async
async def test_lateness_without_queueing_does_not_tighten_admission() -> None:
    """Requests that reached an empty queue late (the event loop was busy before) cannot be
    helped by refusing others: the latency feedback ignores them."""
    rt, clock = DoublingRuntime(), FakeClock()
    b, controller = make_slo(rt, clock, 50, BatchTimeModel(1e5, 1e4))
    b.start()
    for _ in range(150):
        t = Timings()
        t.received = clock.ns - 200 * slo.MS  # four times the objective before the queue
        await b.submit(rows(1), 1, t)
        clock.advance_ms(1)
    assert controller.feedback.factor == 1.0
    await b.stop()


@run_async
async def test_a_request_larger_than_the_slo_batch_limit_is_still_served() -> None:
    rt, clock = DoublingRuntime(), FakeClock()  # max batch 8
    # 0.1 ms + 1 ms per row against a 10 ms objective: batches of at most 4 rows.
    b, controller = make_slo(rt, clock, 10, BatchTimeModel(1e5, 1e6))
    b.start()
    assert controller.limit == 4
    out = await asyncio.wait_for(b.submit(rows(8), 8, Timings()), 5)
    assert out["y"].shape == (8, 4) and rt.batches == [8]
    await b.stop()


@run_async
async def test_refuse_early_is_the_refusal_any_request_would_get_before_it_is_decoded() -> None:
    rt, clock = DoublingRuntime(), FakeClock()
    # 1 ms + 1 ms per row against a 10 ms objective: a few rows queued fill the budget.
    b, _ = make_slo(rt, clock, 10, BatchTimeModel(1e6, 1e6))
    b.start()
    assert b.refuse_early(clock.ns) is None  # idle: anything is admitted
    admitted = []
    with pytest.raises(ObjectiveRefused):
        for _ in range(64):  # the gather task does not run meanwhile: the queue only grows
            admitted.append(b.submit(rows(1), 1, Timings()))
    assert 1 < len(admitted) < 64
    shed = b.stats.shed[("objective", 1)]
    refusal = b.refuse_early(clock.ns)
    assert isinstance(refusal, ObjectiveRefused)
    assert "latency objective" in refusal.message and refusal.retry_after_s > 0
    assert b.stats.shed[("objective", 1)] == shed + 1  # counted like any refusal
    results = await asyncio.gather(*admitted)  # the admitted ones are all answered
    assert [r["y"].shape for r in results] == [(1, 4)] * len(admitted)
    assert b.refuse_early(clock.ns) is None  # the queue drained: admitted again
    await b.stop()


@run_async
async def test_an_early_refusal_stands_for_a_moment_unless_something_ran_or_was_measured() -> None:
    """Back-to-back refusals under overload: ``refuse_early``'s refusal stands for
    ``REFUSAL_HOLD`` of the budget (the same object, answered again), counted each time; it
    is decided anew once that has passed, or at once when a batch finishes."""
    rt, clock = DoublingRuntime(), FakeClock()
    b, controller = make_slo(rt, clock, 10, BatchTimeModel(1e6, 1e6))
    b.start()
    admitted = []
    with pytest.raises(ObjectiveRefused):
        for _ in range(64):
            admitted.append(b.submit(rows(1), 1, Timings()))
    first = b.refuse_early(clock.ns)
    assert isinstance(first, ObjectiveRefused)
    shed = b.stats.shed[("objective", 1)]
    # The model turns 100x faster: a new decision would admit, the refusal still stands.
    controller.model.scale = 0.01
    hold_ns = int(controller.objective.budget_ns * REFUSAL_HOLD)
    clock.ns += hold_ns // 2
    assert b.refuse_early(clock.ns) is first  # the same refusal, answered again
    assert b.stats.shed[("objective", 1)] == shed + 1
    clock.ns += hold_ns // 2 + 1
    assert b.refuse_early(clock.ns) is None  # passed: decided anew, and admitted
    # Held again; a finished batch drops it (what admission predicts from has changed).
    controller.model.scale = 1.0
    clock.ns += 1
    assert isinstance(b.refuse_early(clock.ns), ObjectiveRefused)
    controller.model.scale = 0.01
    await asyncio.gather(*admitted)
    assert b.refuse_early(clock.ns) is None
    await b.stop()


@run_async
async def test_a_request_admitted_before_its_decode_is_not_decided_again() -> None:
    """The submit that follows the decode reuses ``refuse_early``'s admission for the request
    it checked (one row, no timeout, keyed on its reception time), once; it decides anew for
    any other request: more rows, a timeout of its own, another reception time."""
    rt, clock = DoublingRuntime(), FakeClock()
    # (queued work is never overdue here: the clock jumps that show what is reused would
    # otherwise run it from the next submit)
    b, _ = make_slo(rt, clock, 10, BatchTimeModel(1e6, 1e6), overdue_share=0)
    b.start()
    queued = [b.submit(rows(1), 1, Timings()) for _ in range(3)]  # work ahead: ~4 ms
    received = clock.ns
    assert b.refuse_early(received) is None
    clock.advance_ms(20)  # (nothing runs between in the server: this shows what is reused)
    queued.append(b.submit(rows(1), 1, Timings(received=received)))  # the early admission
    with pytest.raises(ObjectiveRefused):  # used once: the same key again is decided anew
        b.submit(rows(1), 1, Timings(received=received))
    # Eight rows behind the queue are past the objective; a 1 µs timeout is past its own
    # (shorter than its batch alone: a retry would not do better).
    refusals: tuple[tuple[int, float, type[Exception]], ...] = (
        (8, 0.0, ObjectiveRefused),
        (1, 1e-6, DeadlineExceeded),
    )
    for n, timeout_s, refusal in refusals:
        received = clock.ns
        assert b.refuse_early(received) is None  # a one-row request would be admitted
        with pytest.raises(refusal):
            b.submit(rows(n), n, Timings(received=received), timeout_s=timeout_s)
    # A request whose decode failed leaves its admission behind; the next one is not it.
    received = clock.ns
    assert b.refuse_early(received) is None
    clock.advance_ms(20)
    with pytest.raises(ObjectiveRefused):
        b.submit(rows(1), 1, Timings(received=received + 1))
    results = await asyncio.gather(*queued)
    assert len(results) == 4
    await b.stop()


@run_async
async def test_refuse_early_never_without_an_objective_or_with_priority_levels() -> None:
    rt, clock = DoublingRuntime(), FakeClock()
    fixed = make(rt, clock)
    fixed.start()
    for _ in range(10):
        fixed.submit(rows(1), 1, Timings())
    assert fixed.refuse_early(clock.ns) is None
    await fixed.stop()
    # With priority levels the request's level is in its body: a higher one may be admitted.
    objective = slo.Objective(p99_ns=10 * slo.MS, priority_levels=2, default_priority=2)
    controller = SLOController(objective, BatchTimeModel(1e6, 1e6))
    policy = SLOPolicy(controller, rt.max_batch_size, 64)
    ranked = Batcher("m:1", rt, policy, batched=True, inline=True, clock=clock)
    ranked.start()
    with pytest.raises(ObjectiveRefused):
        for _ in range(64):
            ranked.submit(rows(1), 1, Timings(), priority=2)
    assert ranked.refuse_early(clock.ns) is None
    await ranked.stop()


class LaggingRuntime(DoublingRuntime):
    """Each batch leaves the event loop ``lag_ms`` of other work (a callback that advances
    the fake clock), as a saturated HTTP layer does between inline batches."""

    def __init__(self, clock: FakeClock, lag_ms: float) -> None:
        super().__init__()
        self.clock, self.lag_ms = clock, lag_ms

    def run(self, instance: int, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        asyncio.get_running_loop().call_soon(self.clock.advance_ms, self.lag_ms)
        return super().run(instance, feeds)


@run_async
async def test_a_lagging_event_loop_is_measured_and_refuses_with_nothing_queued() -> None:
    clock = FakeClock()
    rt = LaggingRuntime(clock, 20)
    # (no overdue batches, so no probes: the clock jumps below stand for an idle loop, and a
    # probe queued before one would read it as a round that ran that long)
    b, controller = make_slo(rt, clock, 10, BatchTimeModel(30_000, 4_000), overdue_share=0)
    b.start()
    await b.submit(rows(1), 1, Timings())
    await settle()
    assert controller.loop.current(clock.ns) == 20 * slo.MS  # measured across the yield
    with pytest.raises(ObjectiveRefused):  # nothing queued, but 2 x 20 ms of loop ahead
        b.submit(rows(1), 1, Timings())
    assert isinstance(b.refuse_early(clock.ns), ObjectiveRefused)
    clock.advance_ms(45)  # the loop caught up meanwhile (a 20 ms round held, then drained)
    rt.lag_ms = 0.1
    assert b.refuse_early(clock.ns) is None
    await b.submit(rows(1), 1, Timings())
    await settle()
    assert controller.loop.delay_ns(clock.ns, controller.objective.budget_ns) == 0
    await b.stop()


@run_async
async def test_the_quick_admission_of_a_one_batch_queue_decides_as_admit_does() -> None:
    """While what is queued fits in one batch, ``_admission`` decides without the arrival
    rate and the target when even a full batch would end within the budget. Over queue
    lengths, loop delays and times before the queue, it admits and refuses exactly as
    ``slo.admit`` does from the same state, with the same deadline and a prediction between
    the queued rows' batch and a full one."""
    rt, clock = DoublingRuntime(max_batch_size=32), FakeClock()
    b, controller = make_slo(rt, clock, 10, BatchTimeModel(200_000, 50_000))
    b.start()  # the gather task does not run until the test yields: submits stay queued
    model, objective = controller.model, controller.objective
    limit = controller.limit
    assert limit == 32
    decided = {True: 0, False: 0}
    for queued in (1, 5, 20, 31):
        controller.loop.observe(0, clock.ns)
        while b.queue_depth < queued:
            b.submit(rows(1), 1, Timings(received=clock.ns))
        for lag_ms in (0.0, 1.0, 2.5, 3.2, 4.0):
            controller.loop.observe(int(lag_ms * slo.MS), clock.ns)
            for waited_ms in (0.0, 2.0, 5.0):
                now = clock.ns
                received = now - int(waited_ms * slo.MS)
                decision, _ = b.policy._admission(1, 1, now, 0, received)
                busy = controller.loop.delay_ns(now, objective.budget_ns)
                rate = controller.rate.rate(now)
                target = slo.target_rows(model, rate, limit, objective.headroom)
                expected = slo.admit(
                    1, 1, now, 0, queued, busy, model, limit, objective, 1, target, rate,
                    controller.feedback.factor, received,
                )  # fmt: skip
                assert decision.admitted == expected.admitted, (queued, lag_ms, waited_ms)
                assert decision.deadline_ns == expected.deadline_ns
                if decision.admitted:
                    low = now + busy + model.predict(queued + 1)
                    assert low - 1 <= decision.predicted_ns <= now + busy + model.predict(limit)
                decided[decision.admitted] += 1
                b.policy._held = None
                b.policy._probing = False
                clock.ns += 1_000
    assert decided[True] and decided[False]  # both outcomes were compared
    await b.stop()


@run_async
async def test_a_timeout_shorter_than_the_requests_own_batch_is_not_told_to_retry() -> None:
    """A request whose own batch alone cannot end by its timeout gets ``DeadlineExceeded``
    (HTTP 504, gRPC DEADLINE_EXCEEDED), not a refusal with a retry-after (a retry would
    fare no better); one refused because of the work ahead of it is told when to retry."""
    rt, clock = DoublingRuntime(), FakeClock()
    b, controller = make_slo(rt, clock, 100, BatchTimeModel(1e6, 1e6))
    b.start()
    with pytest.raises(DeadlineExceeded, match="shorter than its batch alone"):
        b.submit(rows(1), 1, Timings(received=clock.ns), timeout_s=0.001)  # batch: 2 ms
    assert b.stats.shed[("deadline", 1)] == 1
    assert b.queue_depth == 0
    queued = [b.submit(rows(1), 1, Timings(received=clock.ns)) for _ in range(16)]
    with pytest.raises(ObjectiveRefused) as refused:
        b.submit(rows(1), 1, Timings(received=clock.ns), timeout_s=0.005)  # alone: 2 ms
    assert refused.value.retry_after_s > 0
    assert b.stats.shed[("deadline", 1)] == 2
    await asyncio.gather(*queued)
    await b.stop()


@run_async
async def test_the_loop_delays_weight_follows_the_share_of_requests_refused() -> None:
    """Refusals for the objective raise the loop delay's weight toward 2.5 (read once per
    batch or loop round); admissions bring it back toward 2."""
    rt, clock = DoublingRuntime(), FakeClock()
    b, _ = make_slo(rt, clock, 10, BatchTimeModel(1e6, 1e6))
    b.start()
    assert b.policy._lag_weight == slo.LOOP_LAG_WEIGHT
    admitted = []
    for _ in range(40):
        with contextlib.suppress(ObjectiveRefused):
            admitted.append(b.submit(rows(1), 1, Timings(received=clock.ns)))
    refused = b.stats.shed[("objective", 1)]
    assert admitted and refused > len(admitted)
    for _ in range(10):
        b.policy._note_refusals()
        assert b.refuse_early(clock.ns) is not None  # refused again: counted
    assert 2.3 < b.policy._lag_weight <= 2.5
    clock.advance_ms(100)
    await asyncio.wait_for(asyncio.gather(*admitted), 5)
    for _ in range(30):  # admitted only, one at a time
        clock.advance_ms(20)
        await asyncio.wait_for(b.submit(rows(1), 1, Timings(received=clock.ns)), 5)
        b.policy._note_refusals()
    assert b.policy._lag_weight < 2.05
    await b.stop()


class CountingModel(BatchTimeModel):
    """The batch-time model, counting the batches it is taught."""

    def __init__(self, fixed_ns: float, per_row_ns: float) -> None:
        super().__init__(fixed_ns, per_row_ns)
        self.taught = 0

    def observe(self, rows: int, ns: float) -> None:
        self.taught += 1
        super().observe(rows, ns)


@run_async
async def test_a_failed_and_rerun_batch_does_not_train_the_slo_controller() -> None:
    rt, clock = DoublingRuntime(), FakeClock()
    rt.fail_negative = True
    model = CountingModel(20_000, 2_000)
    b, _ = make_slo(rt, clock, 50, model)
    b.start()
    await asyncio.gather(*(b.submit(rows(1), 1, Timings()) for _ in range(3)))
    taught = model.taught
    assert taught > 0  # a batch that ran teaches the model
    futures = [b.submit(rows(1, value=v), 1, Timings()) for v in (1.0, -1.0, 2.0)]
    results = await asyncio.gather(*futures, return_exceptions=True)
    assert isinstance(results[1], InferenceFailed)
    assert isinstance(results[2], dict) and np.all(results[2]["y"] == 4)
    assert rt.batches[-4:] == [3, 1, 1, 1]  # batched, failed, each run alone
    assert model.taught == taught  # the failed batch (and its reruns) taught nothing
    assert b.stats.reruns == 1
    await b.stop()
