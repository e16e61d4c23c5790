"""Model optimization: export, quantize, FP16, prune and distill, measured on this machine.

Entry points: ``rtserve export`` / ``rtserve optimize`` (:mod:`rtserve.optimize.cli`),
:func:`rtserve.optimize.pipeline.run_optimize` from Python, and
``python -m rtserve.optimize.showcase`` for ``docs/optimization.md``. Heavy dependencies
(torch, onnxruntime) are imported by the modules that need them, not here.
"""

from rtserve.optimize.errors import OptimizeError

__all__ = ["OptimizeError"]
