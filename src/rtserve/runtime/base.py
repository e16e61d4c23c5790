"""The runtime interface every backend implements."""

from __future__ import annotations

import importlib
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


# config.backend -> the module whose ``load(config, version_dir)`` builds its runtime.
# Adding a backend is one module under runtime/ and one line here.
BACKEND_MODULES = {
    "onnxruntime": "rtserve.runtime.onnx",
    "python": "rtserve.runtime.python",
    "torch": "rtserve.runtime.torch",
}


def load_runtime(config: ModelConfig, version_dir: Path) -> Runtime:
    """Build the runtime of one model version (blocking: run it off the event loop)."""
    module_name = BACKEND_MODULES.get(config.backend)
    if module_name is None:
        raise ValueError(f"unknown backend {config.backend!r}")
    module = importlib.import_module(module_name)
    runtime: Runtime = module.load(config, version_dir)
    return runtime
