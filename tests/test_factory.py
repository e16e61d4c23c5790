"""The model factory (``core/factory.py``): one table keyed by ``config.backend``.

A backend is one module with ``load(config, version_dir) -> Runtime`` plus one line in
``BACKENDS``; this file is such a module (an ``echo`` backend that scales its input by
the ``echo.factor`` option) and serves a model through it, batching included.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from rtserve import Engine
from rtserve.config import ModelConfig, TensorSpec
from rtserve.core import factory
from tests.models import build_scale

SIGNATURE = "inputs: [{name: x, datatype: FP32, shape: [2]}]\n" + (
    "outputs: [{name: y, datatype: FP32, shape: [2]}]\n"
)


class EchoRuntime:
    """``y = factor * x``; counts the batches it runs."""

    platform = "echo"
    instance_count = 1

    def __init__(self, config: ModelConfig) -> None:
        self.inputs: tuple[TensorSpec, ...] = config.inputs or ()
        self.outputs: tuple[TensorSpec, ...] = config.outputs or ()
        self.max_batch_size = max(0, config.max_batch_size)
        self.factor = float(config.backend_options.get("factor", 1.0))

    def run(self, instance: int, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"y": feeds["x"] * np.float32(self.factor)}

    def close(self) -> None:
        pass


def load(config: ModelConfig, version_dir: Path) -> EchoRuntime:
    """The backend entry point, as ``runtime/onnx.py`` and the others have one."""
    return EchoRuntime(config)


@pytest.fixture
def echo_backend() -> Iterator[None]:
    factory.BACKENDS["echo"] = factory.runtime_backend(__name__)  # the one line
    try:
        yield
    finally:
        del factory.BACKENDS["echo"]


def _model(root: Path, name: str, config: str) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.yaml").write_text(config)


def test_a_backend_is_one_module_and_one_line(echo_backend: None, tmp_path: Path) -> None:
    _model(
        tmp_path,
        "echo",
        "backend: echo\nmax_batch_size: 8\ndynamic_batching: {max_queue_delay_us: 20000}\n"
        f"echo: {{factor: 3}}\n{SIGNATURE}",
    )

    async def run() -> tuple[list[dict[str, np.ndarray]], str]:
        async with Engine.from_repository(tmp_path) as engine:
            rows = [np.full((1, 2), i, np.float32) for i in range(8)]
            outs = await asyncio.gather(*(engine.infer("echo", {"x": r}) for r in rows))
            return outs, engine.metadata("echo").platform

    outs, platform = asyncio.run(run())
    assert platform == "echo"
    assert [o["y"].tolist() for o in outs] == [[[3.0 * i] * 2] for i in range(8)]


def test_an_unknown_backend_is_named_with_the_choices(tmp_path: Path) -> None:
    _model(tmp_path, "typo", f"backend: onnx\nmax_batch_size: 4\n{SIGNATURE}")
    build_scale(tmp_path / "scale" / "1" / "model.onnx", 2.0)
    (tmp_path / "scale" / "config.yaml").write_text("max_batch_size: 4\n")

    async def run() -> dict[str, tuple[str, str]]:
        async with Engine.from_repository(tmp_path, strict_readiness=False) as engine:
            return {m.name: (m.state, m.reason) for m in engine.models()}

    models = asyncio.run(run())
    assert models["scale"][0] == "READY"
    state, reason = models["typo"]
    assert state == "UNAVAILABLE"
    assert reason.endswith(
        "typo/config.yaml: backend: expected one of onnxruntime, python, torch, litert, "
        "ensemble, llm, xgboost, lightgbm, catboost, sklearn, got 'onnx'"
    ), reason
