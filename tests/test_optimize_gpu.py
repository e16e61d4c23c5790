"""GPU paths: CUDA / TensorRT execution providers, FP16, torch.compile. Skipped without a GPU."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from rtserve.optimize.errors import OptimizeError
from rtserve.optimize.gpu import (
    CUDA,
    TENSORRT,
    available_gpu_providers,
    cuda_available,
    gpu_providers,
    gpu_session,
    ort_gpu_latency_ms,
    torch_compile_latency_ms,
)
from tests.test_optimize_helpers import TinyCNN, cnn_onnx, images

ORT_CUDA = CUDA in available_gpu_providers()
needs_ort_cuda = pytest.mark.skipif(not ORT_CUDA, reason="onnxruntime has no CUDAExecutionProvider")
needs_trt = pytest.mark.skipif(
    TENSORRT not in available_gpu_providers(), reason="onnxruntime has no TensorrtExecutionProvider"
)
needs_torch_cuda = pytest.mark.skipif(not cuda_available(), reason="torch sees no CUDA device")


def test_missing_gpu_provider_is_a_clear_error() -> None:
    if ORT_CUDA:
        pytest.skip("a CUDA provider is present")
    with pytest.raises(OptimizeError, match="CUDA execution provider is not available"):
        gpu_providers("cuda")


@pytest.mark.gpu
@needs_ort_cuda
def test_cuda_provider_runs_fp32_and_fp16(tmp_path: pathlib.Path) -> None:
    from rtserve.optimize.evaluate import open_session
    from rtserve.optimize.fp16 import convert_fp16

    model = cnn_onnx(tmp_path / "cnn.onnx")
    half = convert_fp16(model, tmp_path / "fp16.onnx")
    feed = {"image": images(4)}
    ref = open_session(model).run(None, feed)[0]
    for path, tol in ((model, 1e-3), (half, 5e-2)):
        got = gpu_session(path, "cuda").run(None, feed)[0]
        np.testing.assert_allclose(got, ref, atol=tol)
    assert ort_gpu_latency_ms(half, feed, "cuda", iterations=5) > 0


@pytest.mark.gpu
@needs_trt
def test_tensorrt_provider_runs_fp16(tmp_path: pathlib.Path) -> None:
    model = cnn_onnx(tmp_path / "cnn.onnx")
    feed = {"image": images(2)}
    session = gpu_session(model, "tensorrt", fp16=True)
    assert session.get_providers()[0] == TENSORRT
    assert session.run(None, feed)[0].shape == (2, 5)


@pytest.mark.gpu
@needs_torch_cuda
def test_torch_compile_fp16_on_cuda() -> None:
    latency = torch_compile_latency_ms(
        TinyCNN(), [images(2)], fp16=True, iterations=3, mode="default"
    )
    assert latency > 0
