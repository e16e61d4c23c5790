"""Quantization-aware training: fake quantization, fine-tuning, QDQ export run by ORT in INT8.

A small CNN on sklearn's 8x8 digits (real images, labelled) stands in for EfficientNet:
it has the parts that matter there (a ``Conv2d`` subclass padding 'SAME' with a
functional convolution, BatchNorm, ReLU6, a residual add, global pooling, a linear head).
"""

from __future__ import annotations

import collections
import pathlib
from typing import Any

import numpy as np
import onnx
import pytest

from rtserve.optimize import qat
from rtserve.optimize.evaluate import open_session, run_batched
from rtserve.optimize.pipeline import OptimizeOptions, TorchSources, run_optimize

torch = pytest.importorskip("torch")
F = torch.nn.functional


class SamePadConv(torch.nn.Conv2d):
    """TensorFlow-style 'SAME' padding in the forward, as EfficientNet-Lite's convolutions do."""

    def __init__(self, cin: int, cout: int, k: int, stride: int = 1, groups: int = 1) -> None:
        super().__init__(cin, cout, k, stride, groups=groups, bias=False)
        total = k - stride
        self.pad = torch.nn.ZeroPad2d((total // 2, total - total // 2) * 2)

    def forward(self, x: Any) -> Any:
        return F.conv2d(self.pad(x), self.weight, self.bias, self.stride, 0, 1, self.groups)


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = SamePadConv(1, 16, 3, stride=2)
        self.bn0 = torch.nn.BatchNorm2d(16)
        self.dw = SamePadConv(16, 16, 3, groups=16)
        self.bn1 = torch.nn.BatchNorm2d(16)
        self.project = torch.nn.Conv2d(16, 16, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(16)
        self.act = torch.nn.ReLU6()
        self.pool = torch.nn.AdaptiveAvgPool2d(1)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x: Any) -> Any:
        x = self.act(self.bn0(self.stem(x)))
        y = self.act(self.bn1(self.dw(x)))
        x = self.bn2(self.project(y)) + x
        return self.fc(self.pool(x).view(x.size(0), -1))


@pytest.fixture(scope="module")
def digits() -> dict[str, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = ((d.data / 16.0 - 0.5) * 2).astype(np.float32).reshape(-1, 1, 8, 8)
    return {"x": x, "y": d.target.astype(np.int64)}


@pytest.fixture(scope="module")
def trained(digits: dict[str, np.ndarray]) -> Any:
    from rtserve.optimize.distill import train_supervised

    torch.manual_seed(0)
    model = TinyNet()
    train_supervised(model, digits["x"][:1200], digits["y"][:1200], epochs=4, lr=3e-3)
    with torch.no_grad():  # BatchNorm statistics of the data, as a pretrained model has
        model.train()
        model(torch.from_numpy(digits["x"][:1200]))
    return model.eval()


def _has_vnni() -> bool:
    try:
        flags = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags or "amx_int8" in flags


def _agreement(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(a.argmax(1) == b.argmax(1)))


def test_fold_keeps_the_float_model_exact(trained: Any, digits: dict[str, np.ndarray]) -> None:
    folded = qat.fold(trained)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in folded.modules())
    x = {"x": digits["x"][1200:1400]}
    np.testing.assert_allclose(
        qat.torch_outputs(folded, x), qat.torch_outputs(trained, x), atol=1e-4
    )


def test_qat_export_runs_in_ort_int8_equal_to_torch_fake_quant(
    trained: Any, digits: dict[str, np.ndarray], tmp_path: pathlib.Path
) -> None:
    train = {"x": digits["x"][:600]}
    held = {"x": digits["x"][1200:]}
    options = qat.QatOptions(epochs=2, lr=1e-4, batch_size=32)
    model, summary = qat.train(trained, train, digits["y"][:600], {"x": held["x"][:2]}, options)
    assert summary.int8_layers == 3 and summary.float_layers == ["fc"]
    assert len(summary.losses) == 2 and all(np.isfinite(summary.losses))
    assert summary.losses[-1] < summary.losses[0] * 1.5
    path = qat.export_qdq(model, tmp_path / "qat.onnx", {"x": held["x"][:2]}, ["logits"])

    expected = qat.torch_outputs(model, held)
    got = run_batched(open_session(path), held, batch_size=64)
    scale = float(np.abs(expected).max())
    if not _has_vnni():
        # Without VNNI, ONNX Runtime's u8s8 kernels sum pairs in int16 (vpmaddubsw), which can
        # saturate: on an AVX2-only CPU top-1 agreement with fake quantization measured 0.92.
        assert _agreement(got, expected) >= 0.9
        assert np.abs(got - expected).mean() <= 0.05 * scale
        return
    assert _agreement(got, expected) >= 0.98
    assert np.abs(got - expected).max() <= 0.05 * scale
    assert np.abs(got - expected).mean() <= 0.005 * scale
    fp32 = qat.torch_outputs(trained, held)
    assert _agreement(got, fp32) >= 0.9

    assert not _constant_quantizers(onnx.load(str(path)))
    optimized = tmp_path / "optimized.onnx"
    open_session(path, optimized_model_path=optimized)
    ops = collections.Counter(n.op_type for n in onnx.load(str(optimized)).graph.node)
    assert ops["QLinearConv"] == 3 and ops["QLinearAdd"] == 1
    assert not ops["Conv"] and not ops["Pad"] and not ops["Add"]


def _constant_quantizers(model: onnx.ModelProto) -> list[str]:
    inits = {i.name for i in model.graph.initializer}
    return [
        n.output[0]
        for n in model.graph.node
        if n.op_type == "QuantizeLinear" and any(i in inits for i in n.input[:1])
    ]


class WideNet(torch.nn.Module):
    """Enough convolution weights (56k) that the file's size is mostly weights."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = torch.nn.Sequential(
            torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.ReLU(),
        )  # fmt: skip
        self.fc = torch.nn.Linear(64, 10)

    def forward(self, x: Any) -> Any:
        return self.fc(self.convs(x).mean((2, 3)))


def test_folded_quantizers_store_int8_weights_with_equal_outputs(
    digits: dict[str, np.ndarray], tmp_path: pathlib.Path
) -> None:
    from rtserve.optimize.export import export_module

    torch.manual_seed(0)
    example = {"x": digits["x"][:2]}
    model = qat.prepare(WideNet().eval(), example)
    qat.calibrate(model, {"x": digits["x"][:256]})
    qat.set_observers(model, False)
    plain = qat.scalar_qparams(export_module(model, tmp_path / "qdq.onnx", example, ["logits"]))
    folded = tmp_path / "folded.onnx"
    folded.write_bytes(plain.read_bytes())
    qat.fold_constant_quantizers(folded)

    before, after = onnx.load(str(plain)), onnx.load(str(folded))
    onnx.checker.check_model(after, full_check=True)
    assert len(_constant_quantizers(before)) == 3 and not _constant_quantizers(after)
    assert sum(n.op_type == "QuantizeLinear" for n in after.graph.node) >= 3  # activations stay
    inits = {i.name: i for i in after.graph.initializer}
    weights = [n.input[0] for n in after.graph.node if n.op_type == "DequantizeLinear"]
    weights = [inits[w] for w in weights if w in inits]
    assert len(weights) == 3
    assert all(w.data_type == onnx.TensorProto.INT8 and len(w.dims) == 4 for w in weights)
    assert not any(
        i.data_type == onnx.TensorProto.FLOAT and len(i.dims) == 4 for i in inits.values()
    )
    assert folded.stat().st_size < 0.3 * plain.stat().st_size

    held = {"x": digits["x"][1200:]}
    expected = run_batched(open_session(plain), held, batch_size=64)
    np.testing.assert_array_equal(run_batched(open_session(folded), held, batch_size=64), expected)


def _ort_quantize_linear(
    x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, axis: int
) -> Any:
    from onnx import helper, numpy_helper

    node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], axis=axis)
    elem = helper.np_dtype_to_tensor_dtype(zero_point.dtype)
    graph = helper.make_graph(
        [node], "q", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info("y", elem, x.shape)],
        [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(zero_point, "z")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return open_session(model.SerializeToString()).run(None, {"x": x})[0]


@pytest.mark.parametrize(
    ("scale", "zero_point", "axis"),
    [
        (np.array([0.5, 0.25, 1.0], np.float32), np.array([0, 0, 0], np.int8), 0),
        (np.array([0.5, 0.25, 2.0, 0.1, 3.0], np.float32), np.array([0, 3, -5, 1, 0], np.int8), -1),
        (np.array(0.5, np.float32), np.array(128, np.uint8), 1),
    ],
)
def test_quantize_linear_equals_onnx_runtime(
    scale: np.ndarray, zero_point: np.ndarray, axis: int
) -> None:
    rng = np.random.default_rng(0)
    x = (rng.integers(-300, 300, (3, 4, 5)) / 4).astype(np.float32)  # halves, out of range
    x[0, 0, :3] = [0.25, 0.75, 1.25]  # exactly .5 steps at scale 0.5
    got = qat.quantize_linear(x, scale, zero_point, axis)
    assert got.dtype == zero_point.dtype
    np.testing.assert_array_equal(got, _ort_quantize_linear(x, scale, zero_point, axis))


def test_fake_quant_clamps_relu6_like_the_float_model(
    trained: Any, digits: dict[str, np.ndarray]
) -> None:
    prepared = qat.prepare(trained, {"x": digits["x"][:2]})
    assert not any(isinstance(m, torch.nn.ReLU6) for m in prepared.modules())
    qat.calibrate(prepared, {"x": digits["x"][:256]})
    held = {"x": digits["x"][1200:]}
    assert _agreement(qat.torch_outputs(prepared, held), qat.torch_outputs(trained, held)) >= 0.9


def test_default_trains_biases_only_and_weight_lr_trains_weights(
    trained: Any, digits: dict[str, np.ndarray]
) -> None:
    x = {"x": digits["x"][:256]}
    before = qat.prepare(trained, {"x": x["x"][:2]})
    weights = {n: p.detach().clone() for n, p in before.named_parameters()}
    biases_only, both = (qat.prepare(trained, {"x": x["x"][:2]}) for _ in range(2))
    qat.calibrate(biases_only, x)
    qat.calibrate(both, x)
    qat.fine_tune(biases_only, trained, x, options=qat.QatOptions(epochs=1, batch_size=32))
    options = qat.QatOptions(epochs=1, batch_size=32, weight_lr=1e-3, loss="kd")
    qat.fine_tune(both, trained, x, digits["y"][:256], options)
    for name, param in biases_only.named_parameters():
        assert torch.equal(param, weights[name]) != name.endswith("bias"), name
    for name, param in both.named_parameters():
        assert not torch.equal(param, weights[name]), name


def test_float_first_keeps_the_leading_layers_float(
    trained: Any, digits: dict[str, np.ndarray], tmp_path: pathlib.Path
) -> None:
    example = {"x": digits["x"][:2]}
    model = qat.prepare(trained, example, float_first=1)
    assert type(model.get_submodule("stem.conv")) is torch.nn.Conv2d
    assert type(model.get_submodule("stem_conv_relu6")) is torch.nn.ReLU6
    qat.calibrate(model, {"x": digits["x"][:256]})
    path = qat.export_qdq(model, tmp_path / "qat.onnx", example, ["logits"])
    held = {"x": digits["x"][1200:]}
    expected = qat.torch_outputs(model, held)
    got = run_batched(open_session(path), held, batch_size=64)
    assert np.abs(got - expected).max() <= 0.05 * float(np.abs(expected).max())
    optimized = tmp_path / "optimized.onnx"
    open_session(path, optimized_model_path=optimized)
    ops = collections.Counter(n.op_type for n in onnx.load(str(optimized)).graph.node)
    assert ops["QLinearConv"] == 2 and ops["Conv"] == 1


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"loss": "l1"}, "QAT loss must be one of mse, kd, got 'l1'"),
        ({"lr": 0.0}, "not both 0"),
        ({"weight_lr": -1.0}, "must be >= 0"),
        ({"float_first": -1}, "float_first must be >= 0, got -1"),
    ],
)
def test_bad_qat_options_are_refused(kw: dict[str, Any], message: str) -> None:
    from rtserve.optimize.errors import OptimizeError

    with pytest.raises(OptimizeError, match=message):
        qat.QatOptions(**kw)


def test_untraceable_model_is_a_clear_error() -> None:
    from rtserve.optimize.errors import OptimizeError

    class Branchy(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            return x if x.sum() > 0 else -x

    with pytest.raises(OptimizeError, match="torch.fx can trace.*Branchy"):
        qat.prepare(Branchy(), {"x": np.zeros((2, 4), np.float32)})


def test_optimize_builds_and_measures_the_int8_qat_variant(
    trained: Any, digits: dict[str, np.ndarray], tmp_path: pathlib.Path
) -> None:
    from rtserve.optimize.export import export_module

    held = {"x": digits["x"][1200:1500]}
    source = export_module(trained, tmp_path / "model.onnx", {"x": held["x"][:2]}, ["logits"])
    sources = TorchSources(
        model=trained, train_inputs={"x": digits["x"][:400]}, train_labels=digits["y"][:400],
        qat=qat.QatOptions(epochs=1, lr=1e-4, batch_size=32),
    )  # fmt: skip
    options = OptimizeOptions(
        variants=("int8-qat",), iterations=6, max_seconds=0.2, rounds=2, progress=False,
        batch_sizes=(1, 8), max_accuracy_drop=0.05,
    )  # fmt: skip
    result = run_optimize(
        source, tmp_path / "work", None, held, digits["y"][1200:1500], options, sources
    )
    m = result.get("int8-qat")
    assert m is not None and m.p50_ms > 0 and result.reference_score - m.score <= 0.05
    assert "QAT (torch.ao FX): 1 epoch(s) on 400 rows" in m.notes[0]
    assert run_batched(open_session(m.path), held).shape == (300, 10)


def test_cli_qat_without_training_data_is_refused(
    trained: Any, digits: dict[str, np.ndarray], tmp_path: pathlib.Path, capsys: Any
) -> None:
    from rtserve.optimize.cli import main
    from rtserve.optimize.export import export_module

    x = {"x": digits["x"][:16]}
    model = export_module(trained, tmp_path / "model.onnx", {"x": x["x"][:2]}, ["logits"])
    scripted = tmp_path / "model.pt"
    torch.jit.trace(trained, torch.from_numpy(x["x"][:2])).save(str(scripted))
    np.savez(tmp_path / "eval.npz", **x)
    argv = ["optimize", str(model), "--eval", str(tmp_path / "eval.npz"), "--out",
            str(tmp_path / "repo" / "m"), "--torch-model", str(scripted), "--qat"]  # fmt: skip
    assert main(argv) == 2
    assert "--qat fine-tunes on training data: give --train" in capsys.readouterr().err


def test_cli_qat_options_reach_the_training() -> None:
    from rtserve.cli import build_parser
    from rtserve.optimize.cli import _qat_options

    argv = ["optimize", "m.onnx", "--eval", "e.npz", "--out", "o", "--torch-model", "m.pt",
            "--train", "t.npz", "--qat", "--qat-weight-lr", "1e-5", "--qat-loss", "kd",
            "--qat-float-first", "2"]  # fmt: skip
    options = _qat_options(build_parser().parse_args(argv))
    assert (options.lr, options.weight_lr, options.loss, options.float_first) == (
        1e-3,
        1e-5,
        "kd",
        2,
    )
