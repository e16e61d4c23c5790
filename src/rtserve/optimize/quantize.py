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
    src: pathlib.Path,
    dst: pathlib.Path,
    transformer: bool | None = None,
    num_heads: int = 0,
    hidden_size: int = 0,
) -> pathlib.Path:
    """Write the offline-optimized graph of ``src`` to ``dst``.

    Transformers go through ``onnxruntime.transformers.optimizer`` (fused Attention,
    SkipLayerNormalization, BiasGelu); other models through ORT's extended level, which
    is portable across CPUs (the 'all' level adds layout changes tied to this machine,
    and those are applied again when the server loads the file). ``num_heads`` and
    ``hidden_size`` (0: detect) help the attention fusion when detection fails.
    """
    import onnxruntime as ort

    from rtserve.optimize.evaluate import open_session

    dst.parent.mkdir(parents=True, exist_ok=True)
    if transformer is None:
        transformer = is_transformer(src)
    if transformer:
        from onnxruntime.transformers.optimizer import optimize_model

        logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)
        optimized = optimize_model(
            str(src), model_type="bert", num_heads=num_heads, hidden_size=hidden_size
        )
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
    nodes_to_quantize: Sequence[str] | None = None,
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
    # Keep Clip/Relu: once removed, a consumer later kept in float would see unclipped values.
    extra: dict[str, Any] = {"CalibMovingAverage": False, "QDQKeepRemovableActivations": True}
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
            nodes_to_quantize=list(nodes_to_quantize) if nodes_to_quantize else None,
            calibrate_method=methods[method],
            extra_options=extra,
            calibration_cache_path=str(cache) if cache is not None else None,
        )
    except OptimizeError:
        raise
    except Exception as exc:
        raise OptimizeError(f"static INT8 quantization of {src} ({method}) failed: {exc}") from exc
    excluded = set(nodes_to_exclude)
    if excluded:
        _feed_float(dst, excluded)
    return dst


def _feed_float(path: pathlib.Path, nodes: set[str]) -> None:
    """Rewire the excluded nodes to read the float tensors instead of DQ(Q(x)).

    The quantizer leaves an excluded node behind a DequantizeLinear when its producer is
    quantized. ONNX Runtime's WeightBiasQuantization pass then quantizes that node's float
    weights per tensor at load time, which wrecks depthwise convolutions; a node fed by
    float tensors keeps its float weights, so it truly stays in float.
    """
    import onnx

    model = load_model(path)
    producer = {o: n for n in model.graph.node for o in n.output}
    inits = {t.name for t in model.graph.initializer}
    changed = False
    for node in model.graph.node:
        if node.name not in nodes:
            continue
        for i, name in enumerate(node.input):
            dq = producer.get(name)
            if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] in inits:
                continue
            q = producer.get(dq.input[0])
            if q is not None and q.op_type == "QuantizeLinear":
                node.input[i] = q.input[0]
                changed = True
    if changed:
        used = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
        dead = [
            n
            for n in model.graph.node
            if n.op_type in ("QuantizeLinear", "DequantizeLinear")
            and not any(o in used for o in n.output)
        ]
        while dead:
            for n in dead:
                model.graph.node.remove(n)
            used = {i for n in model.graph.node for i in n.input} | {
                o.name for o in model.graph.output
            }
            dead = [
                n
                for n in model.graph.node
                if n.op_type in ("QuantizeLinear", "DequantizeLinear")
                and not any(o in used for o in n.output)
            ]
        onnx.save(model, str(path))


def _rel_error(a: np.ndarray, b: np.ndarray) -> float:
    ref = b.astype(np.float64)
    return float(np.mean((a.astype(np.float64) - ref) ** 2) / (np.mean(ref**2) or 1e-12))


def _all_outputs(
    path: pathlib.Path, tensors: Sequence[str], sample: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Values of ``tensors`` in the model at ``path`` for ``sample`` (exposed as outputs)."""
    import onnx
    import onnxruntime as ort

    from rtserve.optimize.evaluate import open_session

    proto = load_model(path)
    present = {o.name for o in proto.graph.output} | {i.name for i in proto.graph.input}
    produced = {o for n in proto.graph.node for o in n.output}
    for t in tensors:
        if t in produced and t not in present:
            proto.graph.output.append(onnx.ValueInfoProto(name=t))
    session = open_session(
        proto.SerializeToString(),
        graph_optimization=ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    )
    names = [o.name for o in session.get_outputs()]
    values = dict(zip(names, session.run(None, dict(sample)), strict=True))
    values.update(sample)
    return {t: values[t] for t in tensors if t in values}


def sensitivity_ranking(
    float_model: pathlib.Path,
    qdq_model: pathlib.Path,
    sample: Mapping[str, np.ndarray],
) -> list[tuple[str, float]]:
    """Quantized nodes, most sensitive first, by how much error each one adds.

    Both graphs run on ``sample`` with every node's output exposed. For each node the
    QDQ graph quantized, its added error is the relative squared error (QDQ against
    float) of its output minus the largest one among its activation inputs: a node that
    turns small input noise into large output noise (a depthwise convolution with few
    weights per channel, the first convolution, the classifier) ranks high, while error
    merely carried along from earlier layers does not count against later ones.
    """
    qdq = load_model(qdq_model)
    inits = {t.name for t in qdq.graph.initializer}
    producer = {o: n for n in qdq.graph.node for o in n.output}
    float_names = {o for n in load_model(float_model).graph.node for o in n.output}
    float_names |= {i.name for i in load_model(float_model).graph.input}
    consumers: dict[str, list[Any]] = {}
    for n in qdq.graph.node:
        for inp in n.input:
            consumers.setdefault(inp, []).append(n)
    # What downstream nodes see of tensor T in the QDQ graph is DQ(Q(T)): Q may also do
    # the clipping of an activation the quantizer removed, so compare that, not T itself.
    seen_as: dict[str, str] = {}
    for n in qdq.graph.node:
        if n.op_type == "QuantizeLinear":
            dqs = [c for c in consumers.get(n.output[0], []) if c.op_type == "DequantizeLinear"]
            if dqs:
                seen_as[n.input[0]] = dqs[0].output[0]
    nodes: dict[str, tuple[list[str], list[str]]] = {}
    for n in qdq.graph.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear") or not n.name:
            continue
        inputs = []
        quantized = False
        for inp in n.input:
            dq = producer.get(inp)
            if dq is None or dq.op_type != "DequantizeLinear":
                continue
            quantized = True
            q = producer.get(dq.input[0])
            if dq.input[0] not in inits and q is not None and q.op_type == "QuantizeLinear":
                inputs.append(q.input[0])
        # an output renamed by the quantizer (a graph output) is found under its DQ's name
        outputs = [o if o in float_names else seen_as.get(o, "") for o in n.output]
        outputs = [o for o in outputs if o in float_names]
        if quantized and outputs:
            nodes[n.name] = ([i for i in inputs if i in float_names], outputs)
    tensors = sorted({t for ins, outs in nodes.values() for t in ins + outs})
    ref = _all_outputs(float_model, tensors, sample)
    raw = _all_outputs(qdq_model, sorted({seen_as.get(t, t) for t in tensors}), sample)
    got = {t: raw[seen_as.get(t, t)] for t in tensors if seen_as.get(t, t) in raw}
    ranking = []
    for name, (ins, outs) in nodes.items():
        out_err = max(
            (_rel_error(got[t], ref[t]) for t in outs if t in got and t in ref), default=0.0
        )
        in_err = max(
            (_rel_error(got[t], ref[t]) for t in ins if t in got and t in ref), default=0.0
        )
        ranking.append((name, out_err - in_err))
    ranking.sort(key=lambda kv: kv[1], reverse=True)
    return ranking


COMPUTE_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")


def isolated_sensitivity(
    prepared: pathlib.Path,
    cache: pathlib.Path,
    method: str,
    sample: Mapping[str, np.ndarray],
    candidates: Sequence[str],
    work: pathlib.Path,
    op_types: Sequence[str] | None = None,
    progress: Any = None,
) -> list[tuple[str, float]]:
    """Candidates, most sensitive first, by the output error when only that node is INT8.

    One quantization (from the cached calibration) and one run of ``sample`` per node:
    slower than :func:`sensitivity_ranking` but it measures what the fallback cares about,
    the error that reaches the model's output, including amplification downstream.
    """
    from rtserve.optimize.evaluate import open_session

    ref = open_session(prepared).run(None, dict(sample))[0]
    tmp = work / "sensitivity-probe.onnx"
    ranking = []
    for name in candidates:
        quantize_static_int8(
            prepared, tmp, None, method, op_types=op_types, cache=cache, nodes_to_quantize=[name]
        )
        out = open_session(tmp).run(None, dict(sample))[0]
        ranking.append((name, _rel_error(out, ref)))
        if progress is not None:
            progress()
    tmp.unlink(missing_ok=True)
    ranking.sort(key=lambda kv: kv[1], reverse=True)
    return ranking
