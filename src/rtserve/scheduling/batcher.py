"""The dynamic batcher: one queue and one gather loop per model version.

Requests (each may carry several rows) are admitted into a bounded queue; the gather loop
asks the policy when to dispatch, concatenates a batch along dimension 0, runs it on a free
instance and splits the outputs back to each request's future. Small models run inline on
the event loop (a thread hop would cost more than the compute); larger ones run on executor
threads, and each batch completes all its futures with a single ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from rtserve.errors import (
    DeadlineExceeded,
    InferenceFailed,
    Overloaded,
    RTServeError,
    ShuttingDown,
)
from rtserve.protocol.types import Timings
from rtserve.runtime.base import Runtime
from rtserve.scheduling.policy import DynamicBatchPolicy

Outputs = dict[str, np.ndarray]
log = logging.getLogger(__name__)


class _Pending:
    __slots__ = ("feeds", "rows", "future", "enqueued_ns", "timings", "shape_key", "timer")

    def __init__(
        self,
        feeds: dict[str, np.ndarray],
        rows: int,
        future: asyncio.Future[Outputs],
        timings: Timings,
        shape_key: Any,
    ) -> None:
        self.feeds = feeds
        self.rows = rows
        self.future = future
        self.timings = timings
        self.enqueued_ns = timings.enqueued
        self.shape_key = shape_key
        self.timer: asyncio.TimerHandle | None = None


BatchObserver = Callable[[int, int], None]  # (rows in batch, compute ns)


class Batcher:
    def __init__(
        self,
        name: str,
        runtime: Runtime,
        policy: DynamicBatchPolicy,
        max_queue_size: int,
        batched: bool,
        inline: bool,
        more_expected: Callable[[], bool],
        on_batch: BatchObserver | None = None,
        clock: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        """``more_expected``: whether another request may arrive soon (the transports know
        their idle clients); ``clock``: nanoseconds, injectable so tests need no sleeps."""
        self.name = name
        self._runtime = runtime
        self._policy = policy
        self._max_queue = max_queue_size
        self._batched = batched
        self.inline = inline
        self._on_batch = on_batch
        self._more_expected = more_expected
        self._now = clock
        self._last_arrival = 0
        self.arrival_gap_ns = 0.0  # moving average of the time between arrivals
        self.batch_ns = 0.0  # moving average of a batch's run time
        self._queue: deque[_Pending] = deque()
        self._queued_rows = 0
        self._threshold = policy.wake_threshold()
        self._free: list[int] = list(range(runtime.instance_count))
        self._in_flight = 0
        self._ragged = any(-1 in spec.shape for spec in runtime.inputs) and batched
        self._executor: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Future[None] | None = None
        self._idle_wait = False
        self._instance_wait: asyncio.Future[None] | None = None
        self._drained: asyncio.Future[None] | None = None
        self._closing = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if not self.inline:
            self._executor = ThreadPoolExecutor(
                max_workers=self._runtime.instance_count, thread_name_prefix=f"rt-{self.name}"
            )
        self._task = self._loop.create_task(self._gather_loop(), name=f"batcher-{self.name}")

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> bool:
        return bool(self._queue) or self._in_flight > 0

    async def drain(self) -> None:
        """Wait until every admitted request has been answered."""
        while self.busy:
            assert self._loop is not None
            self._drained = self._loop.create_future()
            await self._drained

    async def stop(self) -> None:
        """Refuse new requests, finish admitted ones, then stop the loop and threads."""
        self._closing = True
        await self.drain()
        if self._task is not None:
            self._wake()
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------ admission
    def submit(
        self, feeds: dict[str, np.ndarray], rows: int, timings: Timings, timeout_s: float = 0.0
    ) -> asyncio.Future[Outputs]:
        if self._closing:
            raise ShuttingDown(f"model '{self.name}' is shutting down")
        if len(self._queue) >= self._max_queue:
            raise Overloaded(
                f"model '{self.name}' queue is full ({self._max_queue} requests); retry later"
            )
        loop = self._loop
        assert loop is not None, "batcher not started"
        future: asyncio.Future[Outputs] = loop.create_future()
        now = timings.enqueued = self._now()
        if self._last_arrival:
            self.arrival_gap_ns += 0.1 * ((now - self._last_arrival) - self.arrival_gap_ns)
        self._last_arrival = now
        shape_key = tuple(a.shape[1:] for a in feeds.values()) if self._ragged else None
        pending = _Pending(feeds, rows, future, timings, shape_key)
        if timeout_s > 0:
            pending.timer = loop.call_later(timeout_s, self._expire, pending, timeout_s)
        self._queue.append(pending)
        self._queued_rows += rows
        wakeup = self._wakeup
        if (
            wakeup is not None
            and not wakeup.done()
            and (
                self._idle_wait or self._queued_rows >= self._threshold or not self._more_expected()
            )
        ):
            wakeup.set_result(None)
        return future

    def _expire(self, pending: _Pending, timeout_s: float) -> None:
        if not pending.future.done():
            pending.future.set_exception(
                DeadlineExceeded(
                    f"model '{self.name}': request timed out after {timeout_s * 1e3:.3g} ms"
                )
            )

    # ------------------------------------------------------------------ the gather loop
    def _wake(self, _: object = None) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def _gather_loop(self) -> None:
        loop = self._loop
        assert loop is not None
        queue = self._queue
        policy = self._policy
        max_rows = policy.max_rows
        while True:
            while queue and queue[0].future.done():  # expired while queued
                self._queued_rows -= queue.popleft().rows
            if not queue:
                self._notify_drained()
                self._idle_wait = True
                self._wakeup = loop.create_future()
                await self._wakeup
                self._idle_wait = False
                continue
            if not self._free:
                self._instance_wait = loop.create_future()
                await self._instance_wait
                continue
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
            now = self._now()
            plan = policy.plan(
                rows,
                head.enqueued_ns,
                now,
                self._more_expected(),
                self.arrival_gap_ns,
                self.batch_ns,
            )
            if plan.take == 0:
                self._wakeup = loop.create_future()
                timer = (
                    loop.call_later((plan.wait_until_ns - now) / 1e9, self._wake)
                    if plan.wait_until_ns
                    else None
                )
                await self._wakeup
                if timer is not None:
                    timer.cancel()
                continue
            batch = [queue.popleft() for _ in range(plan.take)]
            self._queued_rows -= sum(p.rows for p in batch)
            live = [p for p in batch if not p.future.done()]
            if not live:
                continue
            instance = self._free.pop()
            self._in_flight += 1
            if self.inline:
                self._finish(live, instance, *self._compute(live, instance))
                await asyncio.sleep(0)  # let the frontends run between inline batches
            else:
                assert self._executor is not None
                self._executor.submit(self._compute_threaded, live, instance)

    # ------------------------------------------------------------------ execution
    def _compute(
        self, batch: list[_Pending], instance: int
    ) -> tuple[Outputs | None, BaseException | None, int, int]:
        start = self._now()
        try:
            if len(batch) == 1:
                feeds = batch[0].feeds
            else:
                names = batch[0].feeds.keys()
                feeds = {n: np.concatenate([p.feeds[n] for p in batch]) for n in names}
            outputs = self._runtime.run(instance, feeds)
            return outputs, None, start, self._now()
        except Exception as exc:  # the model's failure is reported to each request
            return None, exc, start, self._now()

    def _compute_threaded(self, batch: list[_Pending], instance: int) -> None:
        result = self._compute(batch, instance)
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
            self._loop.call_soon_threadsafe(self._finish, batch, instance, *result)

    def _finish(
        self,
        batch: list[_Pending],
        instance: int,
        outputs: Outputs | None,
        error: BaseException | None,
        start: int,
        end: int,
    ) -> None:
        self._free.append(instance)
        self._in_flight -= 1
        total_rows = sum(p.rows for p in batch)
        self.batch_ns += 0.1 * ((end - start) - self.batch_ns)
        if self._on_batch is not None:
            self._on_batch(total_rows, end - start)
        if outputs is not None and self._batched:
            bad = [n for n, a in outputs.items() if a.ndim == 0 or a.shape[0] != total_rows]
            if bad:
                error = InferenceFailed(
                    f"model '{self.name}': output {bad[0]!r} has no batch dimension "
                    f"of size {total_rows}"
                )
        offset = 0
        for p in batch:
            t = p.timings
            t.batch_start = start
            t.batch_end = end
            t.batch_size = total_rows
            if p.timer is not None:
                p.timer.cancel()
            if p.future.done():
                offset += p.rows
                continue
            if error is not None or outputs is None:
                p.future.set_exception(self._failure(error))
            elif len(batch) == 1:
                p.future.set_result(outputs)
            else:
                stop = offset + p.rows
                p.future.set_result({n: a[offset:stop] for n, a in outputs.items()})
            offset += p.rows
        if self._instance_wait is not None and not self._instance_wait.done():
            self._instance_wait.set_result(None)
        if not self.busy:
            self._notify_drained()

    def _failure(self, error: BaseException | None) -> RTServeError:
        """What the requests of a failed batch are told. A runtime's own ``RTServeError``
        is meant for clients; anything else names only its type (details go to the log)."""
        if isinstance(error, RTServeError):
            return error
        log.error("model %s failed to run a batch", self.name, exc_info=error)
        kind = type(error).__name__ if error is not None else "no outputs"
        return InferenceFailed(f"model '{self.name}' failed to run the batch ({kind})")

    def _notify_drained(self) -> None:
        if self._drained is not None and not self._drained.done() and not self.busy:
            self._drained.set_result(None)
