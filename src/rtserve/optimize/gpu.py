"""GPU paths: CUDA and TensorRT execution providers, FP16, torch.compile.

Nothing here runs on a machine without a GPU: :func:`cuda_available` and
:func:`available_gpu_providers` say what can run, and the callers skip the rest.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rtserve.optimize.errors import OptimizeError

if TYPE_CHECKING:
    import torch

CUDA = "CUDAExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"


def available_gpu_providers() -> list[str]:
    """The GPU execution providers this onnxruntime build offers (TensorRT first)."""
    import onnxruntime as ort

    have = set(ort.get_available_providers())
    return [p for p in (TENSORRT, CUDA) if p in have]


def cuda_available() -> bool:
    """torch can see a CUDA device."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def gpu_providers(
    kind: str = "cuda", fp16: bool = True, cache_dir: pathlib.Path | None = None
) -> list[Any]:
    """Provider list for an InferenceSession: TensorRT (with CUDA and CPU behind) or CUDA.

    TensorRT builds an engine on first run (slow); ``cache_dir`` keeps it between runs.
    """
    have = available_gpu_providers()
    if kind == "tensorrt":
        if TENSORRT not in have:
            raise OptimizeError(
                f"TensorRT execution provider is not available (have: {have or 'no GPU provider'})"
            )
        options: dict[str, Any] = {"trt_fp16_enable": fp16}
        if cache_dir is not None:
            cache_dir.mkdir(parents=True, exist_ok=True)
            options.update(
                {"trt_engine_cache_enable": True, "trt_engine_cache_path": str(cache_dir)}
            )
        return [(TENSORRT, options), CUDA, "CPUExecutionProvider"]
    if kind == "cuda":
        if CUDA not in have:
            raise OptimizeError(
                f"CUDA execution provider is not available (have: {have or 'no GPU provider'})"
            )
        return [CUDA, "CPUExecutionProvider"]
    raise OptimizeError(f"unknown GPU provider kind {kind!r} (cuda or tensorrt)")


def gpu_session(path: pathlib.Path, kind: str = "cuda", fp16: bool = True) -> Any:
    """An InferenceSession on the GPU; raises if ORT silently fell back to the CPU."""
    from rtserve.optimize.evaluate import open_session

    session = open_session(path, providers=gpu_providers(kind, fp16))  # type: ignore[arg-type]
    used = session.get_providers()
    if used[0] not in (CUDA, TENSORRT):
        raise OptimizeError(f"{path}: ONNX Runtime placed the model on {used[0]}, not the GPU")
    return session


def ort_gpu_latency_ms(
    path: pathlib.Path, feed: Mapping[str, np.ndarray], kind: str = "cuda", iterations: int = 50
) -> float:
    """Median latency of ``feed`` on the GPU provider, after warm-up."""
    session = gpu_session(path, kind)
    for _ in range(5):
        session.run(None, dict(feed))
    times = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        session.run(None, dict(feed))
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def torch_compile_latency_ms(
    model: torch.nn.Module,
    inputs: Sequence[np.ndarray],
    fp16: bool = True,
    iterations: int = 50,
    mode: str = "max-autotune-no-cudagraphs",
) -> float:
    """Median latency of ``torch.compile(model)`` on CUDA (FP16 autocast if ``fp16``)."""
    import torch

    if not torch.cuda.is_available():
        raise OptimizeError("torch.compile on GPU needs CUDA, and torch sees no CUDA device")
    device = torch.device("cuda")
    compiled = torch.compile(model.to(device).eval(), mode=mode)
    args = [torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in inputs]
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16, enabled=fp16):
        for _ in range(3):
            compiled(*args)
        torch.cuda.synchronize()
        times = []
        for _ in range(iterations):
            t0 = time.perf_counter()
            compiled(*args)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)
