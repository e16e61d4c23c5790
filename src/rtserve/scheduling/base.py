"""What the batcher (the execution engine) and a scheduling policy share.

The batcher does: it runs the loop, dispatches batches inline or on threads, concatenates
inputs, splits a batch's outputs back to its requests, drains and stops. A policy decides:
it admits or refuses each request (``add``, ``refuse_early``), keeps the queue, says which
queued requests form the next batch or when to ask again (``next``), and learns from each
finished batch (``finished``). The fixed window (``window.py``) and the latency objective
(``slo_policy.py``) are two policies; a new way of scheduling is a third one.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from rtserve.errors import RTServeError
from rtserve.observability.metrics import SchedulerStats
from rtserve.protocol.types import Timings

Outputs = dict[str, np.ndarray]
OnDone = Callable[["asyncio.Future[Outputs]"], object]


class Request:
    """One queued request (it may carry several rows). The batcher makes it; the policy
    that admits it sets ``enqueued_ns`` (and ``timings.enqueued``) and, if it uses them,
    the scheduling fields (left unset otherwise: a refused request costs less to make)."""

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
    future: asyncio.Future[Outputs]  # set by the batcher once the policy admitted it
    enqueued_ns: int
    # The latency objective's: the deadline gathering keeps (the earlier of its timeout and
    # the objective), its own timeout (0: none), the completion predicted at admission, and
    # whether its latency is fed back (not when its own batch takes much of the budget).
    deadline_ns: int
    timeout_ns: int
    predicted_ns: int
    feedback: bool

    def __init__(
        self, feeds: dict[str, np.ndarray], rows: int, timings: Timings, shape_key: Any
    ) -> None:
        self.feeds = feeds
        self.rows = rows
        self.timings = timings
        self.shape_key = shape_key  # requests of different shape keys never share a batch
        self.timer: asyncio.TimerHandle | None = None
        self.priority = 1  # 1 is the highest (as in Triton)
        # The caller's done callback: a done callback of the future for every other ending,
        # called by the batch's completion directly rather than scheduled (``Batcher.submit``).
        self.on_done: OnDone | None = None


@dataclass(slots=True)
class Step:
    """What the batcher does next: run ``batch`` now on the instance it asked about, or
    (``batch`` empty) wait until ``wait_until_ns`` or until ``wake_now`` says so after an
    arrival (0: no timer); ``WAIT_INSTANCE``: until a batch finishes."""

    batch: list[Request]
    wait_until_ns: int = 0


WAIT_INSTANCE = Step([], -1)


class BatcherView(Protocol):
    """What a policy sees of the batcher it schedules for (given once, by ``bind``)."""

    name: str
    inline: bool  # batches run on the event loop
    instance_count: int
    free: list[int]  # the free instances (the batcher's own list: read, never change it)
    closing: bool
    loop: asyncio.AbstractEventLoop | None  # set by ``start``
    stats: SchedulerStats
    clock: Callable[[], int]

    def dropped(self, request: Request) -> None: ...

    def run_now(self, batch: list[Request]) -> None: ...


class SchedulingPolicy(ABC):
    """Decides for one batcher: which requests it admits, in which batches they run, and
    when. Every call comes from the event loop's thread."""

    engine: BatcherView
    # Whether the batcher may run a request at once on arrival when it is idle and ``next``
    # gives that request alone (``batcher.py``, direct runs); ``next`` must then be a pure
    # decision that a call from a frontend's callback does not upset.
    allows_direct = False

    def bind(self, engine: BatcherView) -> None:
        """Called once by the batcher this policy schedules for, at its construction."""
        self.engine = engine

    @property
    @abstractmethod
    def queue_depth(self) -> int:
        """Requests queued (not yet dispatched), finished ones not yet dropped included."""

    @abstractmethod
    def add(self, request: Request, timeout_s: float, priority: object) -> None:
        """Admit and queue ``request`` (set ``enqueued_ns`` and ``timings.enqueued``), or
        raise the typed error that refuses it. ``timeout_s``: its own timeout (0: none;
        the batcher expires it); ``priority``: the request parameter, unparsed."""

    def wake_now(self) -> bool:
        """Asked after an arrival while the batcher waits for a timer: re-plan at once?"""
        return True

    @abstractmethod
    def next(self, now_ns: int, instance: int) -> Step | None:
        """The next step: None when nothing is queued; ``WAIT_INSTANCE`` when ``instance``
        is -1 (none free) and something is; else a batch for ``instance`` or a wait.
        Requests that will not run are dropped here (``engine.dropped``)."""

    @abstractmethod
    def finished(
        self,
        batch: list[Request],
        rows: int,
        instance: int,
        start_ns: int,
        end_ns: int,
        failed: bool = False,
    ) -> None:
        """``batch`` (``rows`` rows) ran on ``instance`` from ``start_ns`` to ``end_ns``;
        called before its requests are answered. ``failed``: the batch failed and its
        requests were run again one at a time (its times say nothing about batch costs)."""

    def resumed(self, yielded_ns: int) -> None:
        """The batcher yielded the event loop at ``yielded_ns`` after an inline batch and
        got it back now (a policy may time the loop's lag from it)."""
        return None

    def refuse_early(self, received_ns: int) -> RTServeError | None:
        """Before a request is decoded: the refusal any request would get now, else None."""
        return None
