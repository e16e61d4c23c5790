"""Dynamic batching policy: a pure function from queue state to a plan.

The batcher asks the policy what to do and carries it out; an SLO-driven policy can
replace this one without touching the mechanism.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rtserve.config import DynamicBatching


@dataclass(frozen=True, slots=True)
class Plan:
    take: int  # number of queued requests to dispatch now (0: wait)
    wait_until_ns: int  # when to ask again if nothing arrives (0: wait for an arrival)


class DynamicBatchPolicy:
    """Triton-style dynamic batching.

    Dispatch at once when the batch is full or reaches the largest preferred size; otherwise
    wait until the oldest request has waited ``max_queue_delay_us``, then dispatch everything
    queued up to the max batch, so that no request waits longer than the delay for a batch.
    """

    def __init__(self, max_batch_size: int, settings: DynamicBatching) -> None:
        self.max_rows = max(1, max_batch_size)
        self.delay_ns = settings.max_queue_delay_us * 1000
        self.preferred = tuple(p for p in settings.preferred_batch_sizes if p <= self.max_rows)
        self.full_rows = self.preferred[-1] if self.preferred else self.max_rows
        self.adaptive = settings.adaptive_delay

    def wake_threshold(self) -> int:
        """Queued rows at which a waiting batcher must re-plan before its timer fires."""
        return self.full_rows

    def plan(
        self,
        rows: Sequence[int],
        oldest_enqueued_ns: int,
        now_ns: int,
        more_expected: bool = True,
        arrival_gap_ns: float = 0.0,
        batch_ns: float = 0.0,
    ) -> Plan:
        """``rows``: rows of each batchable queued request, oldest first.

        Waiting for the delay only pays when more requests will come soon. Dispatch at once
        when ``more_expected`` is false (every client connection already has a request
        queued: a closed loop waits on us) or when requests arrive more slowly than a batch
        runs (``arrival_gap_ns`` > 2 x ``batch_ns``: the model keeps up one by one, so a
        wait only adds latency).
        """
        total = 0
        fit = 0
        prefix: list[int] = []
        for r in rows:
            if total + r > self.max_rows:
                break
            total += r
            fit += 1
            prefix.append(total)
        if fit == 0:
            return Plan(0, 0)
        overflow = fit < len(rows)
        if total >= self.full_rows or overflow:
            return Plan(self._preferred_cut(prefix) if not overflow else fit, 0)
        deadline = oldest_enqueued_ns + self.delay_ns
        if now_ns >= deadline:
            return Plan(fit, 0)
        if self.adaptive and (
            not more_expected or (batch_ns > 0 and arrival_gap_ns > 2 * batch_ns)
        ):
            return Plan(fit, 0)
        return Plan(0, deadline)

    def _preferred_cut(self, prefix: list[int]) -> int:
        """Requests to take so the batch lands on the largest preferred size, else all."""
        if self.preferred:
            for i in range(len(prefix) - 1, -1, -1):
                if prefix[i] in self.preferred:
                    return i + 1
        return len(prefix)
