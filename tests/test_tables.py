"""Policies (``core/policies.py``) and backends (``rtserve.backends``) come from one table
each, and a version's offers beyond tensors from a capability lookup (no backend-specific
attribute on ``ModelVersion``).

A policy defined in this file (each request runs alone, in arrival order) is added with
one line and chosen by ``scheduling_policy:``; it serves real ONNX requests through the
Engine, and the policy the config picks is the one that ran. A backend defined in this
file (``load`` below) is added with one line too, and owns its config section: its
options reach it, the same section on another backend's model is refused naming it, and
a cold start imports its module.
"""

from __future__ import annotations

import ast
import asyncio
from collections import deque
from pathlib import Path

import numpy as np
import pytest

from rtserve import Engine, backends
from rtserve.config import ModelConfig, TensorSpec, parse_model_config
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


class Negate:
    """The runtime of the ``negate`` backend: ``y = -scale * x`` (``negate.scale``)."""

    platform = "negate"
    instance_count = 1

    def __init__(self, config: ModelConfig) -> None:
        self.inputs: tuple[TensorSpec, ...] = config.inputs or ()
        self.outputs: tuple[TensorSpec, ...] = config.outputs or ()
        self.max_batch_size = max(0, config.max_batch_size)
        self.scale = float(config.backend_options.get("scale", 1.0))

    def run(self, instance: int, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"y": feeds["x"] * np.float32(-self.scale)}

    def close(self) -> None:
        pass


def load(config: ModelConfig, version_dir: Path) -> Negate:
    """The ``negate`` backend's entry point."""
    return Negate(config)


@pytest.fixture
def negate_backend() -> object:
    backends.BACKENDS["negate"] = backends.Backend(__name__)  # the line
    yield
    del backends.BACKENDS["negate"]


NEGATE_SIGNATURE = (
    "inputs: [{name: x, datatype: FP32, shape: [2]}]\n"
    "outputs: [{name: y, datatype: FP32, shape: [2]}]\n"
)


def test_a_backend_is_one_table_line_and_owns_its_config_section(
    tmp_path: Path, negate_backend: object
) -> None:
    (tmp_path / "neg" / "1").mkdir(parents=True)
    (tmp_path / "neg" / "config.yaml").write_text(
        f"backend: negate\nmax_batch_size: 4\nnegate: {{scale: 2}}\n{NEGATE_SIGNATURE}"
    )

    async def run() -> tuple[list[list[list[float]]], str]:
        async with Engine.from_repository(tmp_path) as engine:
            xs = [np.full((1, 2), i, np.float32) for i in range(4)]
            outs = await asyncio.gather(*(engine.infer("neg", {"x": x}) for x in xs))
            return [o["y"].tolist() for o in outs], engine.metadata("neg").platform

    outs, platform = asyncio.run(run())
    assert platform == "negate"
    assert outs == [[[-2.0 * i] * 2] for i in range(4)]  # its section reached it

    # The section is the backend's: on a model of another backend it names the one to set.
    with pytest.raises(ConfigError, match="negate: options of backend negate, but the backend"):
        parse_model_config({"negate": {"scale": 2}}, "m", "m/config.yaml")
    # A cold start imports the module its line names before loading.
    assert backends.backend_of("negate").imports == (__name__,)


def test_without_its_line_a_section_is_an_unknown_field_and_lines_say_the_objectives() -> None:
    with pytest.raises(ConfigError, match="negate: unknown field"):
        parse_model_config({"negate": {"scale": 2}}, "m", "m/config.yaml")
    # llm's line says its slo: holds token objectives: handed to it with its section.
    llm = parse_model_config({"backend": "llm", "slo": {"ttft_ms": 50}}, "m", "m/config.yaml")
    assert llm.slo is None and llm.backend_options == {"slo": {"ttft_ms": 50}}
    # the ensemble's says it has no queue of its own.
    with pytest.raises(ConfigError, match="priority_levels: expected no priority_levels"):
        parse_model_config({"backend": "ensemble", "priority_levels": 2}, "m", "m/config.yaml")


def test_the_backends_table_is_plain_data_below_config_and_the_core() -> None:
    """``config.py`` and ``core/factory.py`` both read it: it imports neither (nor anything
    of rtserve), and names modules instead of importing them."""
    source = Path(backends.__file__).read_text()
    imported = [
        alias.name if isinstance(node, ast.Import) else f"{node.module}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    ]
    assert not [name for name in imported if name.startswith("rtserve")], imported
    for name, backend in backends.BACKENDS.items():
        assert (backend.runtime is None) != (backend.builder is None), name
