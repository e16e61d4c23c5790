"""FP16 weights and compute with FP32 inputs and outputs.

Meant for GPU serving (tensor cores); on CPU ONNX Runtime casts most FP16 nodes back to
float, so the file halves but the speed does not improve. It is reported on CPU anyway.
"""

from __future__ import annotations

import pathlib

from rtserve.optimize.check import load_model
from rtserve.optimize.errors import OptimizeError


def convert_fp16(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """Convert ``src`` to FP16, keeping graph inputs and outputs in FP32."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = load_model(src)
    try:
        converted = convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=True)
    except Exception as exc:
        raise OptimizeError(f"FP16 conversion of {src} failed: {exc}") from exc
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(converted, str(dst))
    return dst
