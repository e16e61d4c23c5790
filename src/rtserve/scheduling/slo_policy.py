"""The latency-objective policy: admission, priority levels and deadline-aware gathering,
from the pure decisions of ``slo``, and the state they are made from (``SLOController``):

- ``BatchTimeModel``: batch time as a function of batch size, ``scale * (fixed + per_row * b)``.
  The line is fitted from warmup measurements; while serving, ``scale`` follows the observed
  batches with an exponential update (fast up, slow down; a median of the last three ratios
  ignores a single slow outlier), so a model that suddenly runs 3x slower is tracked within a
  few batches.
- ``ArrivalRate``: rows per second, an exponentially decayed count (a burst shows within
  ``tau``).
- ``LatencyFeedback``: the share of the budget admission and gathering plan with, cut when
  admitted requests finish past the budget and restored while they do not (AIMD), so what the
  batch-time model cannot see (thread hops, a busy event loop) is corrected by what happened.
- ``LoopLag``: how far behind the event loop runs (requests wait there, not in the queue).
- the turnaround (``SLOController.observe_turnaround``): for a threaded model, from a batch's
  completion reaching the loop to the next queued batch's dispatch.

Under an inline model it also acts from the frontends' callbacks: queued work that has
waited ``overdue_share`` of the budget runs from the next admission or early check
(``_run_overdue``), and a callback queued at a loop round's first admission times the
round (``_probed``).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from rtserve.errors import DeadlineExceeded, ObjectiveRefused, Overloaded
from rtserve.scheduling import slo
from rtserve.scheduling.base import WAIT_INSTANCE, BatcherView, Request, SchedulingPolicy, Step
from rtserve.scheduling.slo import (
    LOOP_LAG_FLOOR,
    LOOP_LAG_WEIGHT,
    MS,
    Objective,
    batch_limit,
    rate_window,
)

OVERDUE_SHARE = 0.25  # of the objective's budget: see ``SLOPolicy._run_overdue``
TURNAROUND_WEIGHT = 0.1  # of each new turnaround in its running mean (~the last 10 batches)
REFUSAL_HOLD = 0.03  # of the objective's budget: see ``SLOPolicy.refuse_early``
FEEDBACK_BATCHES = 100  # 1 / the feedback's tolerance: see ``LatencyFeedback.min_batches``


class BatchTimeModel:
    """Predicted run time of a batch of ``rows``: ``scale * (fixed_ns + per_row_ns * rows)``.

    Two speeds of learning while serving: ``scale`` follows the last few batches (a sudden
    slowdown), and every few batches the line itself is refitted by exponentially weighted
    least squares over the batches served (once their sizes differ enough to tell fixed from
    per-row cost), so a warmup on unrepresentative inputs (ragged shapes are warmed up at
    length 1) is corrected by real traffic.
    """

    __slots__ = (
        "fixed_ns", "per_row_ns", "scale", "up", "down", "forget", "_recent", "_sums", "_seen",
    )  # fmt: skip

    def __init__(
        self,
        fixed_ns: float,
        per_row_ns: float,
        up: float = 1.0,
        down: float = 0.1,
        forget: float = 0.98,
    ) -> None:
        self.fixed_ns = max(0.0, fixed_ns)
        self.per_row_ns = max(0.0, per_row_ns)
        if self.fixed_ns + self.per_row_ns <= 0:
            self.fixed_ns = 1_000.0  # nothing measured yet: assume 1 µs until batches run
        self.scale = 1.0
        self.up = up
        self.down = down
        self.forget = forget
        self._recent: list[tuple[int, float]] = []
        self._sums = [0.0] * 5  # weighted: n, sum b, sum b^2, sum t, sum b*t
        self._seen = 0

    @classmethod
    def fit(cls, samples: Iterable[tuple[int, float]]) -> BatchTimeModel:
        """Least squares over the median time of each measured batch size.

        With a single size measured the split between fixed cost and per-row cost is unknown;
        half of each is assumed, which over-predicts larger batches (the safe side) until
        served batches correct the scale.
        """
        by_size: dict[int, list[float]] = {}
        for rows, ns in samples:
            if rows > 0 and ns >= 0:
                by_size.setdefault(rows, []).append(float(ns))
        if not by_size:
            return cls(0.0, 0.0)
        points = [(b, _median(ts)) for b, ts in sorted(by_size.items())]
        if len(points) == 1:
            b, t = points[0]
            return cls(t / 2, t / 2 / b)
        n = len(points)
        mean_b = sum(b for b, _ in points) / n
        mean_t = sum(t for _, t in points) / n
        sxx = sum((b - mean_b) ** 2 for b, _ in points)
        sxy = sum((b - mean_b) * (t - mean_t) for b, t in points)
        slope = max(0.0, sxy / sxx)
        fixed = mean_t - slope * mean_b
        if fixed < 0:  # a line through the origin fits better than a negative intercept
            slope = sum(b * t for b, t in points) / sum(b * b for b, _ in points)
            fixed = 0.0
        return cls(fixed, slope)

    def predict(self, rows: int) -> float:
        return self.scale * (self.fixed_ns + self.per_row_ns * rows)

    def observe(self, rows: int, ns: float) -> None:
        """Move ``scale`` toward the observed/predicted ratio (median of the last three);
        every 8 batches, refit the line to the batches served. Among the first 8, refit at
        once when the last batches all ran over twice the line's prediction: a line fitted
        at warmup on unrepresentative inputs (token sequences are warmed up at length 1) is
        wrong in its slope, not only its scale, and admission must not wait 8 batches for
        it (a fresh server put straight under overload would miss the objective meanwhile)."""
        if rows <= 0 or ns <= 0:
            return
        self._add(rows, ns)
        self._seen += 1
        recent = self._recent
        recent.append((rows, ns))
        if len(recent) > 3:
            del recent[0]
        refitted = (self._seen % 8 == 0 or (self._seen < 8 and self._line_wrong())) and (
            self._refit()
        )
        ratios = [t / (self.fixed_ns + self.per_row_ns * b) for b, t in recent]
        # Until three batches have run, the current scale stands in for the missing ones:
        # the first batch served (often slow: code and caches still cold) is not believed alone.
        ratios += [self.scale] * (3 - len(ratios))
        target = _median(ratios)
        if refitted:
            self.scale = target
            return
        if target > 1.5 * self.scale:
            # A sudden slowdown: batches from before it would only mislead the next refit.
            self._sums = [0.0] * 5
            for b, t in recent:
                if t > 1.5 * self.scale * (self.fixed_ns + self.per_row_ns * b):
                    self._add(b, t)
        rate = self.up if target > self.scale else self.down
        self.scale *= (target / self.scale) ** rate

    def _line_wrong(self) -> bool:
        """The last two or three batches all ran over twice what the fitted line predicts
        (before ``scale``, which follows the ratio but cannot fix the slope)."""
        recent = self._recent
        fixed, per_row = self.fixed_ns, self.per_row_ns
        return len(recent) >= 2 and all(t > 2 * (fixed + per_row * b) for b, t in recent)

    def _add(self, rows: int, ns: float) -> None:
        f = self.forget
        s = self._sums
        s[0] = s[0] * f + 1.0
        s[1] = s[1] * f + rows
        s[2] = s[2] * f + rows * rows
        s[3] = s[3] * f + ns
        s[4] = s[4] * f + rows * ns

    def _refit(self) -> bool:
        n, sb, sbb, st, sbt = self._sums
        mean_b = sb / n
        var_b = sbb / n - mean_b * mean_b
        if var_b < 1.0:  # batches of one size: fixed and per-row cost cannot be told apart
            return False
        mean_t = st / n
        slope = (sbt / n - mean_b * mean_t) / var_b
        fixed = mean_t - slope * mean_b
        if slope < 0:
            slope, fixed = 0.0, mean_t
        elif fixed < 0:
            slope, fixed = (sbt / n) / (sbb / n), 0.0
        if fixed + slope <= 0:
            return False
        self.fixed_ns, self.per_row_ns = fixed, slope
        return True

    def rows_within(self, ns: float, max_rows: int) -> int:
        """The largest batch (up to ``max_rows``) predicted to run within ``ns``; 0 if none."""
        fixed = self.scale * self.fixed_ns
        per_row = self.scale * self.per_row_ns
        if ns < fixed + per_row:
            return 0
        if per_row <= 0:
            return max_rows
        return min(max_rows, int((ns - fixed) / per_row))

    def drain_ns(self, rows: int, max_rows: int, instances: int = 1) -> float:
        """Time to run ``rows`` queued rows in batches of at most ``max_rows``."""
        if rows <= 0:
            return 0.0
        full, rest = divmod(rows, max_rows)
        total = math.ceil(full / max(1, instances)) * self.predict(max_rows) if full else 0.0
        return total + (self.predict(rest) if rest else 0.0)


def _median(values: Sequence[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


class ArrivalRate:
    """Arrivals per nanosecond: a count decayed with time constant ``tau_ns``.

    A burst shows within about ``tau`` (63% of a step change after ``tau``); a lull decays the
    estimate even when nothing arrives, so a quiet model stops waiting for company.
    """

    __slots__ = ("tau_ns", "_count", "_first_ns", "_last_ns")

    def __init__(self, tau_ns: float = 50 * MS) -> None:
        self.tau_ns = float(tau_ns)
        self._count = 0.0
        self._first_ns = 0
        self._last_ns = 0

    def observe(self, now_ns: int, rows: int = 1) -> None:
        if self._last_ns:
            self._count *= math.exp(-(now_ns - self._last_ns) / self.tau_ns)
        else:
            self._first_ns = now_ns
        self._count += rows
        self._last_ns = now_ns

    def rate(self, now_ns: int) -> float:
        """The decayed count over the decayed length of the window seen so far (at start-up
        the window is shorter than ``tau``: dividing by ``tau`` would under-read a burst).
        The latest arrival is left out (n arrivals span n - 1 gaps): one lone request is no
        evidence of company coming, so it is never kept waiting for it."""
        if not self._last_ns:
            return 0.0
        tau = self.tau_ns
        window = tau * -math.expm1(-max(now_ns - self._first_ns, tau / 100) / tau)
        count = self._count * math.exp(-(now_ns - self._last_ns) / tau) - 1.0
        return max(0.0, count) / window


class LatencyFeedback:
    """Closes the loop on what the batch-time model cannot see (thread hops, a busy event
    loop, time before the queue): ``factor`` is the share of the budget admission and
    gathering plan with. Over each window of completed requests (``window`` of them, or
    ``span_ns`` with at least ``min_window``), more than ``tolerance`` of them past the budget
    cuts it multiplicatively (by how late the worst was, between 0.5x and 0.9x); a window
    with none late restores ``step`` of it (5x that when even the worst used under 80% of
    the budget). Additive increase, multiplicative decrease: it
    settles where admitted requests just meet the objective.

    ``min_batches``: a window with none late past the tolerance closes only once it also
    spans that many batches (``batch``; or ``span_ns``). A batch's requests end together, so
    lateness comes a batch at a time: with 16-row batches a window of 100 requests holds 6
    outcomes, and giving back after every 6 batches on time climbs back to the next late
    batch before 1% of requests can be kept (issue 24: 8% late, a 4096-wide MLP at 2.5x).
    Cuts still come after ``window`` requests."""

    __slots__ = (
        "factor", "floor", "window", "min_window", "span_ns", "tolerance", "step",
        "min_batches", "_n", "_late", "_worst", "_start_ns", "_batches",
    )  # fmt: skip

    def __init__(
        self,
        floor: float = 0.1,
        window: int = 100,
        min_window: int = 20,
        span_ns: int = 500 * MS,
        tolerance: float = 0.01,
        step: float = 0.02,
        min_batches: int = 0,
    ) -> None:
        self.factor = 1.0
        self.floor = floor
        self.window = window
        self.min_window = min_window
        self.span_ns = span_ns
        self.tolerance = tolerance
        self.step = step
        self.min_batches = min_batches
        self._n = 0
        self._late = 0
        self._worst = 0.0
        self._start_ns = 0
        self._batches = 0

    def batch(self) -> None:
        """A batch ended (before its requests are observed)."""
        self._batches += 1

    def observe(
        self, latency_ns: float, budget_ns: float, now_ns: int, counts: bool = True
    ) -> None:
        """One admitted request finished ``latency_ns`` after it was received. ``counts``:
        whether its lateness is admission's to correct (it waited in the queue behind other
        work); every request closes windows, so the share is given back while none is late."""
        if budget_ns <= 0:
            return
        if not self._n:
            self._start_ns = now_ns
        self._n += 1
        ratio = latency_ns / budget_ns
        if ratio > 1.0 and counts:
            self._late += 1
        if ratio > self._worst:
            self._worst = ratio
        n = self._n
        excess = self._late > self.tolerance * n
        full = n >= self.window and (excess or self._batches >= self.min_batches)
        if full or (n >= self.min_window and now_ns - self._start_ns >= self.span_ns):
            if excess:
                cut = min(0.9, max(0.5, 1.0 / self._worst))
                self.factor = max(self.floor, self.factor * cut)
            elif not self._late:  # far from the budget: give back faster
                step = self.step if self._worst > 0.8 else 5 * self.step
                self.factor = min(1.0, self.factor + step)
            self._n = self._late = self._batches = 0
            self._worst = 0.0


class LoopLag:
    """How far behind the event loop is running: the last measured delay between a callback
    becoming ready and running (a batch's completion reaching the loop from its thread, the
    gather task resuming after it yielded to the frontends, a probe timing the rest of a loop
    round), held for as long as it took (the round being measured is taken to be as long as
    the last: a saturated loop does not catch up by itself), then drained in real time, until
    the next measurement. When the HTTP work of a model that is cheap next to it saturates the
    loop, requests wait in the loop's ready queue, not in the batcher's: ``delay_ns`` is that
    wait as work ahead of a request, for admission to count (twice: before its batch runs and
    before its answer is written), and 0 while the loop keeps up."""

    __slots__ = ("lag_ns", "at_ns")

    def __init__(self) -> None:
        self.lag_ns = 0
        self.at_ns = 0

    def observe(self, lag_ns: int, now_ns: int) -> None:
        self.lag_ns = max(0, lag_ns)
        self.at_ns = now_ns

    def current(self, now_ns: int) -> int:
        lag = self.lag_ns
        elapsed = now_ns - self.at_ns
        return lag if elapsed <= lag else max(0, 2 * lag - elapsed)

    def delay_ns(
        self, now_ns: int, budget_ns: int, running_ns: int = 0, weight: float = LOOP_LAG_WEIGHT
    ) -> int:
        """``running_ns``: how long the loop round still running has run so far, when known
        (a round can outlast every measurement before it: under overload, the event loop
        polls again without yielding while every poll fills its event buffer). ``weight``:
        how many times the delay is counted (see ``refused_weight``)."""
        lag = max(self.current(now_ns), running_ns)
        return int(weight * lag) if lag > budget_ns * LOOP_LAG_FLOOR else 0


class SLOController:
    """What one batcher keeps for the decisions above: its objective, the batch-time model,
    the rate of admitted rows, the latency feedback, the event loop's lag and the turnaround
    between batches."""

    __slots__ = ("objective", "model", "rate", "feedback", "limit", "loop", "turnaround_ns")

    def __init__(self, objective: Objective, model: BatchTimeModel, tau_ns: float = 50 * MS):
        self.objective = objective
        self.model = model
        self.rate = ArrivalRate(tau_ns)
        self.feedback = LatencyFeedback(min_batches=FEEDBACK_BATCHES)
        self.loop = LoopLag()
        self.limit = 1  # the batch limit; set by ``refresh``
        self.turnaround_ns = 0.0  # see ``observe_turnaround``

    def observe_turnaround(self, ns: int) -> None:
        """From a threaded batch's completion reaching the loop to the dispatch of the batch
        queued behind it: the finished batch's answers are written and the gather task waits
        for its turn in the loop. The batch-time model times a batch from its dispatch to
        that completion, so a busy queue drains one batch per batch time plus this (a running
        mean): ~0.75 ms after each 10 ms batch of a 4096-wide MLP on one core at 2.5x its
        capacity, which admission would otherwise miss once per batch queued ahead."""
        self.turnaround_ns += TURNAROUND_WEIGHT * (ns - self.turnaround_ns)

    def refresh(self, max_rows: int) -> None:
        """Recompute what follows from the batch-time model (after each batch): the batch
        limit and the arrival rate's time constant. The limit is structural (the full
        budget): the feedback shrinks what is admitted, not the batches, which would cost
        throughput just when the queue is longest."""
        self.limit = batch_limit(self.model, self.objective, max_rows)
        self.rate.tau_ns = rate_window(self.model, self.limit)


def measure(
    run: Callable[[int], object], sizes: Iterable[int], iterations: int = 3
) -> list[tuple[int, int]]:
    """(rows, ns) samples of ``run(rows)``, after one untimed run per size."""
    samples = []
    for rows in sizes:
        run(rows)
        for _ in range(iterations):
            start = time.perf_counter_ns()
            run(rows)
            samples.append((rows, time.perf_counter_ns() - start))
    return samples


class SLOPolicy(SchedulingPolicy):
    def __init__(
        self,
        controller: SLOController,
        max_rows: int,
        max_queue: int,
        overdue_share: float = OVERDUE_SHARE,
    ) -> None:
        """``controller``: the objective and its state; ``max_rows``: the model's largest
        batch; ``overdue_share``: of its budget, how long an inline model's queued work may
        wait before a frontend callback runs it (``_run_overdue``; 0: never)."""
        self.controller = controller
        self._max_rows = max_rows
        self._max_queue = max_queue
        self._overdue_share = overdue_share
        levels = controller.objective.priority_levels
        # One FIFO per priority level (index 0 is priority 1, the highest).
        self._levels: list[deque[Request]] = [deque() for _ in range(levels)]
        self._level_rows = [0] * levels
        self._queued_rows = 0
        self._threshold = max_rows  # re-plan early once this many rows are queued
        self._busy_until: dict[int, int] = {}  # instance -> predicted end of its batch
        self._dispatched: dict[int, int] = {}  # instance -> when its batch was dispatched
        # instance -> when its batch finished with work queued behind it (a turnaround to time)
        self._turnaround_from: dict[int, int] = {}
        # The last admission ``refuse_early`` granted: (received_ns, decision, work ahead).
        self._early: tuple[int, slo.Admission, bool] | None = None
        self._probing = False  # a loop-round probe is queued (``_admission``)
        self._probe_ns = 0  # when it was queued
        # The refusal ``refuse_early`` last decided, while it stands: (until when, in ns, the
        # refusal); dropped when a batch finishes or the loop is timed again.
        self._held: tuple[int, ObjectiveRefused] | None = None
        self._hold_ns = int(controller.objective.budget_ns * REFUSAL_HOLD)
        # Requests admitted and refused for the objective, as last read by
        # ``_note_refusals``, the refused share (decayed) and the loop delay's weight.
        self._admitted = self._seen_admitted = self._seen_refused = 0
        self._refused_share = 0.0
        self._lag_weight = float(slo.LOOP_LAG_WEIGHT)
        self._overdue_ns = 0  # set by ``bind``: inline models only

    def bind(self, engine: BatcherView) -> None:
        super().bind(engine)
        controller = self.controller
        self.name = engine.name
        self.stats = engine.stats
        self._now = engine.clock
        self._free = engine.free
        self._instances = engine.instance_count
        self._inline = engine.inline
        if engine.inline:
            self._overdue_ns = int(controller.objective.budget_ns * self._overdue_share)
        self.stats.objective_ns = controller.objective.p99_ns
        controller.refresh(self._max_rows)

    @property
    def queue_depth(self) -> int:
        levels = self._levels
        return len(levels[0]) if len(levels) == 1 else sum(len(q) for q in levels)

    # ------------------------------------------------------------------ admission
    def add(self, request: Request, timeout_s: float, priority: object) -> None:
        controller = self.controller
        objective = controller.objective
        rows = request.rows
        timings = request.timings
        level = slo.parse_priority(priority, objective) if objective.priority_levels > 1 else 1
        if self.queue_depth >= self._max_queue:
            self.stats.count_shed("queue_full", level)
            raise Overloaded(
                f"model '{self.name}' queue is full ({self._max_queue} requests); retry later"
            )
        now = request.enqueued_ns = timings.enqueued = self._now()
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
        request.priority = level
        request.deadline_ns = decision.deadline_ns
        request.timeout_ns = timeout_ns
        request.predicted_ns = decision.predicted_ns
        # Fed back only when admission could have refused it (work was ahead of it) and its
        # own batch is not most of the budget: lateness without queueing (a busy event loop
        # before it reached the queue) is not corrected by admitting less.
        request.feedback = queued and (controller.model.predict(rows) < objective.budget_ns / 2)
        self._levels[level - 1].append(request)
        self._level_rows[level - 1] += rows
        self._queued_rows += rows

    def wake_now(self) -> bool:
        return self._queued_rows >= self._threshold

    def _admission(
        self, rows: int, level: int, now: int, timeout_ns: int, received_ns: int
    ) -> tuple[slo.Admission, bool]:
        """Admission's decision for a request, and whether work was ahead of it."""
        controller = self.controller
        objective = controller.objective
        busy_ns = self._in_flight_ns(now) if not self._free and self._busy_until else 0
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
            loop = self.engine.loop
            assert loop is not None
            loop.call_soon(self._probed, now)
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
            self._instances,
            slo.target_rows(controller.model, rate, max_rows, objective.headroom),
            rate,
            factor,
            received_ns,
            controller.turnaround_ns,
        )
        return decision, ahead > 0 or busy_ns > 0

    def _in_flight_ns(self, now: int) -> int:
        """Until an instance is free for the queue: the earliest predicted end of a batch in
        flight, then the turnaround. A batch already past its predicted end is taken to need
        as long again as it has overrun (one running long tends to run longer: the core is
        taken by something else): counted as ending now, it would let in a batch's worth of
        requests that all wait for it."""
        remaining = min(end - now if end > now else now - end for end in self._busy_until.values())
        return remaining + int(self.controller.turnaround_ns)

    def _probed(self, sent_ns: int) -> None:
        self._probing = False
        self._held = None
        now = self._now()
        self.controller.loop.observe(now - sent_ns, now)
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

        The smallest request (one row, no timeout of its own) is checked; if even it would
        be refused, so would this one, and the server answers 429 without decoding it. When
        the HTTP work, not the model, is what saturates, a refusal that skips the decode
        costs about half of one that does. Only without priority levels: the request's level
        is in its body, and a higher one might be admitted.

        Requests refused back to back get the same refusal object (see ``REFUSAL_HOLD``): it
        is to be answered, not raised (raise a copy)."""
        if self.controller.objective.priority_levels > 1 or self.engine.closing:
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

    # ------------------------------------------------------------------ scheduling
    def next(self, now_ns: int, instance: int) -> Step | None:
        controller = self.controller
        stats = self.stats
        while True:
            self._pop_dead(now_ns)
            if not any(self._levels):
                return None
            if instance < 0:
                return WAIT_INSTANCE
            max_rows = controller.limit
            candidates = self._candidates(now_ns, max_rows)
            plan = slo.plan(
                [p.rows for p in candidates],
                [p.deadline_ns for p in candidates],
                now_ns,
                controller.model,
                controller.rate.rate(now_ns),
                max_rows,
                controller.objective,
            )
            stats.target = plan.target_rows
            stats.window_ns = plan.window_ns
            if plan.take == 0:  # gathering: the wait from the last batch is no turnaround
                self._turnaround_from.pop(instance, None)
                self._threshold = plan.wake_rows or max_rows
                return Step([], plan.wait_until_ns)
            live = self._take(candidates[: plan.take], now_ns, instance)
            if live:
                return Step(live)

    def _pop_dead(self, now: int) -> None:
        """Drop finished (cancelled, expired) requests at the head of each level, and those
        that can no longer finish by their own timeout: they are answered, never run."""
        model = self.controller.model
        for i, level in enumerate(self._levels):
            while level:
                head = level[0]
                if not head.future.done():
                    if not head.timeout_ns or not slo.late(
                        head.timeout_ns, now, model.predict(head.rows)
                    ):
                        break
                    self._late(head, now)
                level.popleft()
                self._level_rows[i] -= head.rows
                self._queued_rows -= head.rows
                self.engine.dropped(head)

    def _late(self, request: Request, now: int) -> None:
        if request.timer is not None:
            request.timer.cancel()
        self.stats.count_shed("expired", request.priority)
        left = (request.timeout_ns - now) / 1e6
        request.future.set_exception(
            DeadlineExceeded(
                f"model '{self.name}': the request's deadline ({left:.3g} ms away) is "
                f"sooner than its batch can finish; not run"
            )
        )

    def _candidates(self, now: int, max_rows: int) -> list[Request]:
        """Queued requests in schedule order (priority, bounded wait), up to one past a full
        batch of ``max_rows``, all with the head's input shapes."""
        objective = self.controller.objective
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

    def _take(self, batch: list[Request], now: int, instance: int) -> list[Request]:
        """Dequeue ``batch`` (the head of the schedule) for ``instance``: the requests still
        worth running (those whose timeout the batch cannot meet are answered), with the
        instance's predicted end recorded for admission."""
        model = self.controller.model
        for p in batch:
            level = p.priority - 1
            popped = self._levels[level].popleft()
            assert popped is p
            self._level_rows[level] -= p.rows
            self._queued_rows -= p.rows
        live = []
        batch_ns = model.predict(sum(p.rows for p in batch))
        for p in batch:
            if not p.future.done() and p.timeout_ns and slo.late(p.timeout_ns, now, batch_ns):
                self._late(p, now)
            if p.future.done():
                self.engine.dropped(p)
            else:
                live.append(p)
        if live:
            rows = sum(p.rows for p in live)
            self._busy_until[instance] = now + int(model.predict(rows))
            self._dispatched[instance] = now
            since = self._turnaround_from.pop(instance, 0)
            if since:
                self.controller.observe_turnaround(now - since)
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
        free = self._free
        if not oldest or now - oldest < self._overdue_ns or not free or self.engine.closing:
            return
        controller = self.controller
        self._pop_dead(now)
        if not any(levels):
            return
        candidates = self._candidates(now, controller.limit)
        fit, _ = slo.fitting([p.rows for p in candidates], controller.limit)
        live = self._take(candidates[: fit or 1], now, free[-1])
        if not live:
            return
        self.stats.overdue_batches += 1
        self.engine.run_now(live)

    # ------------------------------------------------------------------ feedback
    def finished(
        self,
        batch: list[Request],
        rows: int,
        instance: int,
        start_ns: int,
        end_ns: int,
        failed: bool = False,
    ) -> None:
        self._held = None  # what admission predicts from has changed
        # Timed on the loop from dispatch: the thread hops and a busy loop count too.
        now = self._now()
        dispatched = self._dispatched.pop(instance, start_ns)
        self._busy_until.pop(instance, None)
        if failed:  # its time includes each request's own rerun: neither cost nor lateness
            self._note_refusals()
            return
        controller = self.controller
        controller.model.observe(rows, max(end_ns - start_ns, now - dispatched))
        if not self._inline:  # from the thread's end to here: how far behind the loop is
            controller.loop.observe(now - end_ns, now)
            if self._queued_rows:
                self._turnaround_from[instance] = now
        self._note_refusals()
        stats = self.stats
        feedback = controller.feedback
        budget = controller.objective.budget_ns
        queued_enough = start_ns - budget // 10  # enqueued before this: waited 10% of budget
        feedback.batch()
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
        controller.refresh(self._max_rows)

    def resumed(self, yielded_ns: int) -> None:
        """What ran meanwhile: how far behind the loop is."""
        self._held = None
        now = self._now()
        self.controller.loop.observe(now - yielded_ns, now)
