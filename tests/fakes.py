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
