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


def load_runtime(module_name: str, config: ModelConfig, version_dir: Path) -> Runtime:
    """Build the runtime of one model version with the backend module's ``load`` (blocking:
    run it off the event loop). The module is imported here, when its first model loads:
    a server without torch models never imports torch (``core/factory.py`` names them)."""
    module = importlib.import_module(module_name)
    runtime: Runtime = module.load(config, version_dir)
    return runtime
