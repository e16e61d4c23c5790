"""The dynamic batcher: the execution engine of one model version.

Requests (each may carry several rows) are handed to the version's scheduling policy
(``base.SchedulingPolicy``: the fixed window of ``window.py`` or the latency objective of
``slo_policy.py``), which admits and queues them; the batcher's loop asks the policy for
the next batch, concatenates it along dimension 0, runs it on a free instance and splits
the outputs back to each request's future. Small models run inline on the event loop (a
thread hop would cost more than the compute); larger ones run on executor threads, and each
batch completes all its futures with a single ``call_soon_threadsafe``.

Direct runs (an option, off by default: ``RTSERVE_DIRECT_MAX_US``, a bound in
microseconds): an inline model whose one-row batches take at most that long (measured as it
serves) runs a request at once, in the frontend's callback that submits it, when the
batcher is idle (nothing queued or running) and the policy would dispatch it alone anyway;
this skips the wakeup of the gather loop and its extra event loop step. At most one request
per event loop step runs so: the others that arrive in the same step are queued and
batched as usual, so concurrent load still uses the batcher (but the first request of a
burst runs alone, which can cost more than the step it saves: on a 2-core machine with
the load client on it, one-row requests measured no faster either way). The log says when
a model starts and stops doing so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from rtserve.errors import (
    DeadlineExceeded,
    InferenceFailed,
    InstanceFailed,
    InvalidInput,
    RTServeError,
    ShuttingDown,
)
from rtserve.observability.metrics import SchedulerStats
from rtserve.protocol.types import Timings
from rtserve.runtime.base import Runtime
from rtserve.scheduling.base import OnDone, Outputs, Request, SchedulingPolicy

# One request run alone after its batch failed: its outputs or its error, and the run's ns.
Result = tuple[Outputs | None, BaseException | None, int]

log = logging.getLogger(__name__)

BatchObserver = Callable[[int, int], None]  # (rows in batch, compute ns)


def _direct_max_ns() -> int:
    raw = os.environ.get("RTSERVE_DIRECT_MAX_US", "0")
    try:
        return max(0, int(float(raw) * 1000))
    except ValueError:
        log.warning("RTSERVE_DIRECT_MAX_US=%r is not a number; direct runs stay off", raw[:40])
        return 0


# One-row batches at most this long (ns) may run directly on arrival (see the docstring;
# 0: off). 200 us (RTSERVE_DIRECT_MAX_US=200) covers the compiled and ONNX tree models.
DIRECT_MAX_NS = _direct_max_ns()


class Batcher:
    """Implements ``base.BatcherView`` for its policy."""

    refuse_early: Callable[[int], RTServeError | None]

    def __init__(
        self,
        name: str,
        runtime: Runtime,
        policy: SchedulingPolicy,
        batched: bool,
        inline: bool,
        on_batch: BatchObserver | None = None,
        clock: Callable[[], int] = time.perf_counter_ns,
        stats: SchedulerStats | None = None,
        max_rows: int = 0,
    ) -> None:
        """``policy``: decides admission and batches (bound to this batcher here);
        ``clock``: nanoseconds, injectable so tests need no sleeps."""
        self.name = name
        self._runtime = runtime
        self._batched = batched
        # More rows than a batch may hold would wait at the head of the queue for ever,
        # and everything behind it (the dataplane refuses them; callers that bypass it,
        # as an ensemble's steps, are refused here). 0: not checked.
        self._max_rows = max_rows
        self.inline = inline
        self.instance_count = runtime.instance_count
        self._on_batch = on_batch
        self.clock = self._now = clock
        self.free: list[int] = list(range(runtime.instance_count))
        self._in_flight = 0
        self._ragged = any(-1 in spec.shape for spec in runtime.inputs) and batched
        self._executor: ThreadPoolExecutor | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Future[None] | None = None
        self._idle_wait = False
        self._instance_wait: asyncio.Future[None] | None = None
        self._drained: asyncio.Future[None] | None = None
        self.closing = False
        self.stats = stats if stats is not None else SchedulerStats()
        self.cancelled = 0  # requests whose client went away before their batch ran
        self.policy = policy
        policy.bind(self)
        # Direct runs: allowed by the policy, the mode and the bound; ``solo_ns``: a moving
        # average of one-row batch times (-1: none measured yet).
        self._direct_max_ns = DIRECT_MAX_NS if inline and policy.allows_direct else 0
        self.solo_ns = -1.0
        self.direct = False  # one-row batches are fast enough (solo_ns <= the bound)
        self._direct_used = False  # a direct run happened in this event loop step
        self.direct_runs = 0
        self._direct_changes = 0  # (the first change each way is logged at INFO)
        # Called per request before its decode: the policy's own, without a hop through here.
        self.refuse_early = policy.refuse_early

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        if not self.inline:
            self._executor = ThreadPoolExecutor(
                max_workers=self._runtime.instance_count, thread_name_prefix=f"rt-{self.name}"
            )
        self._task = self.loop.create_task(self._gather_loop(), name=f"batcher-{self.name}")

    @property
    def queue_depth(self) -> int:
        return self.policy.queue_depth

    @property
    def busy(self) -> bool:
        return self.policy.queue_depth > 0 or self._in_flight > 0

    async def drain(self) -> None:
        """Wait until every admitted request has been answered."""
        while self.busy:
            assert self.loop is not None
            self._drained = self.loop.create_future()
            await self._drained

    async def stop(self) -> None:
        """Refuse new requests, finish admitted ones, then stop the loop and threads."""
        self.closing = True
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
        parameter, for a policy with priority levels. The policy may refuse the request
        (it raises the typed error).

        ``on_done``: the future's done callback. When the request's batch completes it is
        called there and then, in the same event loop step, instead of being scheduled: a
        scheduled callback runs only after the loop's next poll, which on a loop busy with
        many clients is one whole round of reading and parsing them later. Any other
        ending (expired, cancelled, refused) reaches it as a done callback, as usual."""
        if self.closing:
            raise ShuttingDown(f"model '{self.name}' is shutting down")
        if self._max_rows and rows > self._max_rows:
            raise InvalidInput(
                f"model '{self.name}': a request of {rows} rows exceeds its max_batch_size "
                f"{self._max_rows}"
            )
        loop = self.loop
        assert loop is not None, "batcher not started"
        shape_key = tuple(a.shape[1:] for a in feeds.values()) if self._ragged else None
        request = Request(feeds, rows, timings, shape_key)
        self.policy.add(request, timeout_s, priority)
        future: asyncio.Future[Outputs] = loop.create_future()
        request.future = future
        if on_done is not None:
            request.on_done = on_done
            future.add_done_callback(on_done)
        wakeup = self._wakeup
        if (
            self.direct
            and self._idle_wait  # (so nothing else is queued or running)
            and not self._direct_used
            and self.free
            and self.policy.queue_depth == 1
            and wakeup is not None
            and not wakeup.done()
        ):
            step = self.policy.next(self._now(), self.free[-1])
            if step is not None and step.batch:
                self._direct_used = True
                loop.call_soon(self._direct_step_over)
                self.direct_runs += 1
                self.run_now(step.batch)
                return future
        if timeout_s > 0:
            request.timer = loop.call_later(timeout_s, self._expire, request, timeout_s)
        if wakeup is not None and not wakeup.done() and (self._idle_wait or self.policy.wake_now()):
            wakeup.set_result(None)
        return future

    def _direct_step_over(self) -> None:
        self._direct_used = False

    def _learn_solo(self, ns: int) -> None:
        """A one-row batch took ``ns``: update ``solo_ns`` and whether direct runs pay.

        ``solo_ns`` goes half way down to a shorter time but only 5% up to a longer one: a
        run preempted by another process on a busy machine says little of the model, and a
        model that is slow for good still turns direct runs off within a few dozen runs."""
        solo = self.solo_ns
        if solo < 0:
            self.solo_ns = ns
        else:
            self.solo_ns = min(solo * 1.05, ns) if ns > solo else (solo + ns) / 2
        # (on at the bound, off at 1.5x it: a time near the bound does not flip it back and forth)
        limit = self._direct_max_ns * (1.5 if self.direct else 1.0)
        direct = self.solo_ns <= limit
        if direct != self.direct:
            self.direct = direct
            self._direct_changes += 1
            log.log(
                logging.INFO if self._direct_changes <= 2 else logging.DEBUG,
                "model %s: one-row batches take %.0f us; requests on an idle batcher %s",
                self.name, self.solo_ns / 1e3,
                "now run directly on arrival" if direct else "go through the gather loop again",
            )  # fmt: skip

    def _expire(self, request: Request, timeout_s: float) -> None:
        if not request.future.done():
            self.stats.count_shed("expired", request.priority)
            request.future.set_exception(
                DeadlineExceeded(
                    f"model '{self.name}': request timed out after {timeout_s * 1e3:.3g} ms"
                )
            )

    def dropped(self, request: Request) -> None:
        """A queued request that will not run: count it if its client went away."""
        if request.future.cancelled():
            self.cancelled += 1
            self.stats.count_shed("cancelled", request.priority)
            if request.timer is not None:
                request.timer.cancel()

    # ------------------------------------------------------------------ the gather loop
    def _wake(self, _: object = None) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def _wait_idle(self) -> None:
        """Nothing queued: say so to ``drain`` and sleep until a request arrives."""
        assert self.loop is not None
        self._notify_drained()
        self._idle_wait = True
        self._wakeup = self.loop.create_future()
        await self._wakeup
        self._idle_wait = False

    async def _wait_instance(self) -> None:
        """Every instance is busy: sleep until a batch finishes."""
        assert self.loop is not None
        self._instance_wait = self.loop.create_future()
        await self._instance_wait

    async def _gather_loop(self) -> None:
        loop = self.loop
        assert loop is not None
        policy = self.policy
        free = self.free
        while True:
            now = self._now()
            step = policy.next(now, free[-1] if free else -1)
            if step is None:
                await self._wait_idle()
                continue
            batch = step.batch
            if batch:
                await self._dispatch(batch)
                continue
            until = step.wait_until_ns
            if until < 0:
                await self._wait_instance()
                continue
            self._wakeup = loop.create_future()
            timer = loop.call_later((until - now) / 1e9, self._wake) if until else None
            await self._wakeup
            if timer is not None:
                timer.cancel()

    async def _dispatch(self, batch: list[Request]) -> None:
        instance = self.free.pop()
        self._in_flight += 1
        if self.inline:
            result = self._compute(batch, instance)
            yielded = self._now()  # the answers written by ``_finish`` are the loop's work too
            self._finish(batch, instance, *result)
            await asyncio.sleep(0)  # let the frontends run between inline batches
            self.policy.resumed(yielded)
        else:
            assert self._executor is not None
            self._executor.submit(self._compute_threaded, batch, instance)

    def run_now(self, batch: list[Request]) -> None:
        """Run ``batch`` here and now, inline, on the last free instance (a policy acting
        from a frontend's callback: see ``SLOPolicy._run_overdue``)."""
        instance = self.free.pop()
        self._in_flight += 1
        self._finish(batch, instance, *self._compute(batch, instance))

    # ------------------------------------------------------------------ execution
    def _compute(
        self, batch: list[Request], instance: int
    ) -> tuple[Outputs | None, BaseException | None, int, int, list[Result] | None]:
        """The batch's outputs or error, its start and end; when a batch of several requests
        fails, each request run alone (one request's data, an index out of range, must not
        fail the others)."""
        start = self._now()
        try:
            if len(batch) == 1:
                feeds = batch[0].feeds
            else:
                names = batch[0].feeds.keys()
                feeds = {n: np.concatenate([p.feeds[n] for p in batch]) for n in names}
            outputs = self._runtime.run(instance, feeds)
            return outputs, None, start, self._now(), None
        except BaseException as exc:  # the model's failure is reported to each request
            exc = _as_exception(exc)
            end = self._now()
            if len(batch) == 1 or isinstance(exc, InstanceFailed):
                return None, exc, start, end, None  # (a hung or dead instance: not the data)
            log.warning(
                "model %s: a batch of %d requests failed (%s); running each alone",
                self.name, len(batch), type(exc).__name__,
            )  # fmt: skip
        alone: list[Result] = []
        for p in batch:
            began = self._now()
            if p.future.done():  # (answered meanwhile: expired or cancelled)
                alone.append((None, None, 0))
                continue
            try:
                alone.append((self._runtime.run(instance, p.feeds), None, self._now() - began))
            except BaseException as exc:
                alone.append((None, _as_exception(exc), self._now() - began))
        return None, None, start, end, alone

    def _compute_threaded(self, batch: list[Request], instance: int) -> None:
        result = self._compute(batch, instance)
        assert self.loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
            self.loop.call_soon_threadsafe(self._finish, batch, instance, *result)

    def _finish(
        self,
        batch: list[Request],
        instance: int,
        outputs: Outputs | None,
        error: BaseException | None,
        start: int,
        end: int,
        alone: list[Result] | None = None,
    ) -> None:
        self.free.append(instance)
        self._in_flight -= 1
        total_rows = sum(p.rows for p in batch)
        # A batch that failed and was rerun teaches the policy nothing about batch times.
        self.policy.finished(batch, total_rows, instance, start, end, failed=alone is not None)
        if total_rows == 1 and self._direct_max_ns and error is None and alone is None:
            self._learn_solo(end - start)
        if self._on_batch is not None:
            self._on_batch(total_rows, end - start)
            if alone is not None:
                for p, (_, _, ns) in zip(batch, alone, strict=True):
                    if ns:
                        self._on_batch(p.rows, ns)
        if alone is not None:
            self.stats.reruns += 1
        if outputs is not None:
            error = self._check_rows(outputs, total_rows)
        offset = 0
        for i, p in enumerate(batch):
            if alone is not None:  # the batch failed; each request was run by itself
                outputs, error, _ = alone[i]
                if outputs is not None:
                    error = self._check_rows(outputs, p.rows)
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
            elif len(batch) == 1 or alone is not None:
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
        self._notify_drained()

    def _check_rows(self, outputs: Outputs, rows: int) -> InferenceFailed | None:
        if not self._batched:
            return None
        bad = [n for n, a in outputs.items() if a.ndim == 0 or a.shape[0] != rows]
        if bad:
            return InferenceFailed(
                f"model '{self.name}': output {bad[0]!r} has no batch dimension of size {rows}"
            )
        return None

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


def _as_exception(exc: BaseException) -> Exception:
    """A runtime's failure as an error for its requests: a ``SystemExit`` or
    ``KeyboardInterrupt`` from a model's own code must not end the batcher (its requests,
    and every later one, would wait for ever)."""
    if isinstance(exc, Exception):
        return exc
    log.error("model code raised %s", type(exc).__name__, exc_info=exc)
    return InferenceFailed(f"the model raised {type(exc).__name__}")
