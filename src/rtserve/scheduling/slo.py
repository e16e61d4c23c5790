"""The SLO controller's decisions, as pure functions of measured state.

A model with ``slo: {p99_ms: ...}`` is batched by these decisions instead of a fixed
gathering window (``slo_policy.SLOPolicy`` carries them out; the state they are made
from, the batch-time model, the arrival rate, the latency feedback and the event loop's
lag, lives there too):

- ``plan``: how big a batch to form and how long to gather for it. The target batch is the
  smallest one whose throughput keeps up with the arrival rate (with headroom): 1 at low
  load (no waiting), larger as load rises. Gathering never goes past the latest start that
  still lets every request in the batch finish by its deadline.
- ``admit``: a request whose predicted completion (in-flight work + work queued ahead + its
  own batch) is past its deadline or its priority's share of the objective is refused at once,
  with a retry-after computed from the queue.
- ``schedule_key``: priority order (1 is the highest, as in Triton); a request that has waited
  ``max_wait`` is served as if it had the highest priority (bounded wait, no starvation).
- ``refused_weight``: how much the event loop's delay counts for admission.

Every time is in nanoseconds from the same monotonic clock (``time.perf_counter_ns``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rtserve.errors import InvalidInput

if TYPE_CHECKING:
    from rtserve.scheduling.slo_policy import BatchTimeModel

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
    turnaround_ns: float = 0.0,
) -> Admission:
    """Admit or refuse a request of ``rows`` rows.

    ``rows_ahead``: queued rows that will run before it (its priority and higher);
    ``busy_ns``: until an instance is free for the queue (the in-flight batch's remaining
    time and the turnaround after it); ``turnaround_ns``: from one batch's end to the next
    queued batch's dispatch, which each full batch queued ahead adds; ``timeout_deadline_ns``:
    its own deadline (0: none). Requests arriving after this one fill its batch until it starts, so
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
    if full and turnaround_ns:
        full_ns += turnaround_ns * math.ceil(full // max_rows / max(1, instances))
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


# ---------------------------------------------------------------------------- loop delay
LOOP_LAG_WEIGHT = 2  # an admitted request waits for the loop before its batch and its answer
LOOP_LAG_FLOOR = 0.05  # share of the budget under which a delay is the loop's ordinary work
REFUSED_WEIGHT = 0.5  # added to the loop delay's weight when every request is being refused


def refused_weight(refused_share: float) -> float:
    """The loop delay's weight for admission when ``refused_share`` of recent requests were
    refused for the objective. The delay is a noisy reading, and the more admission refuses,
    the more the few requests it admits are those that came when the reading was low, not
    when the loop was: a selection that makes admitted requests later than predicted. So
    the delay counts for more as the refused share grows: twice at no refusals (before the
    batch and before the answer), two and a half times when nearly all are refused."""
    return LOOP_LAG_WEIGHT + REFUSED_WEIGHT * min(1.0, max(0.0, refused_share))


def calibration_sizes(max_rows: int) -> tuple[int, ...]:
    """Batch sizes to time at warmup: enough points to fit fixed and per-row cost."""
    return tuple(sorted({1, max(1, max_rows // 4), max(1, max_rows // 2), max(1, max_rows)}))
