"""A circuit breaker: decides whether to call a dependency; knows nothing of Redis.

closed --(``failure_threshold`` consecutive failures)--> open
open --(``cooldown_s`` elapsed: the caller runs one probe)--> half-open
half-open --(probe succeeds)--> closed;  half-open --(probe fails)--> open (cool-down restarts)

While open or half-open, :meth:`allow` is False: requests skip the dependency and only the
probe touches it.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    __slots__ = ("failure_threshold", "cooldown_s", "state", "_failures", "_opened_at", "_clock")

    def __init__(
        self,
        failure_threshold: int,
        cooldown_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._clock = clock

    def allow(self) -> bool:
        """May a request use the dependency now?"""
        return self.state is BreakerState.CLOSED

    def probe_due(self) -> bool:
        """True once per cool-down while open: the caller should probe, then report."""
        if self.state is BreakerState.OPEN and self._clock() - self._opened_at >= self.cooldown_s:
            self.state = BreakerState.HALF_OPEN
            return True
        return False

    def record_success(self) -> None:
        self.state = BreakerState.CLOSED
        self._failures = 0

    def record_failure(self) -> bool:
        """Count a failure; True when this one opened the breaker."""
        if self.state is BreakerState.CLOSED:
            self._failures += 1
            if self._failures < self.failure_threshold:
                return False
        elif self.state is BreakerState.OPEN:
            return False
        self.state = BreakerState.OPEN
        self._opened_at = self._clock()
        self._failures = 0
        return True
