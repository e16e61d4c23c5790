"""The one table of backends: ``config.backend`` -> what builds its versions, which part of
config.yaml is its own, what a cold start imports first.

Plain data below the core, so that ``config.py`` (which reads each backend's section) and
``core/factory.py`` (which builds versions) read the same table without importing each
other; modules are named, not imported (a server without torch models never imports
torch). Adding a backend is one module and one line here::

    "<name>": Backend("rtserve.runtime.<name>"),

Its options are then the ``<name>:`` section of a model's config.yaml
(``ModelConfig.backend_options``, validated by the module when it loads), and the same
section on a model of another backend is refused naming the backend to set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

TREE_FRAMEWORKS = ("xgboost", "lightgbm", "catboost", "sklearn")  # runtime/trees.py FRAMEWORKS

# What the backend's versions are held to: "requests" (a latency objective ``slo:`` and
# ``priority_levels``, read by config.py), "tokens" (``slo:`` holds token objectives, handed
# to the backend with its section) or "none" (no queue of its own: an ensemble's steps
# have them).
Objectives = Literal["requests", "tokens", "none"]


@dataclass(frozen=True, slots=True)
class Backend:
    """``runtime``: the module whose ``load(config, version_dir) -> Runtime`` a version
    runs behind the dynamic batcher; ``builder``: instead, ``"module:function"``, a builder
    of its own (``core.model.Builder``). ``may_inline=False``: its code may hold the GIL or
    block (user code, torch), so its batches never run on the event loop. ``section``: its
    options are the ``<name>:`` section. ``cold_start``: the modules a cold start imports
    before loading (``rtserve.coldstart``'s backend_import phase)."""

    runtime: str | None = None
    may_inline: bool = True
    builder: str | None = None
    section: bool = True
    objectives: Objectives = "requests"
    cold_start: tuple[str, ...] | None = None

    @property
    def imports(self) -> tuple[str, ...]:
        """The modules a cold start imports first: ``cold_start``, else the runtime's."""
        if self.cold_start is not None:
            return self.cold_start
        return (self.runtime,) if self.runtime is not None else ()


BACKENDS: dict[str, Backend] = {
    # (``onnxruntime:`` holds session options config.py reads for every model)
    "onnxruntime": Backend("rtserve.runtime.onnx", section=False),
    "python": Backend("rtserve.runtime.python", may_inline=False),
    "torch": Backend("rtserve.runtime.torch", may_inline=False),
    "litert": Backend("rtserve.runtime.litert"),
    "ensemble": Backend(
        builder="rtserve.core.ensemble:build_ensemble_version", section=False, objectives="none"
    ),
    "llm": Backend(builder="rtserve.core.llm_version:build_llm_version", objectives="tokens"),
    # Tree and scikit-learn models from their own files (runtime/trees.py).
    **{name: Backend("rtserve.runtime.trees", cold_start=()) for name in TREE_FRAMEWORKS},
}

# A backend not in the table (yet: one may be added after a config was read) reads its
# ``<name>:`` section as the others do.
UNLISTED = Backend()


def backend_of(name: str) -> Backend:
    return BACKENDS.get(name, UNLISTED)
