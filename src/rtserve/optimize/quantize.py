"""Graph optimization and INT8 quantization of ONNX files with ONNX Runtime's tools.

- :func:`optimize_graph`: offline ORT graph optimization, plus the transformer fusions
  (attention, layer norm, GELU) for BERT-like models;
- :func:`quantize_dynamic_int8`: weights int8 per channel, activations quantized at run time;
- :func:`quantize_weight_only_int8`: weights stored int8 per channel behind DequantizeLinear,
  compute stays float (smaller file, same math);
- :func:`quantize_static_int8`: QDQ with calibrated activation ranges (MinMax / Entropy /
  Percentile), per channel, with a node exclusion list for the fallback loop.
"""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from rtserve.optimize.check import load_model
from rtserve.optimize.errors import OptimizeError

CALIBRATION_METHODS = ("minmax", "entropy", "percentile")

# Operators that take int8 weights worth storing quantized.
_WEIGHT_OPS = {"MatMul": 1, "Gemm": 1, "Conv": 1}


def is_transformer(path: pathlib.Path) -> bool:
    """BERT-like: integer token inputs and attention-shaped Softmax/MatMul blocks."""
    model = load_model(path)
    names = {i.name for i in model.graph.input}
    ops = {n.op_type for n in model.graph.node}
    return bool({"input_ids", "attention_mask"} & names) and "Softmax" in ops and "MatMul" in ops


def optimize_graph(
    src: pathlib.Path, dst: pathlib.Path, transformer: bool | None = None
) -> pathlib.Path:
    """Write the offline-optimized graph of ``src`` to ``dst``.

    Transformers go through ``onnxruntime.transformers.optimizer`` (fused Attention,
    SkipLayerNormalization, BiasGelu); other models through ORT's extended level, which
    is portable across CPUs (the 'all' level adds layout changes tied to this machine,
    and those are applied again when the server loads the file).
    """
    import onnxruntime as ort

    from rtserve.optimize.evaluate import open_session

    dst.parent.mkdir(parents=True, exist_ok=True)
    if transformer is None:
        transformer = is_transformer(src)
    if transformer:
        from onnxruntime.transformers.optimizer import optimize_model

        logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)
        optimized = optimize_model(str(src), model_type="bert", num_heads=0, hidden_size=0)
        optimized.save_model_to_file(str(dst))
        return dst
    open_session(
        src,
        threads=1,
        graph_optimization=ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        optimized_model_path=dst,
    )
    return dst


def quantize_dynamic_int8(
    src: pathlib.Path, dst: pathlib.Path, per_channel: bool = True
) -> pathlib.Path:
    """INT8 dynamic quantization (weights int8, activations per batch at run time)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        quantize_dynamic(
            str(src),
            str(dst),
            per_channel=per_channel,
            weight_type=QuantType.QInt8,
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
        )
    except Exception as exc:
        raise OptimizeError(f"dynamic INT8 quantization of {src} failed: {exc}") from exc
    return dst


def _quantize_weight(w: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per channel along ``axis``: (int8 values, float32 scales)."""
    moved = np.moveaxis(w, axis, 0).reshape(w.shape[axis], -1)
    scale = np.abs(moved).max(axis=1) / 127.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    shape = [1] * w.ndim
    shape[axis] = -1
    q = np.clip(np.round(w / scale.reshape(shape)), -127, 127).astype(np.int8)
    return q, scale


def quantize_weight_only_int8(
    src: pathlib.Path, dst: pathlib.Path, min_elements: int = 256
) -> pathlib.Path:
    """Store MatMul / Gemm / Conv weights as int8 per channel behind DequantizeLinear.

    Activations stay float, so accuracy is nearly untouched and the file is about 4x
    smaller; speed is that of the float model plus the dequantization.
    """
    import onnx
    from onnx import helper, numpy_helper

    model = load_model(src)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 13:
        raise OptimizeError(
            f"{src}: weight-only INT8 needs opset >= 13 (per-axis DequantizeLinear), got {opset}"
        )
    inits = {t.name: t for t in model.graph.initializer}
    consumers: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers[name] = consumers.get(name, 0) + 1
    new_nodes = []
    replaced: set[str] = set()
    for node in model.graph.node:
        if node.op_type in _WEIGHT_OPS and len(node.input) > 1:
            wname = node.input[1]
            t = inits.get(wname)
            if (
                t is not None
                and wname not in replaced
                and consumers.get(wname, 0) == 1
                and t.data_type == onnx.TensorProto.FLOAT
            ):
                w = numpy_helper.to_array(t)
                if w.ndim >= 2 and w.size >= min_elements:
                    if node.op_type == "Conv":
                        axis = 0
                    elif node.op_type == "Gemm":
                        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
                        axis = 0 if trans_b else 1
                    else:
                        axis = w.ndim - 1
                    q, scale = _quantize_weight(w, axis)
                    qname, sname = wname + "_int8", wname + "_scale"
                    model.graph.initializer.remove(t)
                    model.graph.initializer.extend(
                        [numpy_helper.from_array(q, qname), numpy_helper.from_array(scale, sname)]
                    )
                    new_nodes.append(
                        helper.make_node(
                            "DequantizeLinear",
                            [qname, sname],
                            [wname],
                            name=f"{node.name or wname}_weight_dq",
                            axis=axis,
                        )
                    )
                    replaced.add(wname)
        new_nodes.append(node)
    if not replaced:
        raise OptimizeError(f"{src}: no MatMul / Gemm / Conv weight to quantize")
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(dst))
    return dst


class _Reader:
    """A CalibrationDataReader over arrays by input name, ``batch`` rows at a time."""

    def __init__(self, data: Mapping[str, np.ndarray], batch: int = 8) -> None:
        self._data = data
        self._batch = batch
        self._pos = 0
        self._rows = len(next(iter(data.values())))

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._pos >= self._rows:
            return None
        feed = {k: v[self._pos : self._pos + self._batch] for k, v in self._data.items()}
        self._pos += self._batch
        return feed

    def rewind(self) -> None:
        self._pos = 0


def prepare_for_static(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """``quant_pre_process`` (shape inference, BN folding); falls back to a copy if it fails."""
    import shutil

    from onnxruntime.quantization.shape_inference import quant_pre_process

    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        quant_pre_process(str(src), str(dst), skip_symbolic_shape=False)
    except Exception:
        try:
            quant_pre_process(str(src), str(dst), skip_symbolic_shape=True)
        except Exception:
            shutil.copyfile(src, dst)
    return dst


def quantize_static_int8(
    src: pathlib.Path,
    dst: pathlib.Path,
    calibration: Mapping[str, np.ndarray] | None,
    method: str = "minmax",
    per_channel: bool = True,
    nodes_to_exclude: Iterable[str] = (),
    op_types: Sequence[str] | None = None,
    cache: pathlib.Path | None = None,
    calibration_batch: int = 8,
) -> pathlib.Path:
    """Static QDQ INT8: uint8 activations with calibrated ranges, int8 weights.

    With ``cache`` the calibration ranges are computed once and reused, so the fallback
    loop can re-quantize with different exclusions at little cost.
    """
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    methods = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }
    if method not in methods:
        raise OptimizeError(
            f"unknown calibration method {method!r}; choose one of {', '.join(methods)}"
        )
    extra: dict[str, Any] = {"CalibMovingAverage": False}
    if method == "percentile":
        extra["CalibPercentile"] = 99.999
    if method == "entropy":
        extra["CalibNumBins"] = 2048
    reader = _Reader(calibration, calibration_batch) if calibration is not None else None
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        quantize_static(
            str(src),
            str(dst),
            reader,
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=list(op_types) if op_types else None,
            per_channel=per_channel,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            nodes_to_exclude=list(nodes_to_exclude),
            calibrate_method=methods[method],
            extra_options=extra,
            calibration_cache_path=str(cache) if cache is not None else None,
        )
    except OptimizeError:
        raise
    except Exception as exc:
        raise OptimizeError(f"static INT8 quantization of {src} ({method}) failed: {exc}") from exc
    return dst


def _fake_quant_error(x: np.ndarray, scale: float, zero_point: int, qmin: int, qmax: int) -> float:
    q = np.clip(np.round(x / scale) + zero_point, qmin, qmax)
    deq = (q - zero_point) * scale
    signal = float(np.mean(x.astype(np.float64) ** 2)) or 1e-12
    return float(np.mean((x - deq) ** 2) / signal)


def sensitivity_ranking(
    float_model: pathlib.Path,
    qdq_model: pathlib.Path,
    sample: Mapping[str, np.ndarray],
) -> list[tuple[str, float]]:
    """Quantized float nodes, most sensitive first, by their local quantization noise.

    For each node of the float graph that the QDQ graph quantized, the noise is the
    relative mean squared error of fake-quantizing its activation inputs (with the
    calibrated scales, on float activations of ``sample``) plus that of its weights.
    Local noise does not pile up along the graph, so early and late layers compare fairly.
    """
    import onnx
    from onnx import numpy_helper

    from rtserve.optimize.evaluate import open_session

    qdq = load_model(qdq_model)
    inits = {t.name: numpy_helper.to_array(t) for t in qdq.graph.initializer}
    producer = {o: n for n in qdq.graph.node for o in n.output}

    # tensor (float name) -> (scale, zp, qmin, qmax) for activations quantized by Q nodes
    act_q: dict[str, tuple[float, int, int, int]] = {}
    for n in qdq.graph.node:
        if n.op_type == "QuantizeLinear" and n.input[0] not in inits:
            scale = inits.get(n.input[1])
            zp = inits.get(n.input[2]) if len(n.input) > 2 else None
            if scale is None or scale.size != 1:
                continue
            zpv = int(zp.reshape(-1)[0]) if zp is not None else 0
            lo, hi = (0, 255) if zp is not None and zp.dtype == np.uint8 else (-128, 127)
            act_q[n.input[0]] = (float(scale.reshape(-1)[0]), zpv, lo, hi)

    # float nodes fed through DequantizeLinear: their activation inputs and weight error
    node_inputs: dict[str, list[str]] = {}
    node_weight_err: dict[str, float] = {}
    for n in qdq.graph.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear") or not n.name:
            continue
        for inp in n.input:
            dq = producer.get(inp)
            if dq is None or dq.op_type != "DequantizeLinear":
                continue
            src = dq.input[0]
            if src in inits:  # quantized weight
                w_q = inits[src].astype(np.float64)
                scale = inits[dq.input[1]].astype(np.float64)
                axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
                if scale.size > 1:
                    shape = [1] * w_q.ndim
                    shape[axis] = -1
                    scale = scale.reshape(shape)
                # the float weight is gone from the QDQ graph; estimate rounding noise
                w = w_q * scale
                noise = float(np.mean((scale**2) / 12.0 * np.ones_like(w)))
                node_weight_err[n.name] = noise / (float(np.mean(w**2)) or 1e-12)
            else:
                q = producer.get(src)
                if q is not None and q.op_type == "QuantizeLinear":
                    node_inputs.setdefault(n.name, []).append(q.input[0])
    wanted = sorted({t for ts in node_inputs.values() for t in ts if t in act_q})
    float_proto = load_model(float_model)
    graph_outputs = {o.name for o in float_proto.graph.output}
    graph_inputs = {i.name for i in float_proto.graph.input}
    for t in wanted:
        if t not in graph_outputs and t not in graph_inputs:
            float_proto.graph.output.append(onnx.ValueInfoProto(name=t))
    import onnxruntime as ort

    session = open_session(
        float_proto.SerializeToString(),
        threads=2,
        graph_optimization=ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    )
    out_names = [o.name for o in session.get_outputs()]
    values = dict(zip(out_names, session.run(None, dict(sample)), strict=True))
    values.update({k: v for k, v in sample.items()})
    ranking = []
    for name in set(node_inputs) | set(node_weight_err):
        err = node_weight_err.get(name, 0.0)
        for t in node_inputs.get(name, []):
            if t in act_q and t in values:
                err += _fake_quant_error(values[t], *act_q[t])
        ranking.append((name, err))
    ranking.sort(key=lambda kv: kv[1], reverse=True)
    return ranking
