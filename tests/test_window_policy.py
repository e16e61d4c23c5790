"""The fixed-window policy alone: a fake engine, a clock tests move, no batcher."""

from __future__ import annotations

import pytest

from rtserve.config import DynamicBatching
from rtserve.errors import Overloaded
from rtserve.scheduling.base import WAIT_INSTANCE
from rtserve.scheduling.policy import DynamicBatchPolicy
from rtserve.scheduling.window import WindowPolicy
from tests.fakes import FakeClock, FakeEngine, add_request, run_async

MS = 1_000_000


def window(
    clock: FakeClock,
    delay_us: int = 1000,
    max_batch: int = 8,
    max_queue: int = 64,
    more_expected: bool = True,
    preferred: tuple[int, ...] = (),
    adaptive: bool = False,
) -> tuple[WindowPolicy, FakeEngine]:
    settings = DynamicBatching(
        max_queue_delay_us=delay_us, preferred_batch_sizes=preferred, adaptive_delay=adaptive
    )
    policy = WindowPolicy(DynamicBatchPolicy(max_batch, settings), max_queue, lambda: more_expected)
    engine = FakeEngine(clock)
    policy.bind(engine)
    return policy, engine


@run_async
async def test_a_request_waits_for_the_window_then_runs_with_what_came_meanwhile() -> None:
    clock = FakeClock()
    policy, _ = window(clock, delay_us=1000)
    assert policy.next(clock.ns, 0) is None  # nothing queued
    first = add_request(policy)
    assert first.enqueued_ns == first.timings.enqueued == clock.ns
    step = policy.next(clock.ns, 0)
    assert step is not None and not step.batch
    assert step.wait_until_ns == clock.ns + MS  # the oldest's window
    clock.advance_ms(0.5)
    second = add_request(policy, rows=2)
    assert not policy.wake_now()  # 3 rows of 8: keep waiting
    clock.advance_ms(0.5)
    step = policy.next(clock.ns, 0)
    assert step is not None and step.batch == [first, second]
    assert policy.queue_depth == 0


@run_async
async def test_a_full_batch_runs_at_once_and_the_rest_waits_its_turn() -> None:
    clock = FakeClock()
    policy, _ = window(clock, delay_us=10_000_000, max_batch=4)
    requests = [add_request(policy, rows=2) for _ in range(3)]
    assert policy.wake_now()  # 6 queued rows reach the batch: re-plan now
    step = policy.next(clock.ns, 0)
    assert step is not None and step.batch == requests[:2]
    step = policy.next(clock.ns, 0)
    assert step is not None and not step.batch and step.wait_until_ns > clock.ns


@run_async
async def test_the_batch_lands_on_the_largest_preferred_size() -> None:
    clock = FakeClock()
    policy, _ = window(clock, delay_us=10_000_000, max_batch=8, preferred=(2, 4))
    requests = [add_request(policy) for _ in range(5)]
    step = policy.next(clock.ns, 0)
    assert step is not None and step.batch == requests[:4]


@run_async
async def test_no_free_instance_means_wait_for_one() -> None:
    clock = FakeClock()
    policy, _ = window(clock, delay_us=0)
    add_request(policy)
    assert policy.next(clock.ns, -1) is WAIT_INSTANCE
    assert policy.queue_depth == 1  # still queued


@run_async
async def test_finished_requests_are_dropped_through_the_engine_never_run() -> None:
    clock = FakeClock()
    policy, engine = window(clock, delay_us=0)
    gone = add_request(policy)
    kept = add_request(policy)
    gone.future.cancel()
    step = policy.next(clock.ns, 0)
    assert step is not None and step.batch == [kept]
    assert engine.dropped_requests == [gone]
    # A batch whose every request finished meanwhile is skipped: the next one is planned.
    a, b = add_request(policy), add_request(policy)
    a.future.cancel()
    b.future.cancel()
    assert policy.next(clock.ns, 0) is None
    assert engine.dropped_requests == [gone, a, b]


@run_async
async def test_requests_of_different_shapes_never_share_a_batch() -> None:
    clock = FakeClock()
    policy, _ = window(clock, delay_us=0)
    short = add_request(policy, shape_key=(3,))
    long = add_request(policy, shape_key=(5,))
    step = policy.next(clock.ns, 0)
    assert step is not None and step.batch == [short]
    step = policy.next(clock.ns, 0)
    assert step is not None and step.batch == [long]


@run_async
async def test_a_full_queue_refuses_naming_the_model() -> None:
    clock = FakeClock()
    policy, _ = window(clock, max_queue=2)
    add_request(policy)
    add_request(policy)
    with pytest.raises(Overloaded, match="'m:1' queue is full"):
        add_request(policy)
    assert policy.queue_depth == 2


@run_async
async def test_adaptive_delay_runs_at_once_when_no_company_is_coming() -> None:
    clock = FakeClock()
    idle, _ = window(clock, delay_us=10_000_000, more_expected=False, adaptive=True)
    add_request(idle)
    assert idle.wake_now()  # nobody else will come: wake the waiting loop
    step = idle.next(clock.ns, 0)
    assert step is not None and len(step.batch) == 1
    # Arrivals far apart next to the batch time (from ``finished``): no wait either.
    sparse, _ = window(clock, delay_us=10_000_000, adaptive=True)
    first = add_request(sparse)
    sparse.finished([first], 1, 0, clock.ns, clock.ns + 100_000)  # (a batch's time: 0.1 ms)
    sparse.next(clock.ns, 0)
    for _ in range(30):
        clock.advance_ms(1)
        add_request(sparse)
        step = sparse.next(clock.ns, 0)
        assert step is not None
    assert len(step.batch) == 1 and sparse.arrival_gap_ns > 2 * sparse.batch_ns
