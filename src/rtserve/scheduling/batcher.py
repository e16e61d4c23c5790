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
    ObjectiveRefused,
    Overloaded,
    RTServeError,
    ShuttingDown,
)
from rtserve.observability.metrics import SchedulerStats
from rtserve.protocol.types import Timings
from rtserve.runtime.base import Runtime
from rtserve.scheduling import slo
from rtserve.scheduling.policy import DynamicBatchPolicy

Outputs = dict[str, np.ndarray]
OnDone = Callable[["asyncio.Future[Outputs]"], object]
log = logging.getLogger(__name__)
OVERDUE_SHARE = 0.25  # of the objective's budget: see ``Batcher._run_overdue``
REFUSAL_HOLD = 0.03  # of the objective's budget: see ``Batcher.refuse_early``


class _Pending:
    __slots__ = (
        "feeds",
        "rows",
        "future",
        "enqueued_ns",
        "timings",
        "shape_key",
        "timer",
        "priority",
        "deadline_ns",
        "timeout_ns",
        "predicted_ns",
        "feedback",
        "on_done",
    )

    def __init__(
        self,
        feeds: dict[str, np.ndarray],
        rows: int,
        future: asyncio.Future[Outputs],
        timings: Timings,
        shape_key: Any,
        on_done: OnDone | None = None,
    ) -> None:
        self.feeds = feeds
        self.rows = rows
        self.future = future
        self.timings = timings
        self.enqueued_ns = timings.enqueued
        self.shape_key = shape_key
        self.timer: asyncio.TimerHandle | None = None
        # Set under a latency objective: priority level, the deadline gathering keeps (the
        # earlier of its timeout and the objective), its own timeout (0: none), the
        # completion predicted at admission, and whether its latency is fed back (not when
        # its own batch alone takes a large share of the budget).
        self.priority = 1
        self.deadline_ns = 0
        self.timeout_ns = 0
        self.predicted_ns = 0
        self.feedback = False
        # The caller's done callback: a done callback of the future for every other ending,
        # called by the batch's completion directly rather than scheduled (``Batcher.submit``).
        self.on_done = on_done
        if on_done is not None:
            future.add_done_callback(on_done)


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
        controller: slo.SLOController | None = None,
        stats: SchedulerStats | None = None,
        overdue_share: float = OVERDUE_SHARE,
    ) -> None:
        """``more_expected``: whether another request may arrive soon (the transports know
        their idle clients); ``clock``: nanoseconds, injectable so tests need no sleeps;
        ``controller``: a latency objective's state; when set it replaces the policy's fixed
        window (admission, priorities, deadline-aware gathering; see ``slo``);
        ``overdue_share``: of its budget, how long an inline model's queued work may wait
        before a frontend callback runs it (``_run_overdue``; 0: never)."""
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
        self.stats = stats if stats is not None else SchedulerStats()
        self.cancelled = 0  # requests whose client went away before their batch ran
        self._slo = controller
        levels = controller.objective.priority_levels if controller is not None else 1
        # Under an objective: one FIFO per priority level (index 0 is priority 1, the highest).
        self._levels: list[deque[_Pending]] = [deque() for _ in range(levels)]
        self._level_rows = [0] * levels
        self._busy_until: dict[int, int] = {}  # instance -> predicted end of its batch
        self._dispatched: dict[int, int] = {}  # instance -> when its batch was dispatched
        # The last admission ``refuse_early`` granted: (received_ns, decision, work ahead).
        self._early: tuple[int, slo.Admission, bool] | None = None
        self._probing = False  # a loop-round probe is queued (``_admission``)
        self._probe_ns = 0  # when it was queued
        # The refusal ``refuse_early`` last decided, while it stands: (until when, in ns, the
        # refusal); dropped when a batch finishes or the loop is timed again.
        self._held: tuple[int, ObjectiveRefused] | None = None
        self._hold_ns = int(controller.objective.budget_ns * REFUSAL_HOLD) if controller else 0
        # Requests admitted and refused for the objective, as last read by
        # ``_note_refusals``, the refused share (decayed) and the loop delay's weight.
        self._admitted = self._seen_admitted = self._seen_refused = 0
        self._refused_share = 0.0
        self._lag_weight = float(slo.LOOP_LAG_WEIGHT)
        # Inline models under an objective: queued work that has waited this long runs from
        # the next frontend callback (``_run_overdue``).
        self._overdue_ns = (
            int(controller.objective.budget_ns * overdue_share)
            if controller is not None and inline
            else 0
        )
        if controller is not None:
            self.stats.objective_ns = controller.objective.p99_ns
            controller.refresh(policy.max_rows)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if not self.inline:
            self._executor = ThreadPoolExecutor(
                max_workers=self._runtime.instance_count, thread_name_prefix=f"rt-{self.name}"
            )
        loop = self._gather_loop() if self._slo is None else self._gather_slo()
        self._task = self._loop.create_task(loop, name=f"batcher-{self.name}")

    @property
    def queue_depth(self) -> int:
        if self._slo is not None:
            levels = self._levels
            return len(levels[0]) if len(levels) == 1 else sum(len(q) for q in levels)
        return len(self._queue)

    @property
    def busy(self) -> bool:
        return self.queue_depth > 0 or self._in_flight > 0

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
        self,
        feeds: dict[str, np.ndarray],
        rows: int,
        timings: Timings,
        timeout_s: float = 0.0,
        priority: object = None,
        on_done: OnDone | None = None,
    ) -> asyncio.Future[Outputs]:
        """Queue a request; its future gets the outputs. Cancelling the future (the client
        went away) drops the request before its batch runs. ``priority``: the request
        parameter, used under a latency objective with priority levels.

        ``on_done``: the future's done callback. When the request's batch completes it is
        called there and then, in the same event loop step, instead of being scheduled: a
        scheduled callback runs only after the loop's next poll, which on a loop busy with
        many clients is one whole round of reading and parsing them later. Any other
        ending (expired, cancelled, refused) reaches it as a done callback, as usual."""
        if self._closing:
            raise ShuttingDown(f"model '{self.name}' is shutting down")
        if self._slo is not None:
            return self._submit_slo(feeds, rows, timings, timeout_s, priority, on_done)
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
        pending = _Pending(feeds, rows, future, timings, shape_key, on_done)
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

    def _submit_slo(
        self,
        feeds: dict[str, np.ndarray],
        rows: int,
        timings: Timings,
        timeout_s: float,
        priority: object,
        on_done: OnDone | None,
    ) -> asyncio.Future[Outputs]:
        controller = self._slo
        assert controller is not None
        objective = controller.objective
        level = slo.parse_priority(priority, objective) if objective.priority_levels > 1 else 1
        if self.queue_depth >= self._max_queue:
            self.stats.count_shed("queue_full", level)
            raise Overloaded(
                f"model '{self.name}' queue is full ({self._max_queue} requests); retry later"
            )
        loop = self._loop
        assert loop is not None, "batcher not started"
        now = timings.enqueued = self._now()
        timeout_ns = now + int(timeout_s * 1e9) if timeout_s > 0 else 0
        early = self._early
        self._early = None
        if (
            early is not None
            and early[0] == timings.received
            and rows == 1
            and level == 1
            and not timeout_ns
        ):
            # Admitted before its decode, in the same callback: nothing was queued or run
            # since (overdue work included), and a one-row request without a timeout is what
            # was checked.
            _, decision, queued = early
        else:
            if self._overdue_ns:
                self._run_overdue(now)
            decision, queued = self._admission(rows, level, now, timeout_ns, timings.received)
        if not decision.admitted:
            if not decision.retry_after_ns:
                self.stats.count_shed(decision.reason, level)
                alone_ms = controller.model.predict(rows) / 1e6
                raise DeadlineExceeded(
                    f"model '{self.name}': the request's timeout ({timeout_s * 1e3:.3g} ms) is "
                    f"shorter than its batch alone is predicted to take ({alone_ms:.3g} ms); "
                    "not run"
                )
            raise self._refused(decision, level, now)
        controller.rate.observe(now, rows)  # the rate that batches form from: admitted rows
        self._admitted += 1
        future: asyncio.Future[Outputs] = loop.create_future()
        shape_key = tuple(a.shape[1:] for a in feeds.values()) if self._ragged else None
        pending = _Pending(feeds, rows, future, timings, shape_key, on_done)
        pending.priority = level
        pending.deadline_ns = decision.deadline_ns
        pending.timeout_ns = timeout_ns
        pending.predicted_ns = decision.predicted_ns
        # Fed back only when admission could have refused it (work was ahead of it) and its
        # own batch is not most of the budget: lateness without queueing (a busy event loop
        # before it reached the queue) is not corrected by admitting less.
        pending.feedback = queued and (controller.model.predict(rows) < objective.budget_ns / 2)
        if timeout_s > 0:
            pending.timer = loop.call_later(timeout_s, self._expire, pending, timeout_s)
        self._levels[level - 1].append(pending)
        self._level_rows[level - 1] += rows
        self._queued_rows += rows
        wakeup = self._wakeup
        if (
            wakeup is not None
            and not wakeup.done()
            and (self._idle_wait or self._queued_rows >= self._threshold)
        ):
            wakeup.set_result(None)
        return future

    def _admission(
        self, rows: int, level: int, now: int, timeout_ns: int, received_ns: int
    ) -> tuple[slo.Admission, bool]:
        """Admission's decision for a request, and whether work was ahead of it."""
        controller = self._slo
        assert controller is not None
        objective = controller.objective
        busy_ns = 0
        if not self._free and self._busy_until:
            busy_ns = max(0, min(self._busy_until.values()) - now)
        # A saturated event loop is work ahead too (requests wait for it, not in the queue).
        # A probe still queued has waited as long as this round has run since it was queued:
        # the lag of a round still running, which the last measurement knows nothing of.
        running = now - self._probe_ns if self._probing else 0
        busy_ns += controller.loop.delay_ns(now, objective.budget_ns, running, self._lag_weight)
        if self._overdue_ns and not self._probing:
            # Time the rest of this loop round (overdue batches leave the gather task few
            # turns to time it by): a callback queued now runs once the round's I/O is done.
            self._probing = True
            self._probe_ns = now
            assert self._loop is not None
            self._loop.call_soon(self._probed, now)
        factor = controller.feedback.factor
        ahead = sum(self._level_rows[:level])
        if not ahead and not busy_ns and self._free and not timeout_ns:
            alone = slo.admit_alone(rows, now, controller.model, objective, factor, received_ns)
            return alone, False
        max_rows = controller.limit
        if not timeout_ns:  # the common case below capacity, decided without the rate
            one = slo.admit_one_batch(
                ahead + rows, level, now, busy_ns, controller.model, max_rows, objective,
                self.stats.target, factor, received_ns,
            )  # fmt: skip
            if one is not None:
                return one, ahead > 0 or busy_ns > 0
        rate = controller.rate.rate(now)
        decision = slo.admit(
            rows,
            level,
            now,
            timeout_ns,
            ahead,
            busy_ns,
            controller.model,
            max_rows,
            objective,
            self._runtime.instance_count,
            slo.target_rows(controller.model, rate, max_rows, objective.headroom),
            rate,
            factor,
            received_ns,
        )
        return decision, ahead > 0 or busy_ns > 0

    def _probed(self, sent_ns: int) -> None:
        self._probing = False
        self._held = None
        controller = self._slo
        if controller is not None:
            now = self._now()
            controller.loop.observe(now - sent_ns, now)
            self._note_refusals()

    def _note_refusals(self) -> None:
        """Once per loop round (the probe) or batch: the share of requests refused for the
        objective since the last time, decayed, and the loop delay's weight that follows
        (``slo.refused_weight``)."""
        refused = 0
        for (reason, _), count in self.stats.shed.items():
            if reason == "objective":
                refused += count
        fresh_refused = refused - self._seen_refused
        fresh = fresh_refused + self._admitted - self._seen_admitted
        if fresh:
            self._seen_refused, self._seen_admitted = refused, self._admitted
            self._refused_share += 0.2 * (fresh_refused / fresh - self._refused_share)
            self._lag_weight = slo.refused_weight(self._refused_share)

    def _refused(self, decision: slo.Admission, level: int, now: int) -> ObjectiveRefused:
        self.stats.count_shed(decision.reason, level)
        what = "its deadline" if decision.reason == "deadline" else "the latency objective"
        return ObjectiveRefused(
            f"model '{self.name}': predicted completion in "
            f"{(decision.predicted_ns - now) / 1e6:.3g} ms is past {what}; retry later",
            retry_after_s=decision.retry_after_ns / 1e9,
        )

    def refuse_early(self, received_ns: int) -> ObjectiveRefused | None:
        """Before a request is decoded: the refusal any request would get now, else None.

        Under a latency objective the smallest request (one row, no timeout of its own) is
        checked; if even it would be refused, so would this one, and the server answers 429
        without decoding it. When the HTTP work, not the model, is what saturates, a refusal
        that skips the decode costs about half of one that does. Only without priority levels:
        the request's level is in its body, and a higher one might be admitted.

        Requests refused back to back get the same refusal object (see ``REFUSAL_HOLD``): it
        is to be answered, not raised (raise a copy)."""
        controller = self._slo
        if controller is None or controller.objective.priority_levels > 1 or self._closing:
            return None
        now = self._now()
        if self._overdue_ns:
            self._run_overdue(now)
        held = self._held
        if held is not None and now < held[0]:
            # Refused a moment ago, and nothing ran or was measured since: the same refusal
            # (only time has passed, and by less than the request would have had to wait).
            # Under overload refusals come back to back; deciding each anew is a third of
            # what a refusal costs the event loop.
            self.stats.count_shed("objective", 1)
            return held[1]
        decision, queued = self._admission(1, 1, now, 0, received_ns)
        if decision.admitted:
            # Kept for the submit that follows the decode (same request, same callback),
            # which then need not decide again. Keyed on the reception time: a request that
            # fails to decode leaves it to no other one.
            self._early = (received_ns, decision, queued) if received_ns else None
            self._held = None
            return None
        self._early = None
        refusal = self._refused(decision, 1, now)
        self._held = (now + min(self._hold_ns, decision.retry_after_ns), refusal)
        return refusal

    def _expire(self, pending: _Pending, timeout_s: float) -> None:
        if not pending.future.done():
            self.stats.count_shed("expired", pending.priority)
            pending.future.set_exception(
                DeadlineExceeded(
                    f"model '{self.name}': request timed out after {timeout_s * 1e3:.3g} ms"
                )
            )

    # ------------------------------------------------------------------ the gather loop
    def _wake(self, _: object = None) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def _wait_idle(self) -> None:
        """Nothing queued: say so to ``drain`` and sleep until a request arrives."""
        assert self._loop is not None
        self._notify_drained()
        self._idle_wait = True
        self._wakeup = self._loop.create_future()
        await self._wakeup
        self._idle_wait = False

    async def _wait_instance(self) -> None:
        """Every instance is busy: sleep until a batch finishes."""
        assert self._loop is not None
        self._instance_wait = self._loop.create_future()
        await self._instance_wait

    async def _gather_loop(self) -> None:
        loop = self._loop
        assert loop is not None
        queue = self._queue
        policy = self._policy
        max_rows = policy.max_rows
        while True:
            while queue and queue[0].future.done():  # expired or cancelled while queued
                dead = queue.popleft()
                self._queued_rows -= dead.rows
                self._dropped(dead)
            if not queue:
                await self._wait_idle()
                continue
            if not self._free:
                await self._wait_instance()
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
            if len(live) < len(batch):
                for p in batch:
                    if p.future.done():
                        self._dropped(p)
            if not live:
                continue
            await self._dispatch(live)

    async def _dispatch(self, live: list[_Pending]) -> None:
        instance = self._free.pop()
        self._in_flight += 1
        if self.inline:
            result = self._compute(live, instance)
            yielded = self._now()  # the answers written by ``_finish`` are the loop's work too
            self._finish(live, instance, *result)
            await asyncio.sleep(0)  # let the frontends run between inline batches
            if self._slo is not None:  # what ran meanwhile: how far behind the loop is
                self._held = None
                now = self._now()
                self._slo.loop.observe(now - yielded, now)
        else:
            assert self._executor is not None
            self._executor.submit(self._compute_threaded, live, instance)

    def _dropped(self, pending: _Pending) -> None:
        """A queued request that will not run: count it if its client went away."""
        if pending.future.cancelled():
            self.cancelled += 1
            self.stats.count_shed("cancelled", pending.priority)
            if pending.timer is not None:
                pending.timer.cancel()

    # ------------------------------------------------------------------ the SLO loop
    def _pop_dead(self, now: int) -> None:
        """Drop finished (cancelled, expired) requests at the head of each level, and those
        that can no longer finish by their own timeout: they are answered, never run."""
        controller = self._slo
        assert controller is not None
        for i, level in enumerate(self._levels):
            while level:
                head = level[0]
                if not head.future.done():
                    if not head.timeout_ns or not slo.late(
                        head.timeout_ns, now, controller.model.predict(head.rows)
                    ):
                        break
                    self._late(head, now)
                level.popleft()
                self._level_rows[i] -= head.rows
                self._queued_rows -= head.rows
                self._dropped(head)

    def _late(self, pending: _Pending, now: int) -> None:
        if pending.timer is not None:
            pending.timer.cancel()
        self.stats.count_shed("expired", pending.priority)
        left = (pending.timeout_ns - now) / 1e6
        pending.future.set_exception(
            DeadlineExceeded(
                f"model '{self.name}': the request's deadline ({left:.3g} ms away) is "
                f"sooner than its batch can finish; not run"
            )
        )

    def _candidates(self, now: int, max_rows: int) -> list[_Pending]:
        """Queued requests in schedule order (priority, bounded wait), up to one past a full
        batch of ``max_rows``, all with the head's input shapes."""
        controller = self._slo
        assert controller is not None
        objective = controller.objective
        levels = self._levels
        if len(levels) == 1:
            out = []
            count = 0
            head = levels[0][0]
            for p in levels[0]:
                if p.shape_key != head.shape_key:
                    break
                out.append(p)
                count += p.rows
                if count > max_rows:
                    break
            return out
        index = [0] * len(levels)
        out = []
        count = 0
        shape = None
        while count <= max_rows:
            best = -1
            best_key: tuple[int, int] | None = None
            for i, level in enumerate(levels):
                if index[i] < len(level):
                    p = level[index[i]]
                    key = slo.schedule_key(p.priority, p.enqueued_ns, now, objective)
                    if best_key is None or key < best_key:
                        best, best_key = i, key
            if best < 0:
                break
            p = levels[best][index[best]]
            if out and p.shape_key != shape:
                break
            shape = p.shape_key
            out.append(p)
            index[best] += 1
            count += p.rows
        return out

    async def _gather_slo(self) -> None:
        loop = self._loop
        assert loop is not None
        controller = self._slo
        assert controller is not None
        stats = self.stats
        while True:
            now = self._now()
            self._pop_dead(now)
            if not any(self._levels):
                await self._wait_idle()
                continue
            if not self._free:
                await self._wait_instance()
                continue
            max_rows = controller.limit
            candidates = self._candidates(now, max_rows)
            plan = slo.plan(
                [p.rows for p in candidates],
                [p.deadline_ns for p in candidates],
                now,
                controller.model,
                controller.rate.rate(now),
                max_rows,
                controller.objective,
            )
            stats.target = plan.target_rows
            stats.window_ns = plan.window_ns
            if plan.take == 0:
                self._threshold = plan.wake_rows or max_rows
                self._wakeup = loop.create_future()
                timer = loop.call_later((plan.wait_until_ns - now) / 1e9, self._wake)
                await self._wakeup
                timer.cancel()
                continue
            live = self._take(candidates[: plan.take], now)
            if live:
                await self._dispatch(live)

    def _take(self, batch: list[_Pending], now: int) -> list[_Pending]:
        """Dequeue ``batch`` (the head of the schedule) for the next free instance: the
        requests still worth running (those whose timeout the batch cannot meet are
        answered), with the instance's predicted end recorded for admission."""
        controller = self._slo
        assert controller is not None
        for p in batch:
            level = p.priority - 1
            popped = self._levels[level].popleft()
            assert popped is p
            self._level_rows[level] -= p.rows
            self._queued_rows -= p.rows
        live = []
        batch_ns = controller.model.predict(sum(p.rows for p in batch))
        for p in batch:
            if not p.future.done() and p.timeout_ns and slo.late(p.timeout_ns, now, batch_ns):
                self._late(p, now)
            if p.future.done():
                self._dropped(p)
            else:
                live.append(p)
        if live:
            rows = sum(p.rows for p in live)
            self._busy_until[self._free[-1]] = now + int(controller.model.predict(rows))
            self._dispatched[self._free[-1]] = now
        return live

    def _run_overdue(self, now: int) -> None:
        """An inline model's queued work that has waited ``overdue_ns`` runs now, from the
        frontend's callback that noticed it, instead of when the gather task next gets the
        loop. On a loop saturated by HTTP work one round (reading and answering every ready
        connection) can take longer than the objective, and the gather task runs one batch
        per round: queued requests would wait whole rounds. Runs before a new request is
        admitted or refused, so the request that triggers it is not in the batch (its answer
        is never written from inside its own submit) and admission sees the queue after it."""
        levels = self._levels
        oldest = 0
        for level in levels:
            if level and (not oldest or level[0].enqueued_ns < oldest):
                oldest = level[0].enqueued_ns
        if not oldest or now - oldest < self._overdue_ns or not self._free or self._closing:
            return
        controller = self._slo
        assert controller is not None
        self._pop_dead(now)
        if not any(levels):
            return
        candidates = self._candidates(now, controller.limit)
        fit, _ = slo.fitting([p.rows for p in candidates], controller.limit)
        live = self._take(candidates[: fit or 1], now)
        if not live:
            return
        self.stats.overdue_batches += 1
        instance = self._free.pop()
        self._in_flight += 1
        self._finish(live, instance, *self._compute(live, instance))

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
        if self._slo is not None:
            self._held = None  # what admission predicts from has changed
            # Timed on the loop from dispatch: the thread hops and a busy loop count too.
            now = self._now()
            dispatched = self._dispatched.pop(instance, start)
            self._busy_until.pop(instance, None)
            controller = self._slo
            controller.model.observe(total_rows, max(end - start, now - dispatched))
            if not self.inline:  # from the thread's end to here: how far behind the loop is
                controller.loop.observe(now - end, now)
            self._note_refusals()
            stats = self.stats
            feedback = controller.feedback
            budget = controller.objective.budget_ns
            queued_enough = start - budget // 10  # enqueued before this: waited 10% of budget
            for p in batch:
                stats.predicted.observe((p.predicted_ns - p.enqueued_ns) * 1e-9)
                stats.observed.observe((now - p.enqueued_ns) * 1e-9)
                # Only requests that waited in the queue tell whether admission lets in too
                # much: when the event loop, not the queue, is what delays requests (a model
                # run inline that is cheap next to the HTTP work), admitting less cannot help.
                if not p.future.done():
                    began = slo.clock_start(p.timings.received, p.enqueued_ns)
                    counts = p.feedback and p.enqueued_ns <= queued_enough
                    feedback.observe(now - began, budget, now, counts)
            stats.budget_factor = feedback.factor
            controller.refresh(self._policy.max_rows)
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
            future = p.future
            if future.done():
                offset += p.rows
                continue
            hook = p.on_done
            if hook is not None:
                future.remove_done_callback(hook)  # called below, not scheduled
            if error is not None or outputs is None:
                future.set_exception(self._failure(error))
            elif len(batch) == 1:
                future.set_result(outputs)
            else:
                stop = offset + p.rows
                future.set_result({n: a[offset:stop] for n, a in outputs.items()})
            offset += p.rows
            if hook is not None:
                try:
                    hook(future)
                except Exception:  # as the loop would for a scheduled callback: log, go on
                    log.exception("model %s: error in a request's completion", self.name)
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
