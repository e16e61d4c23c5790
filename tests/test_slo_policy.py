"""The latency-objective policy alone: a fake engine, a clock tests move, no batcher."""

from __future__ import annotations

import asyncio

import pytest

from rtserve.errors import DeadlineExceeded, InvalidInput, ObjectiveRefused, Overloaded
from rtserve.protocol.types import Timings
from rtserve.scheduling.base import WAIT_INSTANCE
from rtserve.scheduling.slo import MS, Objective
from rtserve.scheduling.slo_policy import BatchTimeModel, SLOController, SLOPolicy
from tests.fakes import FakeClock, FakeEngine, add_request, run_async


def slo_policy(
    clock: FakeClock,
    p99_ms: float = 10,
    fixed_ns: float = 1e6,
    per_row_ns: float = 1e6,
    levels: int = 1,
    inline: bool = False,
    max_queue: int = 64,
) -> tuple[SLOPolicy, FakeEngine]:
    """By default threaded (no overdue batches, no loop probes): decisions only."""
    objective = Objective(p99_ns=int(p99_ms * MS), priority_levels=levels, default_priority=levels)
    controller = SLOController(objective, BatchTimeModel(fixed_ns, per_row_ns))
    policy = SLOPolicy(controller, 8, max_queue)
    engine = FakeEngine(clock, inline=inline)
    engine.loop = asyncio.get_running_loop()
    policy.bind(engine)
    return policy, engine


@run_async
async def test_bind_reports_the_objective_and_sets_the_batch_limit() -> None:
    clock = FakeClock()
    # 1 ms + 1 ms per row against 8.5 ms of budget: two batches of 3 rows fit, of 4 do not.
    policy, engine = slo_policy(clock)
    assert engine.stats.objective_ns == 10 * MS
    assert policy.controller.limit == 3


@run_async
async def test_an_idle_model_admits_with_its_batch_alone_predicted() -> None:
    clock = FakeClock()
    policy, _ = slo_policy(clock)
    request = add_request(policy, rows=2)
    assert request.enqueued_ns == clock.ns and request.priority == 1
    assert request.predicted_ns == clock.ns + 3 * MS  # 1 ms + 2 x 1 ms
    assert request.deadline_ns == clock.ns + policy.controller.objective.gather_ns
    assert policy.queue_depth == 1


@run_async
async def test_work_queued_ahead_past_the_budget_is_refused_and_counted() -> None:
    clock = FakeClock()
    policy, engine = slo_policy(clock)
    admitted = []
    with pytest.raises(ObjectiveRefused, match="latency objective") as refused:
        for _ in range(20):
            admitted.append(add_request(policy))
    assert 1 < len(admitted) < 20 and refused.value.retry_after_s > 0
    assert engine.stats.shed[("objective", 1)] == 1
    assert policy.queue_depth == len(admitted)


@run_async
async def test_next_takes_the_head_up_to_the_limit_and_counts_the_instance_busy() -> None:
    clock = FakeClock()
    policy, engine = slo_policy(clock, p99_ms=20)  # limit: 7 rows
    requests = [add_request(policy) for _ in range(5)]
    assert policy.next(clock.ns, -1) is WAIT_INSTANCE
    step = policy.next(clock.ns, 0)  # a burst: at the target size already
    assert step is not None and step.batch == requests
    assert policy.queue_depth == 0
    # While that batch runs (6 ms predicted) with no instance free, admission counts it.
    model, target = policy.controller.model, engine.stats.target
    engine.free.clear()
    busy = add_request(policy)
    assert busy.predicted_ns == clock.ns + 6 * MS + int(model.predict(target))
    engine.free.append(0)
    policy.finished(requests, 5, 0, clock.ns, clock.ns + 6 * MS)
    after = add_request(policy)  # finished: only the queued row is ahead now
    assert after.predicted_ns == clock.ns + int(model.predict(max(2, target)))


@run_async
async def test_under_a_steady_rate_it_gathers_then_wakes_for_the_target() -> None:
    clock = FakeClock()
    policy, _ = slo_policy(clock, p99_ms=100, fixed_ns=4e6, per_row_ns=1e5)
    for _ in range(40):  # a row every 0.1 ms: a rate a batch of one cannot keep up with
        add_request(policy)
        clock.advance_ms(0.1)
        step = policy.next(clock.ns, 0)
    assert step is not None and not step.batch and step.wait_until_ns > clock.ns
    assert not policy.wake_now()
    while not policy.wake_now():  # wakes once the target's rows are queued
        add_request(policy)
    step = policy.next(clock.ns, 0)
    assert step is not None and len(step.batch) >= 2


@run_async
async def test_the_highest_priority_runs_first_and_a_bad_one_is_named() -> None:
    clock = FakeClock()
    policy, _ = slo_policy(clock, p99_ms=1000, levels=2)
    low = add_request(policy)  # the default: the lowest
    clock.advance_ms(100)  # (arrivals this sparse are not worth gathering for)
    high = add_request(policy, priority=1)
    step = policy.next(clock.ns, 0)
    assert step is not None and step.batch[:2] == [high, low]
    with pytest.raises(InvalidInput, match="parameters.priority"):
        add_request(policy, priority=7)


@run_async
async def test_a_request_its_batch_cannot_finish_in_time_is_answered_not_run() -> None:
    clock = FakeClock()
    policy, engine = slo_policy(clock, p99_ms=100)
    late = add_request(policy, timeout_s=0.004)  # its batch alone: 2 ms
    clock.advance_ms(3)
    assert policy.next(clock.ns, 0) is None
    with pytest.raises(DeadlineExceeded, match="sooner than its batch can finish"):
        await late.future
    assert engine.stats.shed[("expired", 1)] == 1 and engine.dropped_requests == [late]


@run_async
async def test_refuse_early_holds_its_refusal_until_a_batch_finishes() -> None:
    clock = FakeClock()
    policy, engine = slo_policy(clock)
    admitted = []
    with pytest.raises(ObjectiveRefused):
        for _ in range(20):
            admitted.append(add_request(policy))
    refusal = policy.refuse_early(clock.ns)
    assert isinstance(refusal, ObjectiveRefused)
    assert policy.refuse_early(clock.ns) is refusal  # held: the same object
    policy.finished(admitted[:3], 3, 0, clock.ns, clock.ns + 4 * MS)
    assert policy.refuse_early(clock.ns) is not refusal  # decided anew
    engine.closing = True
    assert policy.refuse_early(clock.ns) is None
    with pytest.raises(Overloaded):  # and a full queue still refuses
        small, _ = slo_policy(clock, p99_ms=1000, max_queue=1)
        add_request(small)
        add_request(small)


@run_async
async def test_finished_batches_teach_the_batch_time_model() -> None:
    clock = FakeClock()
    policy, _ = slo_policy(clock, p99_ms=100)
    model = policy.controller.model
    for _ in range(4):  # each batch of 2 rows runs 3x slower than predicted
        batch = [add_request(policy), add_request(policy)]
        clock.advance_ms(85)  # the gather deadline: no more waiting for company
        step = policy.next(clock.ns, 0)
        assert step is not None and step.batch == batch
        policy.finished(batch, 2, 0, clock.ns, clock.ns + 9 * MS)
        clock.advance_ms(10)
    assert model.predict(2) == pytest.approx(9 * MS, rel=0.2)


@run_async
async def test_inline_work_queued_too_long_runs_from_the_next_admission() -> None:
    clock = FakeClock()
    policy, engine = slo_policy(clock, p99_ms=100, inline=True)
    first = add_request(policy, timings=Timings(received=clock.ns))
    clock.advance_ms(0.3 * policy.controller.objective.budget_ns / MS)  # past a quarter
    second = add_request(policy)
    assert engine.ran == [[first]] and engine.stats.overdue_batches == 1
    assert not second.future.done() and policy.queue_depth == 1


def _dispatch_full_batch(policy: SLOPolicy, engine: FakeEngine, clock: FakeClock) -> list:
    """Eight queued rows dispatched as one batch on instance 0, which is then busy."""
    batch = [add_request(policy) for _ in range(8)]
    step = policy.next(clock.ns, 0)
    assert step is not None and step.batch == batch
    engine.free.clear()
    return batch


@run_async
async def test_a_batch_past_its_predicted_end_still_counts_as_work_ahead() -> None:
    """Issue 24: a batch that overruns its prediction (the core was taken) is not counted
    as ending now; it is taken to need as long again as it has overrun, so a request that
    would wait for it is refused rather than admitted to be late."""
    clock = FakeClock()
    policy, engine = slo_policy(clock, p99_ms=100)  # budget 85 ms; a batch of 8: 9 ms
    assert policy.controller.limit == 8
    _dispatch_full_batch(policy, engine, clock)
    queued = [add_request(policy) for _ in range(8)]  # 9 ms in flight + 9 ms ahead: admitted
    assert queued[-1].predicted_ns <= clock.ns + 18 * MS + 1
    clock.advance_ms(9 + 80)  # 80 ms past the batch's predicted end, still running
    with pytest.raises(ObjectiveRefused) as refused:
        add_request(policy)  # 80 ms more + 9 ms ahead + its own batch: past 85 ms
    assert refused.value.retry_after_s > 0
    assert engine.stats.shed[("objective", 1)] == 1


@run_async
async def test_the_turnaround_between_batches_is_timed_and_counted_as_work_ahead() -> None:
    """From a threaded batch's completion reaching the loop to the next queued batch's
    dispatch (its answers written, a loop round): each batch ahead of a request adds it."""
    clock = FakeClock()
    policy, engine = slo_policy(clock, p99_ms=100)
    controller = policy.controller
    first = _dispatch_full_batch(policy, engine, clock)
    second = [add_request(policy) for _ in range(8)]  # a full batch queued behind it
    clock.advance_ms(9)
    engine.free.append(0)
    policy.finished(first, 8, 0, clock.ns - 9 * MS, clock.ns)
    assert controller.turnaround_ns == 0  # nothing timed yet
    clock.advance_ms(2)  # the answers written, a loop round: then the next dispatch
    step = policy.next(clock.ns, 0)
    assert step is not None and step.batch == second
    assert controller.turnaround_ns == pytest.approx(0.1 * 2 * MS)  # its running mean
    engine.free.clear()
    busy = add_request(policy)  # behind the batch in flight (9 ms), then a turnaround
    expected = clock.ns + 9 * MS + int(controller.turnaround_ns)
    assert busy.predicted_ns == expected + int(controller.model.predict(engine.stats.target))
