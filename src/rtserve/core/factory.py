"""The model factory: ``config.backend`` -> the builder of one live ``ModelVersion``.

It sits above ``model.py`` (a version served by one runtime behind the dynamic batcher)
and ``ensemble.py`` (a version that runs a DAG of other models), so neither imports the
other. The backends are one table, ``rtserve.backends.BACKENDS`` (also ``BACKENDS`` here):
adding one is one module under ``runtime/`` and one line there.
"""

from __future__ import annotations

import importlib
from functools import partial
from pathlib import Path
from typing import cast

from rtserve.backends import BACKENDS, TREE_FRAMEWORKS, Backend
from rtserve.config import ModelConfig, shown_value
from rtserve.core.model import BuildContext, Builder, ModelVersion, build_runtime_version
from rtserve.errors import ConfigError
from rtserve.runtime.base import load_runtime

__all__ = ["BACKENDS", "TREE_FRAMEWORKS", "build_version", "builder_of", "runtime_backend"]


def runtime_backend(module: str, may_inline: bool = True) -> Backend:
    """A backend served by one runtime, built by ``module``'s ``load(config, version_dir)``
    (imported when its first model loads: torch is heavy). ``may_inline=False``: its code
    may hold the GIL or block (user code, torch), so its batches never run on the event
    loop."""
    return Backend(module, may_inline=may_inline)


def builder_of(backend: Backend) -> Builder:
    """The builder of ``backend``'s versions (its module imported now)."""
    if backend.builder is not None:
        module, _, name = backend.builder.partition(":")
        return cast(Builder, getattr(importlib.import_module(module), name))
    assert backend.runtime is not None, "a backend names a runtime or a builder"
    load = partial(load_runtime, backend.runtime)
    return partial(build_runtime_version, load=load, may_inline=backend.may_inline)


async def build_version(
    config: ModelConfig, version_dir: Path, version: str, ctx: BuildContext
) -> ModelVersion:
    """Build, warm up and return one live (not yet ready) version."""
    backend = BACKENDS.get(config.backend)
    if backend is None:
        raise ConfigError(
            f"{config.source}: backend: expected one of {', '.join(BACKENDS)}, "
            f"got {shown_value(config.backend)}"
        )
    return await builder_of(backend)(config, version_dir, version, ctx)
