"""The SLO controller's decisions, as pure functions of measured state.

A model with ``slo: {p99_ms: ...}`` is batched by these decisions instead of a fixed
gathering window:

- ``BatchTimeModel``: batch time as a function of batch size, ``scale * (fixed + per_row * b)``.
  The line is fitted from warmup measurements; while serving, ``scale`` follows the observed
  batches with an exponential update (fast up, slow down; a median of the last three ratios
  ignores a single slow outlier), so a model that suddenly runs 3x slower is tracked within a
  few batches.
- ``ArrivalRate``: rows per second, an exponentially decayed count (a burst shows within
  ``tau``).
- ``plan``: how big a batch to form and how long to gather for it. The target batch is the
  smallest one whose throughput keeps up with the arrival rate (with headroom): 1 at low
  load (no waiting), larger as load rises. Gathering never goes past the latest start that
  still lets every request in the batch finish by its deadline.
- ``admit``: a request whose predicted completion (in-flight work + work queued ahead + its
  own batch) is past its deadline or its priority's share of the objective is refused at once,
  with a retry-after computed from the queue.
- ``LatencyFeedback``: the share of the budget admission and gathering plan with, cut when
  admitted requests finish past the budget and restored while they do not (AIMD), so what the
  batch-time model cannot see (thread hops, a busy event loop) is corrected by what happened.
- ``schedule_key``: priority order (1 is the highest, as in Triton); a request that has waited
  ``max_wait`` is served as if it had the highest priority (bounded wait, no starvation).

Every time is in nanoseconds from the same monotonic clock (``time.perf_counter_ns``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from rtserve.errors import InvalidInput

MS = 1_000_000
SHED_REASONS = ("objective", "deadline", "expired", "cancelled")
MIN_WAIT_NS = 50_000  # a shorter wait is not worth a timer (the event loop's are coarser)


@dataclass(frozen=True, slots=True)
class Objective:
    """What the controller keeps, derived from a model's ``slo`` and priority config.

    ``budget_ns``: the share of p99 the queue and the model may use (the rest is decoding,
    encoding and the network). ``reserve``: the lowest priority is admitted only within
    ``(1 - reserve)`` of the budget, so lower priorities are shed first. ``max_wait_ns``:
    after this long in the queue a request is served ahead of every priority.
    """

    p99_ns: int
    p50_ns: int = 0
    margin: float = 0.85
    priority_levels: int = 1
    default_priority: int = 1
    reserve: float = 0.5
    max_wait_ns: int = 0  # 0: half the budget
    headroom: float = 1.5
    # Derived once (read for every request): the budget; ``gather_ns``, how long a batch may
    # take to form and run (p50's share if set, else the budget); ``wait_bound_ns``.
    budget_ns: int = field(init=False, default=0)
    gather_ns: int = field(init=False, default=0)
    wait_bound_ns: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        budget = int(self.p99_ns * self.margin)
        object.__setattr__(self, "budget_ns", budget)
        gather = int(self.p50_ns * self.margin) if self.p50_ns else budget
        object.__setattr__(self, "gather_ns", gather)
        object.__setattr__(self, "wait_bound_ns", self.max_wait_ns or budget // 2)

    def budget_for(self, priority: int) -> int:
        """The admission limit of a priority level: the full budget for the highest."""
        levels = self.priority_levels
        if levels <= 1:
            return self.budget_ns
        share = 1.0 - self.reserve * (priority - 1) / (levels - 1)
        return int(self.budget_ns * share)


def objective_from_config(
    p99_ms: float, p50_ms: float = 0.0, priority_levels: int = 0, default_priority: int = 0
) -> Objective:
    levels = max(1, priority_levels)
    return Objective(
        p99_ns=int(p99_ms * MS),
        p50_ns=int(p50_ms * MS),
        priority_levels=levels,
        default_priority=default_priority or levels,
    )


def parse_priority(value: object, objective: Objective) -> int:
    """The request parameter ``priority``: 1 (highest) .. priority_levels; 0 or absent: default."""
    if value is None:
        return objective.default_priority
    levels = objective.priority_levels
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= levels:
        raise InvalidInput(
            f"parameters.priority: expected an integer from 0 (default) to {levels} "
            f"(1 is the highest), got {value!r}"
        )
    return value or objective.default_priority


# ---------------------------------------------------------------------------- batch time
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


# ---------------------------------------------------------------------------- arrivals
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


# ---------------------------------------------------------------------------- plan
@dataclass(slots=True)  # not frozen: made for every batch, and a frozen one is 4x slower to make
class SLOPlan:
    """``take``/``wait_until_ns`` as in ``policy.Plan``; ``wake_rows``: re-plan early once this
    many rows are queued; ``target_rows`` and ``window_ns`` are reported as metrics."""

    take: int
    wait_until_ns: int
    wake_rows: int = 0
    target_rows: int = 1
    window_ns: int = 0


def batch_limit(
    model: BatchTimeModel, objective: Objective, max_rows: int, factor: float = 1.0
) -> int:
    """The largest batch worth forming under the objective: a request may wait for the batch
    in flight and then run in its own, so two batch times must fit in the budget. For most
    models this is the configured maximum; for one whose full batch takes most of the
    objective (a transformer on long sequences) it is smaller, and the queue is drained (and
    admission predicted) in batches that size: full batches would make every request in the
    next one late."""
    return max(1, model.rows_within(objective.budget_ns * factor / 2, max_rows))


def rate_window(model: BatchTimeModel, max_rows: int, floor_ns: float = 50 * MS) -> float:
    """The arrival rate's time constant: at least two batch times of the largest batch, so
    that what arrives while a batch runs (the rows that will join the next one) is counted
    over enough arrivals to be read without bias, even for slow models."""
    return max(floor_ns, 2 * model.predict(max_rows))


def target_rows(
    model: BatchTimeModel, rate: float, max_rows: int, headroom: float, saturation: float = 0.95
) -> int:
    """The smallest batch whose throughput keeps up with ``rate`` rows/ns times ``headroom``.

    ``b / T(b) >= need`` with ``T(b) = F + P * b`` gives ``b >= need*F / (1 - need*P)``. The
    need is capped at ``saturation`` of what a full batch carries: near capacity, a model
    whose cost is mostly per row (a transformer) gains little from larger batches, and
    gathering for them would only add latency; one whose cost is mostly fixed still aims
    close to full batches.
    """
    if rate <= 0:
        return 1
    fixed = model.scale * model.fixed_ns
    per_row = model.scale * model.per_row_ns
    full = max_rows / (fixed + per_row * max_rows)
    need = min(headroom * rate, saturation * full)
    spare = 1.0 - need * per_row
    if spare <= 0:
        return max_rows
    return max(1, min(max_rows, math.ceil(need * fixed / spare)))


def fitting(rows: Sequence[int], max_rows: int) -> tuple[int, int]:
    """How many requests from the head of the queue fit in one batch of ``max_rows``, and
    their rows (0, 0 when the head alone is larger: it then runs alone)."""
    total = 0
    fit = 0
    for r in rows:
        if total + r > max_rows:
            break
        total += r
        fit += 1
    return fit, total


def plan(
    rows: Sequence[int],
    deadlines: Sequence[int],
    now_ns: int,
    model: BatchTimeModel,
    rate: float,
    max_rows: int,
    objective: Objective,
) -> SLOPlan:
    """Decide the next batch from the queue in schedule order.

    ``rows[i]``/``deadlines[i]``: rows and absolute deadline of the i-th queued request (the
    deadline is the earlier of its own timeout and its admission time + the gather budget).
    Dispatch at once when the batch reaches the target size, is full, or waiting would make a
    request in it late; otherwise wait for the rows the target still lacks, at most until the
    latest start. ``max_rows``: the largest batch to form (see ``batch_limit``).
    """
    fit, total = fitting(rows, max_rows)
    if fit == 0:  # nothing queued, or the head alone is larger than the limit: it runs alone
        return SLOPlan(1 if rows else 0, 0)
    earliest = min(deadlines[:fit])
    overflow = fit < len(rows)
    target = target_rows(model, rate, max_rows, objective.headroom)
    if total >= target or overflow:
        return SLOPlan(fit, 0, target_rows=target)
    latest_start = earliest - int(model.predict(target))
    gather = (target - total) / rate if rate > 0 else math.inf
    wait_until = min(latest_start, now_ns + gather)
    if wait_until - now_ns < MIN_WAIT_NS:
        return SLOPlan(fit, 0, target_rows=target)
    return SLOPlan(0, int(wait_until), target, target, int(wait_until - now_ns))


# ---------------------------------------------------------------------------- admission
def clock_start(received_ns: int, now_ns: int) -> int:
    """When a request's objective clock started: its reception (0, or a time after
    ``now_ns``, mean unknown: then ``now_ns``)."""
    return received_ns if 0 < received_ns <= now_ns else now_ns


@dataclass(slots=True)  # not frozen: made for every request, and a frozen one is 4x slower to make
class Admission:
    admitted: bool
    predicted_ns: int  # predicted completion, absolute
    deadline_ns: int  # the request's gather deadline (earlier of timeout and budget)
    reason: str = ""  # "objective" or "deadline" when refused
    retry_after_ns: int = 0  # 0 when refused: no retry can be admitted (see ``admit``)


def admit(
    rows: int,
    priority: int,
    now_ns: int,
    timeout_deadline_ns: int,
    rows_ahead: int,
    busy_ns: float,
    model: BatchTimeModel,
    max_rows: int,
    objective: Objective,
    instances: int = 1,
    batch_rows: int = 0,
    rate: float = 0.0,
    factor: float = 1.0,
    received_ns: int = 0,
) -> Admission:
    """Admit or refuse a request of ``rows`` rows.

    ``rows_ahead``: queued rows that will run before it (its priority and higher);
    ``busy_ns``: the in-flight batch's remaining time; ``timeout_deadline_ns``: its own
    deadline (0: none). Requests arriving after this one fill its batch until it starts, so
    its own batch is predicted with the rows ``rate`` brings meanwhile, and at least
    ``batch_rows`` (the controller's current target). ``factor``: the share of the budget the
    controller currently plans with (``LatencyFeedback``: below 1 after admitted requests
    finished late). ``received_ns``: when the server received the request (0: now); the
    objective's clock starts there, so time spent decoding and waiting for the event loop is
    taken off the budget. A request with nothing ahead of it is admitted even if its own
    batch alone is predicted past the objective: queueing is not what makes it late.
    """
    queued = rows_ahead + rows
    full = queued - queued % max_rows if queued % max_rows else queued - max_rows
    full_ns = model.drain_ns(full, max_rows, instances)
    last = min(max_rows, max(queued - full + int(rate * (busy_ns + full_ns)), batch_rows))
    drain = full_ns + model.predict(last)
    predicted = now_ns + int(busy_ns + drain)
    start = clock_start(received_ns, now_ns)
    limit = start + int(objective.budget_for(priority) * factor)
    deadline = start + int(objective.gather_ns * factor)
    if timeout_deadline_ns and timeout_deadline_ns < deadline:
        deadline = timeout_deadline_ns
    if timeout_deadline_ns and predicted > timeout_deadline_ns:
        if now_ns + model.predict(rows) > timeout_deadline_ns:
            # Its own batch alone ends past its deadline: no retry would do better (no
            # retry-after; the request is told its timeout is too short).
            return Admission(False, predicted, deadline, "deadline", 0)
        excess = predicted - timeout_deadline_ns
        return Admission(False, predicted, deadline, "deadline", max(MS, excess))
    if predicted > limit and (rows_ahead > 0 or busy_ns > 0):
        excess = max(MS, predicted - limit)
        return Admission(False, predicted, deadline, "objective", excess)
    return Admission(True, predicted, deadline)


def admit_one_batch(
    queued: int,
    priority: int,
    now_ns: int,
    busy_ns: float,
    model: BatchTimeModel,
    max_rows: int,
    objective: Objective,
    batch_rows: int = 0,
    factor: float = 1.0,
    received_ns: int = 0,
) -> Admission | None:
    """``admit``'s decision for a request without a timeout of its own, when it needs no
    arrival rate; None when it does (then ask ``admit``). ``queued``: the rows queued ahead
    plus the request's. If they run in one batch and even a full one, after ``busy_ns``,
    ends within the budget, ``admit`` admits whatever the rate, which only says how full
    that batch gets: the prediction here is the batch at ``batch_rows`` (the plan's current
    target), or ``queued`` if more. The common case below capacity, kept cheap."""
    if queued > max_rows:
        return None
    start = clock_start(received_ns, now_ns)
    budget = objective.budget_for(priority) * factor
    if now_ns + busy_ns + model.predict(max_rows) > start + budget:
        return None
    last = min(max_rows, max(queued, batch_rows))
    predicted = now_ns + int(busy_ns + model.predict(last))
    return Admission(True, predicted, start + int(objective.gather_ns * factor))


def admit_alone(
    rows: int,
    now_ns: int,
    model: BatchTimeModel,
    objective: Objective,
    factor: float = 1.0,
    received_ns: int = 0,
) -> Admission:
    """``admit`` when nothing is queued ahead, an instance is free and the request has no
    timeout of its own: always admitted (queueing cannot make it late), without the
    prediction of the work ahead: the common case at low load, kept cheap."""
    start = clock_start(received_ns, now_ns)
    deadline = start + int(objective.gather_ns * factor)
    return Admission(True, now_ns + int(model.predict(rows)), deadline)


def late(deadline_ns: int, now_ns: int, batch_ns: float) -> bool:
    """Whether a request can no longer finish by its own deadline: it is not worth running."""
    return now_ns + batch_ns > deadline_ns


# ---------------------------------------------------------------------------- priorities
def schedule_key(priority: int, enqueued_ns: int, now_ns: int, objective: Objective) -> tuple:
    """Sort key of a queued request: priority first, then age. One that has waited the bound
    ranks with the highest priority, ahead of younger ones (its enqueue time is earlier)."""
    if now_ns - enqueued_ns >= objective.wait_bound_ns:
        return (0, enqueued_ns)
    return (priority, enqueued_ns)


def schedule_order(
    priorities: Sequence[int], enqueued: Sequence[int], now_ns: int, objective: Objective
) -> list[int]:
    """Indices of queued requests in the order they should run."""
    return sorted(
        range(len(priorities)),
        key=lambda i: schedule_key(priorities[i], enqueued[i], now_ns, objective),
    )


# ---------------------------------------------------------------------------- state
class LatencyFeedback:
    """Closes the loop on what the batch-time model cannot see (thread hops, a busy event
    loop, time before the queue): ``factor`` is the share of the budget admission and
    gathering plan with. Over each window of completed requests (``window`` of them, or
    ``span_ns`` with at least ``min_window``), more than ``tolerance`` of them past the budget
    cuts it multiplicatively (by how late the worst was, between 0.5x and 0.9x); a window
    with none late restores ``step`` of it (5x that when even the worst used under 80% of
    the budget). Additive increase, multiplicative decrease: it
    settles where admitted requests just meet the objective."""

    __slots__ = (
        "factor", "floor", "window", "min_window", "span_ns", "tolerance", "step",
        "_n", "_late", "_worst", "_start_ns",
    )  # fmt: skip

    def __init__(
        self,
        floor: float = 0.1,
        window: int = 100,
        min_window: int = 20,
        span_ns: int = 500 * MS,
        tolerance: float = 0.01,
        step: float = 0.02,
    ) -> None:
        self.factor = 1.0
        self.floor = floor
        self.window = window
        self.min_window = min_window
        self.span_ns = span_ns
        self.tolerance = tolerance
        self.step = step
        self._n = 0
        self._late = 0
        self._worst = 0.0
        self._start_ns = 0

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
        if n >= self.window or (n >= self.min_window and now_ns - self._start_ns >= self.span_ns):
            if self._late > self.tolerance * n:
                cut = min(0.9, max(0.5, 1.0 / self._worst))
                self.factor = max(self.floor, self.factor * cut)
            elif not self._late:  # far from the budget: give back faster
                step = self.step if self._worst > 0.8 else 5 * self.step
                self.factor = min(1.0, self.factor + step)
            self._n = self._late = 0
            self._worst = 0.0


LOOP_LAG_WEIGHT = 2  # an admitted request waits for the loop before its batch and its answer
LOOP_LAG_FLOOR = 0.05  # share of the budget under which a delay is the loop's ordinary work


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


REFUSED_WEIGHT = 0.5  # added to the loop delay's weight when every request is being refused


def refused_weight(refused_share: float) -> float:
    """The loop delay's weight for admission when ``refused_share`` of recent requests were
    refused for the objective. The delay is a noisy reading, and the more admission refuses,
    the more the few requests it admits are those that came when the reading was low, not
    when the loop was: a selection that makes admitted requests later than predicted. So
    the delay counts for more as the refused share grows: twice at no refusals (before the
    batch and before the answer), two and a half times when nearly all are refused."""
    return LOOP_LAG_WEIGHT + REFUSED_WEIGHT * min(1.0, max(0.0, refused_share))


class SLOController:
    """What one batcher keeps for the decisions above: its objective, the batch-time model,
    the rate of admitted rows, the latency feedback and the event loop's lag."""

    __slots__ = ("objective", "model", "rate", "feedback", "limit", "loop")

    def __init__(self, objective: Objective, model: BatchTimeModel, tau_ns: float = 50 * MS):
        self.objective = objective
        self.model = model
        self.rate = ArrivalRate(tau_ns)
        self.feedback = LatencyFeedback()
        self.loop = LoopLag()
        self.limit = 1  # the batch limit; set by ``refresh``

    def refresh(self, max_rows: int) -> None:
        """Recompute what follows from the batch-time model (after each batch): the batch
        limit and the arrival rate's time constant. The limit is structural (the full
        budget): the feedback shrinks what is admitted, not the batches, which would cost
        throughput just when the queue is longest."""
        self.limit = batch_limit(self.model, self.objective, max_rows)
        self.rate.tau_ns = rate_window(self.model, self.limit)


def calibration_sizes(max_rows: int) -> tuple[int, ...]:
    """Batch sizes to time at warmup: enough points to fit fixed and per-row cost."""
    return tuple(sorted({1, max(1, max_rows // 4), max(1, max_rows // 2), max(1, max_rows)}))


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
