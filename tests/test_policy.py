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
