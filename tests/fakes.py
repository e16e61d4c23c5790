"""Small stand-ins for unit tests of the batcher and the dataplane: a runtime that records
what it ran (a real function, not a mock of anything users run) and a clock tests move."""

from __future__ import annotations

import threading

import numpy as np

from rtserve.config import TensorSpec


class FakeClock:
    def __init__(self, start_ns: int = 1_000_000_000) -> None:
        self.ns = start_ns

    def __call__(self) -> int:
        return self.ns

    def advance_ms(self, ms: float) -> None:
        self.ns += int(ms * 1_000_000)


class DoublingRuntime:
    """y = 2 * x on FP32 rows of width ``width``; records each batch's row count."""

    platform = "test"

    def __init__(
        self, width: int = 4, instance_count: int = 1, max_batch_size: int = 8, ragged: bool = False
    ) -> None:
        shape = (-1,) if ragged else (width,)
        self.inputs = (TensorSpec("x", "FP32", shape),)
        self.outputs = (TensorSpec("y", "FP32", shape),)
        self.instance_count = instance_count
        self.max_batch_size = max_batch_size
        self.batches: list[int] = []
        self.fail_next: Exception | None = None
        self.fail_negative = False
        self.gate: threading.Event | None = None  # set: run() blocks until it is set
        self.closed = False

    def run(self, instance: int, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.gate is not None:
            self.gate.wait(5)
        x = feeds["x"]
        self.batches.append(int(x.shape[0]))
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        if self.fail_negative and (x < 0).any():  # one request's data fails its batch
            raise ValueError("/secret/path: a negative row")
        return {"y": x * 2}

    def close(self) -> None:
        self.closed = True


def run_async(fn):  # type: ignore[no-untyped-def]
    """Run an ``async def`` test on a fresh event loop (no plugin needed)."""
    import asyncio
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        return asyncio.run(fn(*args, **kwargs))

    return wrapper


class FakeEngine:
    """What a scheduling policy sees of its batcher (``scheduling.base.BatcherView``), for
    testing a policy alone: a clock tests move, free instances tests set, and a record of
    the requests dropped and the batches run from the policy (``run_now``)."""

    def __init__(self, clock: FakeClock, inline: bool = True, instances: int = 1) -> None:
        import asyncio

        from rtserve.observability.metrics import SchedulerStats

        self.name = "m:1"
        self.inline = inline
        self.instance_count = instances
        self.free = list(range(instances))
        self.closing = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stats = SchedulerStats()
        self.clock = clock
        self.dropped_requests: list = []
        self.ran: list[list] = []

    def dropped(self, request) -> None:  # type: ignore[no-untyped-def]
        self.dropped_requests.append(request)

    def run_now(self, batch) -> None:  # type: ignore[no-untyped-def]
        self.ran.append(batch)
        for request in batch:
            request.future.set_result({"rows": request.rows})


def add_request(  # type: ignore[no-untyped-def]
    policy,
    rows: int = 1,
    timings=None,
    timeout_s: float = 0.0,
    priority: object = None,
    shape_key: object = None,
):
    """What ``Batcher.submit`` does around a policy: make the request, have the policy
    admit it (or raise), then give it its future (a running event loop is needed)."""
    import asyncio

    from rtserve.protocol.types import Timings
    from rtserve.scheduling.base import Request

    request = Request({}, rows, timings if timings is not None else Timings(), shape_key)
    policy.add(request, timeout_s, priority)
    request.future = asyncio.get_running_loop().create_future()
    return request
