"""Model backends behind one small interface: load, warmup, run(batch)."""

from rtserve.runtime.base import Runtime, load_runtime

__all__ = ["Runtime", "load_runtime"]
