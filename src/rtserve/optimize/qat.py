"""Quantization-aware training (QAT): fake-quantize a torch model, fine-tune it, export QDQ ONNX.

Built on torch.ao's FX graph mode QAT, which ships with torch (no extra package) and
whose fake-quantize modules export to ONNX ``QuantizeLinear`` / ``DequantizeLinear``
pairs that ONNX Runtime fuses into INT8 kernels (``QLinearConv``, ``QGemm``, ...).

1. :func:`fold` traces the model, turns functional convolutions with parameter weights
   (``F.conv2d(x, self.weight)`` in ``nn.Conv2d`` subclasses) into ``nn.Conv2d`` modules,
   and folds BatchNorm into the convolution before it (eval statistics, kept frozen:
   a small fine-tune set would only add noise to them).
2. :func:`prepare` inserts fake quantization: uint8 activations (per tensor, full
   range) and int8 symmetric per-channel weights, as ONNX Runtime's static INT8 uses.
   It takes the plain ``FakeQuantize`` module, not torch's fused default (the fused op
   has no ONNX export). A ``ReLU6`` after a convolution becomes a ReLU whose output
   quantizer is fixed to [0, 6], so the clamp costs nothing: ORT folds it into the
   convolution's output range. The layer that produces the model's output stays float
   (one small Gemm), and so do the pooling and reshapes before it, so close logits are
   not merged into one quantization step.
3. :func:`calibrate` sets the activation ranges on a few rows and freezes them, then
   :func:`fine_tune` trains the fake-quantized model's biases (weights optional) against
   the FP32 model's logits (MSE, or distillation with optional labels).
4. :func:`export_qdq` exports with the TorchScript exporter at opset 17 and stores the
   quantized weights as int8 initializers (:func:`fold_constant_quantizers`), a quarter
   of their FP32 size (the float layers keep theirs).
"""

from __future__ import annotations

import copy
import pathlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rtserve.optimize.errors import OptimizeError

if TYPE_CHECKING:
    import torch
    import torch.fx

RELU6_RANGE = 6.0
QAT_LOSSES = ("mse", "kd")
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


@dataclass
class QatOptions:
    """How the fake-quantized model is fine-tuned.

    By default only the biases learn: quantizing weights and activations shifts each
    channel's mean output, and a bias per channel is exactly what cancels that shift.
    Training the weights too (``weight_lr`` > 0) fits the few hundred rows a user has
    rather than the model (seen on EfficientNet-Lite0: logit error 0.104 with weights at
    1e-5 against 0.085 with biases alone).
    """

    epochs: int = 3
    lr: float = 1e-3  # Adam on the biases, cosine decay to 0
    weight_lr: float = 0.0  # Adam on the weights; 0 keeps the FP32 model's weights
    batch_size: int = 8
    loss: str = "mse"  # "mse" on the logits, or "kd": KL at ``temperature`` (+ labels)
    temperature: float = 2.0
    alpha: float = 1.0  # "kd" only: weight of the teacher's soft targets against the labels
    calibration_rows: int = 64  # rows that set the activation ranges before training
    float_first: int = 0  # leading convolution / linear layers kept in float
    observe_epochs: int = 0  # epochs that keep updating activation ranges, then frozen
    seed: int = 0

    def __post_init__(self) -> None:
        if self.loss not in QAT_LOSSES:
            raise OptimizeError(
                f"QAT loss must be one of {', '.join(QAT_LOSSES)}, got {self.loss!r}"
            )
        if self.float_first < 0:
            raise OptimizeError(f"QAT float_first must be >= 0, got {self.float_first}")
        if self.lr < 0 or self.weight_lr < 0 or self.lr + self.weight_lr == 0:
            raise OptimizeError(
                f"QAT learning rates must be >= 0 and not both 0, got lr={self.lr:g}, "
                f"weight_lr={self.weight_lr:g}"
            )


def _tensors(inputs: Mapping[str, np.ndarray]) -> list[torch.Tensor]:
    import torch

    return [torch.from_numpy(np.ascontiguousarray(v)) for v in inputs.values()]


def _trace(model: torch.nn.Module) -> torch.fx.GraphModule:
    import torch.fx

    try:
        return torch.fx.symbolic_trace(model)
    except Exception as exc:
        what = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OptimizeError(
            f"QAT needs a model torch.fx can trace; {type(model).__name__} is not: {what}"
        ) from exc


def _modularize_convs(gm: torch.fx.GraphModule) -> None:
    """Replace ``F.conv2d(x, <param>, <param or None>, ...)`` by ``nn.Conv2d`` modules."""
    import torch
    import torch.nn.functional as F

    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not F.conv2d:
            continue
        kw = dict(zip(_CONV_ARGS, node.args, strict=False)) | dict(node.kwargs)
        weight, bias = kw["weight"], kw.get("bias")
        if getattr(weight, "op", None) != "get_attr" or (
            bias is not None and getattr(bias, "op", None) != "get_attr"
        ):
            continue
        w = gm.get_parameter(weight.target)
        conv = torch.nn.Conv2d(
            w.shape[1] * kw.get("groups", 1), w.shape[0], (int(w.shape[2]), int(w.shape[3])),
            stride=kw.get("stride", 1), padding=kw.get("padding", 0),
            dilation=kw.get("dilation", 1), groups=kw.get("groups", 1), bias=bias is not None,
        )  # fmt: skip
        conv.weight = w
        if bias is not None:
            conv.bias = gm.get_parameter(bias.target)
        target = weight.target.rpartition(".")[0] + (".conv" if "." in weight.target else "conv")
        gm.add_submodule(target, conv)
        with graph.inserting_before(node):
            new = graph.call_module(target, (kw["input"],))
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    graph.eliminate_dead_code()
    gm.recompile()


def fold(model: torch.nn.Module) -> torch.fx.GraphModule:
    """A traced copy of ``model`` in eval mode with BatchNorm folded into its convolutions."""
    import torch.fx
    from torch.fx.experimental.optimization import fuse

    gm = _trace(copy.deepcopy(model).eval())
    _modularize_convs(gm)
    gm.eval()
    folded = fuse(gm, no_trace=True)
    assert isinstance(folded, torch.fx.GraphModule)
    return folded


def _qconfig(fixed_range: float | None = None) -> Any:
    import torch
    from torch.ao.quantization import (
        FakeQuantize,
        FixedQParamsFakeQuantize,
        MovingAverageMinMaxObserver,
        MovingAveragePerChannelMinMaxObserver,
        QConfig,
    )
    from torch.ao.quantization.observer import FixedQParamsObserver

    weight = FakeQuantize.with_args(
        observer=MovingAveragePerChannelMinMaxObserver, quant_min=-128, quant_max=127,
        dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=0,
    )  # fmt: skip
    if fixed_range is not None:
        activation = FixedQParamsFakeQuantize.with_args(
            observer=FixedQParamsObserver.with_args(
                scale=fixed_range / 255.0, zero_point=0, dtype=torch.quint8,
                quant_min=0, quant_max=255,
            )
        )  # fmt: skip
    else:
        activation = FakeQuantize.with_args(
            observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255,
            dtype=torch.quint8, qscheme=torch.per_tensor_affine,
        )  # fmt: skip
    return QConfig(activation=activation, weight=weight)


def _is_relu6(node: torch.fx.Node, modules: Mapping[str, torch.nn.Module]) -> bool:
    import torch
    import torch.nn.functional as F

    if node.op == "call_module":
        return type(modules[str(node.target)]) is torch.nn.ReLU6
    return node.op == "call_function" and node.target is F.relu6


def _relu6_to_relu(gm: torch.fx.GraphModule, skip: Sequence[str] = ()) -> list[str]:
    """Turn ``conv -> ReLU6`` into ``conv -> ReLU``; returns those convolutions' names.

    Their outputs get a quantizer fixed to [0, 6], which clamps exactly as ReLU6 does.
    After a convolution in ``skip`` (kept float) the ReLU6 becomes a module of its own,
    named ``<conv>_relu6``, so that it can stay float as well.
    """
    import torch
    import torch.nn.functional as F

    modules = dict(gm.named_modules())
    convs = []
    for node in list(gm.graph.nodes):
        if not _is_relu6(node, modules):
            continue
        src = node.args[0] if node.args else None
        if not (
            src is not None
            and src.op == "call_module"
            and isinstance(modules[src.target], torch.nn.Conv2d | torch.nn.Linear)
            and len(src.users) == 1
        ):
            continue
        with gm.graph.inserting_before(node):
            if src.target in skip:
                name = f"{src.target}_relu6".replace(".", "_")
                gm.add_submodule(name, torch.nn.ReLU6())
                relu = gm.graph.call_module(name, (src,))
            else:
                relu = gm.graph.call_function(F.relu, (src,))
                convs.append(str(src.target))
        node.replace_all_uses_with(relu)
        gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return convs


def _leading_layers(gm: torch.fx.GraphModule, count: int) -> list[str]:
    """The first ``count`` Conv / Linear modules in the order the graph runs them."""
    import torch

    modules = dict(gm.named_modules())
    layers = [
        str(n.target)
        for n in gm.graph.nodes
        if n.op == "call_module"
        and isinstance(modules[n.target], torch.nn.Conv2d | torch.nn.Linear)
    ]
    return layers[:count]


def _output_layers(gm: torch.fx.GraphModule) -> list[str]:
    """Conv / Linear modules whose result reaches the output through shape-only ops."""
    import torch

    modules = dict(gm.named_modules())
    out = []
    for node in gm.graph.nodes:
        if node.op != "output":
            continue
        stack = list(node.all_input_nodes)
        while stack:
            n = stack.pop()
            if n.op == "call_module" and isinstance(
                modules[n.target], torch.nn.Conv2d | torch.nn.Linear
            ):
                out.append(str(n.target))
            elif n.op == "call_method" and n.target in ("view", "reshape", "flatten", "squeeze"):
                stack.append(n.args[0])  # type: ignore[arg-type]
    return out


def prepare(
    model: torch.nn.Module,
    example: Mapping[str, np.ndarray],
    float_output: bool = True,
    float_first: int = 0,
) -> torch.fx.GraphModule:
    """A fake-quantized copy of ``model``, ready for :func:`fine_tune` (see the module doc).

    The first ``float_first`` convolution / linear layers stay float: the first layers
    see the least averaged signal, and their rounding errors travel through every later one.
    """
    from torch.ao.quantization import QConfigMapping
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    gm = fold(model)
    leading = _leading_layers(gm, float_first)
    fixed = _relu6_to_relu(gm, skip=leading)
    mapping = QConfigMapping().set_global(_qconfig())
    relu6 = [f"{name}_relu6".replace(".", "_") for name in leading]
    for name in leading + relu6 + (_output_layers(gm) if float_output else []):
        mapping.set_module_name(name, None)
    gm.train()
    try:
        prepared: torch.fx.GraphModule = prepare_qat_fx(gm, mapping, tuple(_tensors(example)))
    except Exception as exc:
        what = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OptimizeError(f"inserting fake quantization failed: {what}") from exc
    _fix_output_ranges(prepared, fixed, RELU6_RANGE)
    _quantize_before_pads(prepared)
    if float_output:
        _float_tails(prepared, _output_layers(gm))
    return prepared.eval()


def _fix_output_ranges(gm: torch.fx.GraphModule, layers: Sequence[str], top: float) -> None:
    """Give the output quantizer of each of ``layers`` the fixed range [0, ``top``]."""
    fixed = _qconfig(top).activation
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target in layers:
            q = _quantizer_after(node)
            if q is not None:
                setattr(gm, str(q.target), fixed())


def _is_quantizer(node: Any) -> bool:
    return getattr(node, "op", None) == "call_module" and str(node.target).startswith(
        "activation_post_process"
    )


def _quantizer_after(node: torch.fx.Node) -> torch.fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 and _is_quantizer(users[0]) else None


def _is_passthrough(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Pooling, dropout or a reshape: what may run in float before a float output layer."""
    import torch

    if node.op == "call_method":
        return node.target in ("view", "reshape", "flatten", "squeeze", "mean")
    if node.op == "call_module":
        kinds = (
            torch.nn.AdaptiveAvgPool2d, torch.nn.AvgPool2d, torch.nn.Dropout, torch.nn.Flatten,
        )  # fmt: skip
        return isinstance(gm.get_submodule(str(node.target)), kinds)
    return node.op == "call_function" and node.target in (
        torch.flatten, torch.nn.functional.adaptive_avg_pool2d, torch.nn.functional.dropout,
    )  # fmt: skip


def _float_tails(gm: torch.fx.GraphModule, layers: Sequence[str]) -> None:
    """Run the pooling and reshapes that feed a float output layer in float.

    The quantizer after the last INT8 layer stays (``QLinearConv`` needs it); those after
    pooling or reshapes are dropped, so the averaged features reach the float layer at
    full precision instead of on the last layer's coarser grid.
    """
    import torch.fx

    for node in list(gm.graph.nodes):
        if node.op != "call_module" or node.target not in layers:
            continue
        cur = node.args[0] if node.args else None
        while isinstance(cur, torch.fx.Node) and cur.args:
            src = cur.args[0]
            if _is_quantizer(cur):
                if not (isinstance(src, torch.fx.Node) and _is_passthrough(gm, src)):
                    break
                cur.replace_all_uses_with(src)
                gm.graph.erase_node(cur)
            elif not _is_passthrough(gm, cur):
                break
            cur = src
    gm.delete_all_unused_submodules()
    gm.recompile()


def _is_zero_pad(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    import torch
    import torch.nn.functional as F

    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), torch.nn.ZeroPad2d)
    return node.op == "call_function" and node.target is F.pad and len(node.args) == 2


def _quantize_before_pads(gm: torch.fx.GraphModule) -> None:
    """Quantize before a zero padding, not after it: zero is on the grid, results are equal.

    The padding then feeds its convolution directly, and ONNX Runtime folds it into the
    convolution's ``pads`` before turning the QDQ convolution into ``QLinearConv``.
    """
    import torch.fx

    for node in list(gm.graph.nodes):
        q = _quantizer_after(node) if _is_zero_pad(gm, node) else None
        src = node.args[0] if node.args else None
        if q is None or not isinstance(src, torch.fx.Node):
            continue
        q.replace_all_uses_with(node)
        if _is_quantizer(src):
            gm.graph.erase_node(q)
            continue
        q.args = (src,)
        node.replace_input_with(src, q)
        node.prepend(q)
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()


def set_observers(model: torch.nn.Module, enabled: bool) -> None:
    """Let the fake quantizers update their ranges (``True``) or freeze them."""
    from torch.ao.quantization import disable_observer, enable_observer

    model.apply(enable_observer if enabled else disable_observer)


def _optimizer(model: torch.nn.Module, opts: QatOptions) -> torch.optim.Optimizer:
    """Adam over the biases (``lr``) and, if ``weight_lr`` > 0, the other parameters.

    BatchNorm folding leaves biases that do not require gradients: they are turned on here.
    """
    import torch

    biases: list[torch.nn.Parameter] = []
    weights: list[torch.nn.Parameter] = []
    for name, param in model.named_parameters():
        is_bias = name.rsplit(".", 1)[-1] == "bias"
        learns = opts.lr > 0 if is_bias else opts.weight_lr > 0
        param.requires_grad_(learns)
        if learns:
            (biases if is_bias else weights).append(param)
    groups = [{"params": biases, "lr": opts.lr}, {"params": weights, "lr": opts.weight_lr}]
    return torch.optim.Adam([g for g in groups if g["params"]])


def _loss(
    out: torch.Tensor, target: torch.Tensor, labels: torch.Tensor | None, opts: QatOptions
) -> torch.Tensor:
    import torch.nn.functional as F

    from rtserve.optimize.distill import kd_loss

    if opts.loss == "mse":
        return F.mse_loss(out, target)
    return kd_loss(out, target, labels, opts.temperature, opts.alpha)


def fine_tune(
    qat_model: torch.nn.Module,
    teacher: torch.nn.Module,
    inputs: Mapping[str, np.ndarray],
    labels: np.ndarray | None = None,
    options: QatOptions | None = None,
) -> list[float]:
    """Train ``qat_model`` on ``inputs`` against ``teacher``'s logits; mean loss per epoch.

    Both stay in eval mode (no BatchNorm statistics or dropout change). Observers run for
    ``observe_epochs`` epochs, then ranges freeze; the learning rates decay to 0 on a
    cosine, so the last steps settle instead of adding batch noise.
    """
    import torch

    opts = options or QatOptions()
    tensors = _tensors(inputs)
    n = len(tensors[0])
    if labels is not None and len(labels) != n:
        raise OptimizeError(f"QAT training data has {n} rows but {len(labels)} labels")
    torch.manual_seed(opts.seed)
    rng = np.random.default_rng(opts.seed)
    teacher = teacher.eval()
    with torch.no_grad():
        targets = torch.cat([teacher(*(t[i : i + 64] for t in tensors)) for i in range(0, n, 64)])
    y = torch.from_numpy(np.asarray(labels, np.int64)) if labels is not None else None
    opt = _optimizer(qat_model, opts)
    steps = opts.epochs * -(-n // opts.batch_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: 0.5 * (1.0 + float(np.cos(np.pi * k / steps)))
    )
    qat_model.eval()
    losses = []
    for epoch in range(opts.epochs):
        set_observers(qat_model, epoch < opts.observe_epochs)
        total = 0.0
        order = rng.permutation(n)
        for start in range(0, n, opts.batch_size):
            idx = torch.from_numpy(order[start : start + opts.batch_size])
            opt.zero_grad()
            out = qat_model(*(t[idx] for t in tensors))
            loss = _loss(out, targets[idx], y[idx] if y is not None else None, opts)
            loss.backward()
            opt.step()
            schedule.step()
            total += float(loss.detach()) * len(idx)
        losses.append(total / n)
    set_observers(qat_model, False)
    return losses


def calibrate(qat_model: torch.nn.Module, inputs: Mapping[str, np.ndarray], rows: int = 64) -> None:
    """Set the quantizers' ranges from the first ``rows`` rows before any training step."""
    import torch

    tensors = [t[:rows] for t in _tensors(inputs)]
    set_observers(qat_model, True)
    with torch.no_grad():
        for i in range(0, len(tensors[0]), 16):
            qat_model.eval()(*(t[i : i + 16] for t in tensors))
    set_observers(qat_model, False)


@dataclass
class QatSummary:
    """What :func:`train` did, for the report."""

    rows: int
    options: QatOptions
    int8_layers: int
    float_layers: list[str]
    losses: list[float]
    seconds: float

    def describe(self) -> str:
        o = self.options
        kept = f", {', '.join(self.float_layers)} float" if self.float_layers else ""
        loss = "MSE to teacher logits" if o.loss == "mse" else f"KD T={o.temperature:g}"
        learns = f"biases lr {o.lr:g}" + (f", weights lr {o.weight_lr:g}" if o.weight_lr else "")
        return (
            f"QAT (torch.ao FX): {o.epochs} epoch(s) on {self.rows} rows, {loss}, {learns}; "
            f"{self.int8_layers} layers INT8{kept}; ranges from {o.calibration_rows} rows, "
            f"frozen after epoch {o.observe_epochs}; {self.seconds:.0f} s"
        )


def train(
    model: torch.nn.Module,
    inputs: Mapping[str, np.ndarray],
    labels: np.ndarray | None,
    example: Mapping[str, np.ndarray],
    options: QatOptions | None = None,
) -> tuple[torch.fx.GraphModule, QatSummary]:
    """Prepare, calibrate and fine-tune a fake-quantized copy of ``model`` (the teacher)."""
    import time

    import torch
    from torch.ao.nn import qat as nqat
    from torch.ao.nn.intrinsic import qat as iqat

    opts = options or QatOptions()
    start = time.perf_counter()
    qat_model = prepare(model, example, float_first=opts.float_first)
    calibrate(qat_model, inputs, opts.calibration_rows)
    losses = fine_tune(qat_model, model, inputs, labels, opts)
    quantized = (nqat.Conv2d, nqat.Linear, iqat.ConvReLU2d, iqat.LinearReLU)
    layers = [m for m in qat_model.modules() if isinstance(m, quantized)]
    floats = [
        n for n, m in qat_model.named_modules() if type(m) in (torch.nn.Conv2d, torch.nn.Linear)
    ]
    summary = QatSummary(
        rows=len(next(iter(inputs.values()))), options=opts, int8_layers=len(layers),
        float_layers=floats, losses=losses, seconds=time.perf_counter() - start,
    )  # fmt: skip
    return qat_model, summary


def export_qdq(
    qat_model: torch.nn.Module,
    path: pathlib.Path,
    example: Mapping[str, np.ndarray],
    output_names: Sequence[str] = ("output",),
) -> pathlib.Path:
    """Export the fake-quantized model as QDQ ONNX (opset 17, dynamic batch axis)."""
    import onnx

    from rtserve.optimize.export import export_module

    set_observers(qat_model, False)
    export_module(qat_model, path, example, output_names, opset=17)
    model = onnx.load(str(path))
    _fold_constant_quantizers(_scalar_qparams(model))
    onnx.save(model, str(path))
    return path


_QDQ = ("QuantizeLinear", "DequantizeLinear")


def scalar_qparams(path: pathlib.Path) -> pathlib.Path:
    """:func:`_scalar_qparams` on the ONNX file at ``path``, in place."""
    import onnx

    model = onnx.load(str(path))
    onnx.save(_scalar_qparams(model), str(path))
    return path


def _scalar_qparams(model: Any) -> Any:
    """Rewrite per-tensor scales and zero points of shape [1] as scalars.

    torch exports them as 1-element vectors (some behind ``Identity`` nodes); ONNX
    Runtime fuses convolutions either way but quantized ``Add`` (``QLinearAdd``) only
    with scalars.
    """
    import onnx

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    outputs = {o.name for o in graph.output}
    alias = {
        n.output[0]: n.input[0]
        for n in graph.node
        if n.op_type == "Identity" and n.input[0] in inits and n.output[0] not in outputs
    }
    scalars: dict[str, str] = {}
    for node in graph.node:
        node.input[:] = [alias.get(name, name) for name in node.input]
        if node.op_type not in _QDQ:
            continue
        for i in (1, 2):
            init = inits.get(node.input[i]) if i < len(node.input) else None
            if init is None or list(init.dims) != [1]:
                continue
            if init.name not in scalars:
                scalar = onnx.TensorProto()
                scalar.CopyFrom(init)
                del scalar.dims[:]
                scalar.name = scalars[init.name] = f"{init.name}__scalar"
                graph.initializer.append(scalar)
            node.input[i] = scalars[init.name]
    _remove_nodes(graph, {n.output[0] for n in graph.node if n.output[0] in alias})
    return model


def _remove_nodes(graph: Any, outputs_of: set[str], candidates: set[str] | None = None) -> None:
    """Remove the nodes whose first output is in ``outputs_of``, then the initializers that
    nothing reads any more (of ``candidates`` only, when given)."""
    live = [n for n in graph.node if n.output[0] not in outputs_of]
    del graph.node[:]
    graph.node.extend(live)
    used = _referenced(graph) | {o.name for o in graph.output}
    kept = [
        i
        for i in graph.initializer
        if i.name in used or (candidates is not None and i.name not in candidates)
    ]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def quantize_linear(
    x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, axis: int = 1
) -> np.ndarray:
    """ONNX ``QuantizeLinear``: ``saturate(round_half_even(x / scale) + zero_point)``.

    A 1-D ``scale`` (and ``zero_point``) quantizes per slice along ``axis``; the result
    has ``zero_point``'s dtype.
    """
    if scale.ndim == 1 and x.ndim > 0:
        shape = [1] * x.ndim
        shape[axis] = -1
        scale, zero_point = scale.reshape(shape), zero_point.reshape(shape)
    info = np.iinfo(zero_point.dtype)
    q = np.rint(x / scale) + zero_point.astype(np.float64)
    return np.clip(q, info.min, info.max).astype(zero_point.dtype)


def _is_constant_quantizer(node: Any, inits: Mapping[str, Any], outputs: set[str]) -> bool:
    """``QuantizeLinear`` of FP32 initializers into an integer initializer type, not blocked."""
    from onnx import TensorProto as T

    if node.op_type != "QuantizeLinear" or node.domain not in ("", "ai.onnx"):
        return False
    if len(node.input) != 3 or not all(name in inits for name in node.input):
        return False
    if node.output[0] in outputs or any(a.name == "block_size" and a.i for a in node.attribute):
        return False
    x, scale, zero_point = (inits[name].data_type for name in node.input)
    return x == scale == T.FLOAT and zero_point in (T.INT8, T.UINT8, T.INT16, T.UINT16)


def _referenced(graph: Any) -> set[str]:
    """Every name a node of ``graph`` or of its subgraphs reads."""
    names: set[str] = set()
    for node in graph.node:
        names.update(node.input)
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else attr.graphs:
                names |= _referenced(sub)
    return names


def fold_constant_quantizers(path: pathlib.Path) -> pathlib.Path:
    """:func:`_fold_constant_quantizers` on the ONNX file at ``path``, in place."""
    import onnx

    model = onnx.load(str(path))
    onnx.save(_fold_constant_quantizers(model), str(path))
    return path


def _fold_constant_quantizers(model: Any) -> Any:
    """Store quantized weights as integers: fold each constant ``QuantizeLinear``.

    torch exports a fake-quantized weight as its FP32 values followed by
    ``QuantizeLinear``; ONNX Runtime folds that at load, but the file stays as large as
    FP32. The integer result (:func:`quantize_linear`, as the ONNX spec defines it) becomes
    an initializer named as the node's output, so the ``DequantizeLinear`` after it reads
    int8 directly; the node and the FP32 weights only it used are dropped.
    """
    from onnx import numpy_helper

    graph = model.graph
    inputs = {i.name for i in graph.input}
    inits = {i.name: i for i in graph.initializer if i.name not in inputs}
    outputs = {o.name for o in graph.output}
    folded = {n.output[0]: n for n in graph.node if _is_constant_quantizer(n, inits, outputs)}
    for name, node in folded.items():
        x, scale, zero_point = (numpy_helper.to_array(inits[i]) for i in node.input)
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        q = quantize_linear(x, scale, zero_point, axis)
        graph.initializer.append(numpy_helper.from_array(q, name))
    _remove_nodes(graph, set(folded), {i for n in folded.values() for i in n.input})
    return model


def torch_outputs(model: torch.nn.Module, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """``model``'s first output on ``inputs`` (eval mode, no gradients), as numpy."""
    import torch

    with torch.no_grad():
        out = model.eval()(*_tensors(inputs))
    return np.asarray(out.detach().numpy())
