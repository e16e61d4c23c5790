"""The runtime interface every backend implements."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from rtserve.config import ModelConfig, TensorSpec


class Runtime(Protocol):
    """A loaded model version with ``instance_count`` independent execution instances.

    ``inputs``/``outputs`` are the resolved signature: per-row shapes (no batch dimension)
    when the model batches, full shapes otherwise.
    """

    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    instance_count: int
    max_batch_size: int  # resolved: the config's, or detected from the model when unset

    def run(self, instance: int, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch on one instance; thread-safe across different instances."""
        ...

    def close(self) -> None: ...


def load_runtime(config: ModelConfig, version_dir: Path) -> Runtime:
    if config.backend == "onnxruntime":
        from rtserve.runtime.onnx import OnnxRuntimeModel

        return OnnxRuntimeModel.load(config, version_dir)
    raise ValueError(f"unknown backend {config.backend!r}")
