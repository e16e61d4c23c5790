"""Each variant builder produces a smaller or faster model that still agrees with FP32."""

from __future__ import annotations

import pathlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from rtserve.optimize import quantize
from rtserve.optimize.fp16 import convert_fp16
from tests.test_optimize_helpers import cnn_onnx, features, images, mlp_onnx


def _run(path: pathlib.Path, feed: dict[str, np.ndarray]) -> np.ndarray:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feed)[0]


def _ops(path: pathlib.Path) -> set[str]:
    return {n.op_type for n in onnx.load(str(path)).graph.node}


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return mlp_onnx(tmp_path_factory.mktemp("mlp") / "mlp.onnx", features=16)


@pytest.fixture(scope="module")
def cnn(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return cnn_onnx(tmp_path_factory.mktemp("cnn") / "cnn.onnx")


def test_graph_optimization_keeps_outputs(cnn: pathlib.Path, tmp_path: pathlib.Path) -> None:
    dst = quantize.optimize_graph(cnn, tmp_path / "opt.onnx", transformer=False)
    feed = {"image": images(4)}
    np.testing.assert_allclose(_run(dst, feed), _run(cnn, feed), atol=1e-4)


def test_dynamic_int8_is_per_channel_and_close(mlp: pathlib.Path, tmp_path: pathlib.Path) -> None:
    dst = quantize.quantize_dynamic_int8(mlp, tmp_path / "dyn.onnx")
    assert "DynamicQuantizeLinear" in _ops(dst) or "MatMulInteger" in _ops(dst)
    feed = {"x": features(64)}
    ref, got = _run(mlp, feed), _run(dst, feed)
    assert np.mean(ref.argmax(1) == got.argmax(1)) >= 0.9
    assert np.abs(ref - got).max() < 0.1


def test_weight_only_int8_stores_int8_weights(cnn: pathlib.Path, tmp_path: pathlib.Path) -> None:
    dst = quantize.quantize_weight_only_int8(cnn, tmp_path / "w8.onnx", min_elements=16)
    model = onnx.load(str(dst))
    int8 = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT8]
    assert len(int8) >= 3  # stem, depthwise, pointwise (and the classifier)
    assert "DequantizeLinear" in _ops(dst)
    feed = {"image": images(8)}
    np.testing.assert_allclose(_run(dst, feed), _run(cnn, feed), atol=2e-2)


@pytest.mark.parametrize("method", ["minmax", "entropy", "percentile"])
def test_static_int8_qdq_each_calibration_method(
    cnn: pathlib.Path, tmp_path: pathlib.Path, method: str
) -> None:
    calib = {"image": images(16, seed=1)}
    dst = quantize.quantize_static_int8(cnn, tmp_path / f"{method}.onnx", calib, method)
    assert {"QuantizeLinear", "DequantizeLinear"} <= _ops(dst)
    feed = {"image": images(16, seed=2)}
    ref, got = _run(cnn, feed), _run(dst, feed)
    assert np.mean((ref - got) ** 2) / np.mean(ref**2) < 0.05


def test_static_int8_unknown_method_is_rejected(cnn: pathlib.Path, tmp_path: pathlib.Path) -> None:
    from rtserve.optimize.errors import OptimizeError

    with pytest.raises(OptimizeError, match="unknown calibration method 'kl'"):
        quantize.quantize_static_int8(cnn, tmp_path / "x.onnx", {"image": images(2)}, "kl")


def test_excluded_nodes_stay_float_after_ort_optimization(
    cnn: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """An excluded node reads float tensors, so ORT cannot re-quantize its weights per tensor."""
    calib = {"image": images(16, seed=1)}
    cache = tmp_path / "calib.json"
    all_q = quantize.quantize_static_int8(cnn, tmp_path / "all.onnx", calib, cache=cache)
    names = [n.name for n in onnx.load(str(cnn)).graph.node if n.op_type in ("Conv", "Gemm")]
    none_q = quantize.quantize_static_int8(
        cnn, tmp_path / "none.onnx", None, nodes_to_exclude=names, cache=cache
    )
    feed = {"image": images(8, seed=3)}
    ref = _run(cnn, feed)
    assert np.abs(_run(none_q, feed) - ref).max() < np.abs(_run(all_q, feed) - ref).max()
    np.testing.assert_allclose(_run(none_q, feed), ref, atol=0.05)


def test_fp16_halves_size_and_keeps_fp32_io(cnn: pathlib.Path, tmp_path: pathlib.Path) -> None:
    dst = convert_fp16(cnn, tmp_path / "fp16.onnx")
    session = ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].type == "tensor(float)"
    assert session.get_outputs()[0].type == "tensor(float)"
    weights = [t for t in onnx.load(str(dst)).graph.initializer if len(t.dims) >= 2]
    assert weights and all(t.data_type == onnx.TensorProto.FLOAT16 for t in weights)
    feed = {"image": images(4)}
    np.testing.assert_allclose(session.run(None, feed)[0], _run(cnn, feed), atol=1e-2)


def test_sensitivity_ranking_lists_quantized_nodes(
    cnn: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    calib = {"image": images(16, seed=1)}
    qdq = quantize.quantize_static_int8(cnn, tmp_path / "q.onnx", calib)
    ranking = quantize.sensitivity_ranking(cnn, qdq, {"image": images(4)})
    names = [n for n, _ in ranking]
    assert any("stem" in n for n in names) and any("fc" in n for n in names)
    scores = [s for _, s in ranking]
    assert scores == sorted(scores, reverse=True)
