"""Model optimization: export, quantize, FP16, prune and distill, measured on this machine.

Entry points: ``rtserve export`` / ``rtserve optimize`` (:mod:`rtserve.optimize.cli`) and
:func:`rtserve.optimize.pipeline.run_optimize` from Python. The report in
``docs/optimization.md`` is made by ``python -m bench.showcase`` in the repository, not by
this package. Heavy dependencies (torch, onnxruntime) are imported by the modules that
need them, not here.
"""

from rtserve.optimize.errors import OptimizeError

__all__ = ["OptimizeError"]
