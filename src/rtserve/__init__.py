"""rtserve: a real-time ML inference server and model-optimization toolkit."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Engine", "SyncEngine", "__version__"]

if TYPE_CHECKING:
    from rtserve.engine import Engine, SyncEngine


def __getattr__(name: str) -> Any:
    """``Engine`` is imported on first use: ``import rtserve`` stays light (the CLI)."""
    if name in ("Engine", "SyncEngine"):
        from rtserve import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'rtserve' has no attribute {name!r}")
