"""The model factory: ``config.backend`` -> the builder of one live ``ModelVersion``.

It sits above ``model.py`` (a version served by one runtime behind the dynamic batcher)
and ``ensemble.py`` (a version that runs a DAG of other models), so neither imports the
other. Adding a backend is one module under ``runtime/`` and one line in ``BACKENDS``.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from rtserve.config import ModelConfig, shown_value
from rtserve.core.ensemble import build_ensemble_version
from rtserve.core.llm_version import build_llm_version
from rtserve.core.model import BuildContext, Builder, ModelVersion, build_runtime_version
from rtserve.errors import ConfigError
from rtserve.runtime.base import load_runtime

TREE_FRAMEWORKS = ("xgboost", "lightgbm", "catboost", "sklearn")  # runtime/trees.py FRAMEWORKS


def runtime_backend(module: str, may_inline: bool = True) -> Builder:
    """A backend served by one runtime, built by ``module``'s ``load(config, version_dir)``
    (imported when its first model loads: torch is heavy). ``may_inline=False``: its code
    may hold the GIL or block (user code, torch), so its batches never run on the event
    loop."""
    load = partial(load_runtime, module)
    return partial(build_runtime_version, load=load, may_inline=may_inline)


BACKENDS: dict[str, Builder] = {
    "onnxruntime": runtime_backend("rtserve.runtime.onnx"),
    "python": runtime_backend("rtserve.runtime.python", may_inline=False),
    "torch": runtime_backend("rtserve.runtime.torch", may_inline=False),
    "litert": runtime_backend("rtserve.runtime.litert"),
    "ensemble": build_ensemble_version,
    "llm": build_llm_version,
    # Tree and scikit-learn models from their own files (runtime/trees.py).
    **{name: runtime_backend("rtserve.runtime.trees") for name in TREE_FRAMEWORKS},
}


async def build_version(
    config: ModelConfig, version_dir: Path, version: str, ctx: BuildContext
) -> ModelVersion:
    """Build, warm up and return one live (not yet ready) version."""
    builder = BACKENDS.get(config.backend)
    if builder is None:
        raise ConfigError(
            f"{config.source}: backend: expected one of {', '.join(BACKENDS)}, "
            f"got {shown_value(config.backend)}"
        )
    return await builder(config, version_dir, version, ctx)
