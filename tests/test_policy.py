"""The batching policy alone: a queue state in, a plan out."""

from rtserve.config import DynamicBatching
from rtserve.scheduling.policy import DynamicBatchPolicy

MS = 1_000_000


def policy(
    max_batch: int = 8, delay_us: int = 1000, preferred: tuple[int, ...] = ()
) -> DynamicBatchPolicy:
    return DynamicBatchPolicy(
        max_batch, DynamicBatching(max_queue_delay_us=delay_us, preferred_batch_sizes=preferred)
    )


def test_waits_for_the_delay_while_the_batch_is_not_full() -> None:
    plan = policy().plan([1, 1], oldest_enqueued_ns=0, now_ns=MS // 2)
    assert plan.take == 0 and plan.wait_until_ns == MS


def test_dispatches_everything_when_the_delay_has_passed() -> None:
    assert policy().plan([1, 2], 0, MS).take == 2


def test_dispatches_at_once_when_full() -> None:
    assert policy(max_batch=4).plan([2, 2], 0, 0).take == 2


def test_takes_only_what_fits_and_leaves_the_rest() -> None:
    assert policy(max_batch=4).plan([3, 2, 1], 0, 0).take == 1


def test_preferred_size_cuts_the_batch() -> None:
    p = policy(max_batch=16, preferred=(4, 8))
    assert p.plan([1] * 8, 0, 0).take == 8
    # 9 rows queued: the largest prefix that is a preferred size is 4 rows (two requests).
    assert p.plan([2, 2, 2, 3], 0, 0).take == 2
    # No prefix lands on a preferred size: take everything that fits.
    assert p.plan([3, 3, 3], 0, 0).take == 3


def test_zero_delay_dispatches_immediately() -> None:
    assert policy(delay_us=0).plan([1], 5, 5).take == 1


def test_empty_queue_waits_for_an_arrival() -> None:
    plan = policy().plan([], 0, 0)
    assert plan.take == 0 and plan.wait_until_ns == 0


def test_no_wait_when_no_more_requests_can_come() -> None:
    # Every client already waits on a queued request (a closed loop): waiting only adds latency.
    assert policy().plan([1, 1], 0, 10, more_expected=False).take == 2


def test_no_wait_when_arrivals_are_slower_than_a_batch() -> None:
    p = policy()
    assert p.plan([1], 0, 10, arrival_gap_ns=500_000, batch_ns=100_000).take == 1
    # Arrivals faster than a batch runs: gathering pays, so wait.
    assert p.plan([1], 0, 10, arrival_gap_ns=50_000, batch_ns=100_000).take == 0


def test_adaptive_delay_can_be_turned_off() -> None:
    strict = DynamicBatchPolicy(8, DynamicBatching(max_queue_delay_us=1000, adaptive_delay=False))
    plan = strict.plan([1], 0, 10, more_expected=False, arrival_gap_ns=1e9, batch_ns=1)
    assert plan.take == 0 and plan.wait_until_ns == MS
