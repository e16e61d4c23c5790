"""Policies come from one table (``core/policies.py``), and a version's offers beyond
tensors from a capability lookup (no backend-specific attribute on ``ModelVersion``).

A policy defined in this file (each request runs alone, in arrival order) is added with
one line and chosen by ``scheduling_policy:``; it serves real ONNX requests through the
Engine, and the policy the config picks is the one that ran.
"""

from __future__ import annotations

import asyncio
from collections import deque
from pathlib import Path

import numpy as np
import pytest

from rtserve import Engine
from rtserve.core import policies
from rtserve.core.capabilities import GENERATE
from rtserve.errors import ConfigError
from rtserve.scheduling.base import WAIT_INSTANCE, Request, SchedulingPolicy, Step
from tests.models import build_slow_repository


class OneAtATime(SchedulingPolicy):
    """Every request is its own batch, first come first served."""

    built: list[OneAtATime] = []

    def __init__(self) -> None:
        self.queue: deque[Request] = deque()
        self.batches = 0
        OneAtATime.built.append(self)

    def add(self, request: Request, timeout_s: float, priority: object) -> None:
        request.enqueued_ns = request.timings.enqueued = self.engine.clock()
        self.queue.append(request)

    def next(self, now_ns: int, instance: int) -> Step | None:
        while self.queue and self.queue[0].future.done():
            self.engine.dropped(self.queue.popleft())
        if not self.queue:
            return None
        if instance == -1:
            return WAIT_INSTANCE
        return Step([self.queue.popleft()])

    def finished(
        self,
        batch: list[Request],
        rows: int,
        instance: int,
        start_ns: int,
        end_ns: int,
        failed: bool = False,
    ) -> None:
        assert len(batch) == 1
        self.batches += 1

    @property
    def queue_depth(self) -> int:
        return len(self.queue)


@pytest.fixture
def one_at_a_time() -> object:
    saved = dict(policies.POLICIES)
    policies.POLICIES["one_at_a_time"] = policies.Policy(lambda given: OneAtATime())  # the line
    OneAtATime.built.clear()
    yield
    policies.POLICIES.clear()
    policies.POLICIES.update(saved)


def _repo(tmp_path: Path, extra: str) -> Path:
    root = build_slow_repository(tmp_path, max_queue_size=64, delay_us=0)
    config = root / "slow" / "config.yaml"
    config.write_text(config.read_text() + extra)
    return root


def test_a_policy_is_one_table_line_and_serves_through_the_engine(
    tmp_path: Path, one_at_a_time: object
) -> None:
    root = _repo(tmp_path, "scheduling_policy: one_at_a_time\n")

    async def run() -> list[np.ndarray]:
        async with Engine.from_repository(root) as engine:
            xs = [np.full((1, 4), i, dtype=np.float32) for i in range(6)]
            outs = await asyncio.gather(*(engine.infer("slow", {"x": x}) for x in xs))
            return [o["y"] for o in outs]

    outs = asyncio.run(run())
    assert [o.tolist() for o in outs] == [[[3.0 * i] * 4] for i in range(6)]
    (policy,) = OneAtATime.built
    assert policy.batches == 6  # each request alone


def test_an_unknown_policy_name_is_refused_naming_the_field_and_the_choices(
    tmp_path: Path,
) -> None:
    root = _repo(tmp_path, "scheduling_policy: fastest\n")

    async def run() -> str:
        async with Engine.from_repository(root) as engine:
            (status,) = engine.models()
            return status.reason

    reason = asyncio.run(run())
    assert "scheduling_policy: expected one of window, slo, got 'fastest'" in reason, reason


def test_without_a_name_the_config_sections_pick_the_policy() -> None:
    from rtserve.config import parse_model_config

    plain = parse_model_config({"max_batch_size": 4}, "m", "m/config.yaml")
    slo = parse_model_config({"max_batch_size": 4, "slo": {"p99_ms": 5}}, "m", "m/config.yaml")
    assert policies.policy_name(plain) == "window"
    assert policies.policy_name(slo) == "slo"
    with pytest.raises(ConfigError, match="scheduling_policy: expected a string"):
        parse_model_config({"scheduling_policy": 3}, "m", "m/config.yaml")


def test_a_tensor_model_offers_no_generation(tmp_path: Path) -> None:
    root = _repo(tmp_path, "")

    async def run() -> object:
        async with Engine.from_repository(root) as engine:
            mv = engine.registry.get("slow")
            assert not hasattr(mv, "llm")
            return mv.capability(GENERATE)

    assert asyncio.run(run()) is None
