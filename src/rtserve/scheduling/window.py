"""The fixed-window policy (Triton-style dynamic batching): one FIFO queue, bounded; the
pure decision of ``policy.DynamicBatchPolicy`` says when the head of the queue runs."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from rtserve.errors import Overloaded
from rtserve.scheduling.base import WAIT_INSTANCE, BatcherView, Request, SchedulingPolicy, Step
from rtserve.scheduling.policy import DynamicBatchPolicy


class WindowPolicy(SchedulingPolicy):
    allows_direct = True

    def __init__(
        self, policy: DynamicBatchPolicy, max_queue: int, more_expected: Callable[[], bool]
    ) -> None:
        """``more_expected``: whether another request may arrive soon (the transports know
        their idle clients); with ``adaptive_delay``, a batch runs without waiting when not."""
        self.policy = policy
        self._max_queue = max_queue
        self._more_expected = more_expected
        self._queue: deque[Request] = deque()
        self._queued_rows = 0
        self._threshold = policy.wake_threshold()
        self._last_arrival = 0
        self.arrival_gap_ns = 0.0  # moving average of the time between arrivals
        self.batch_ns = 0.0  # moving average of a batch's run time

    def bind(self, engine: BatcherView) -> None:
        super().bind(engine)
        self._now = engine.clock

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def add(self, request: Request, timeout_s: float, priority: object) -> None:
        queue = self._queue
        if len(queue) >= self._max_queue:
            raise Overloaded(
                f"model '{self.engine.name}' queue is full ({self._max_queue} requests); "
                "retry later"
            )
        now = request.enqueued_ns = request.timings.enqueued = self._now()
        if self._last_arrival:
            self.arrival_gap_ns += 0.1 * ((now - self._last_arrival) - self.arrival_gap_ns)
        self._last_arrival = now
        queue.append(request)
        self._queued_rows += request.rows

    def wake_now(self) -> bool:
        return self._queued_rows >= self._threshold or not self._more_expected()

    def next(self, now_ns: int, instance: int) -> Step | None:
        queue = self._queue
        policy = self.policy
        max_rows = policy.max_rows
        while True:
            while queue and queue[0].future.done():  # expired or cancelled while queued
                dead = queue.popleft()
                self._queued_rows -= dead.rows
                self.engine.dropped(dead)
            if not queue:
                return None
            if instance < 0:
                return WAIT_INSTANCE
            head = queue[0]
            rows: list[int] = []
            count = 0
            for p in queue:
                if p.shape_key != head.shape_key:
                    break
                rows.append(p.rows)
                count += p.rows
                if count > max_rows:
                    break
            plan = policy.plan(
                rows,
                head.enqueued_ns,
                now_ns,
                self._more_expected(),
                self.arrival_gap_ns,
                self.batch_ns,
            )
            if plan.take == 0:
                return Step([], plan.wait_until_ns)
            batch = [queue.popleft() for _ in range(plan.take)]
            self._queued_rows -= sum(p.rows for p in batch)
            live = [p for p in batch if not p.future.done()]
            if len(live) < len(batch):
                for p in batch:
                    if p.future.done():
                        self.engine.dropped(p)
            if live:
                return Step(live)

    def finished(
        self,
        batch: list[Request],
        rows: int,
        instance: int,
        start_ns: int,
        end_ns: int,
        failed: bool = False,
    ) -> None:
        if not failed:
            self.batch_ns += 0.1 * ((end_ns - start_ns) - self.batch_ns)
