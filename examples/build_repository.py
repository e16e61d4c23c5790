"""Build the bundled example model repository from real data.

Models:
  digits  an MLP classifier trained on sklearn's handwritten digits (8x8 images, 64 features);
          its held-out test accuracy is printed and stored in the repository's README.
  mlp     the 256->512->512->10 float32 MLP used by the benchmarks (fixed seeded weights).

Both are plain ONNX graphs (Gemm/Relu/Softmax) written with onnx.helper, so building the
repository needs neither torch nor a converter.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def _dense_graph(
    name: str,
    weights: list[tuple[np.ndarray, np.ndarray]],
    input_name: str,
    output_name: str,
    softmax_output: str | None = None,
    argmax_output: str | None = None,
) -> onnx.ModelProto:
    """Chain Gemm(+Relu) layers; the last layer has no activation."""
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    current = input_name
    for i, (w, b) in enumerate(weights):
        inits += [
            numpy_helper.from_array(w.astype(np.float32), f"W{i}"),
            numpy_helper.from_array(b.astype(np.float32), f"B{i}"),
        ]
        last = i == len(weights) - 1
        out = output_name if last else f"h{i}"
        nodes.append(
            helper.make_node("Gemm", [current, f"W{i}", f"B{i}"], [out if last else f"g{i}"])
        )
        if not last:
            nodes.append(helper.make_node("Relu", [f"g{i}"], [out]))
        current = out
    n_in = weights[0][0].shape[0]
    n_out = weights[-1][0].shape[1]
    outputs = [helper.make_tensor_value_info(output_name, TensorProto.FLOAT, ["batch", n_out])]
    if softmax_output:
        nodes.append(helper.make_node("Softmax", [output_name], [softmax_output], axis=1))
        outputs.append(
            helper.make_tensor_value_info(softmax_output, TensorProto.FLOAT, ["batch", n_out])
        )
    if argmax_output:
        nodes.append(helper.make_node("ArgMax", [output_name], [argmax_output], axis=1, keepdims=0))
        outputs.append(helper.make_tensor_value_info(argmax_output, TensorProto.INT64, ["batch"]))
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["batch", n_in])],
        outputs,
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def build_mlp(path: Path, seed: int = 0) -> Path:
    """The benchmark MLP: 256->512->512->10, He-initialised with a fixed seed."""
    rng = np.random.default_rng(seed)
    sizes = [256, 512, 512, 10]
    weights = [
        (
            rng.normal(0.0, np.sqrt(2.0 / a), size=(a, b)).astype(np.float32),
            rng.normal(0.0, 0.01, size=b).astype(np.float32),
        )
        for a, b in zip(sizes[:-1], sizes[1:], strict=True)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(_dense_graph("mlp", weights, "input", "output"), str(path))
    return path


def build_digits(path: Path, seed: int = 0) -> tuple[Path, float]:
    """Train a 64->128->10 MLP on sklearn's digits; return the path and its test accuracy."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.neural_network import MLPClassifier

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, random_state=seed, stratify=y
    )
    clf = MLPClassifier(hidden_layer_sizes=(128,), max_iter=400, random_state=seed)
    clf.fit(x_train, y_train)
    accuracy = float(clf.score(x_test, y_test))
    weights = list(zip(clf.coefs_, clf.intercepts_, strict=True))
    model = _dense_graph(
        "digits", weights, "pixels", "logits", softmax_output="probabilities", argmax_output="label"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    np.savez(path.parent.parent / "test_set.npz", x=x_test, y=y_test)
    example = {
        "inputs": [
            {"name": "pixels", "shape": [1, 64], "datatype": "FP32", "data": x_test[0].tolist()}
        ],
        "outputs": [{"name": "label"}, {"name": "probabilities"}],
    }
    (path.parent.parent / "example_request.json").write_text(json.dumps(example))
    return path, accuracy


MLP_CONFIG = """\
# The benchmark MLP (256->512->512->10). Inputs and outputs are read from the ONNX graph.
max_batch_size: 32
dynamic_batching:
  max_queue_delay_us: 200
  preferred_batch_sizes: [32]
  max_queue_size: 2048
instance_count: 1
onnxruntime:
  intra_op_threads: 1
  inter_op_threads: 1
  graph_optimization_level: all
warmup:
  batch_sizes: [1, 8, 32]
  iterations: 3
"""

DIGITS_CONFIG = """\
# sklearn digits classifier: 8x8 grey images scaled to [0, 1], flattened to 64 floats.
max_batch_size: 64
inputs:
  - {name: pixels, datatype: FP32, shape: [64]}
outputs:
  - {name: logits, datatype: FP32, shape: [10]}
  - {name: probabilities, datatype: FP32, shape: [10]}
  - {name: label, datatype: INT64, shape: []}
dynamic_batching:
  max_queue_delay_us: 500
  max_queue_size: 1024
instance_count: 1
onnxruntime:
  intra_op_threads: 1
warmup:
  batch_sizes: [1]
  iterations: 2
"""


def build_repository(out: Path) -> dict[str, float]:
    out.mkdir(parents=True, exist_ok=True)
    build_mlp(out / "mlp" / "1" / "model.onnx")
    (out / "mlp" / "config.yaml").write_text(MLP_CONFIG)
    _, accuracy = build_digits(out / "digits" / "1" / "model.onnx")
    (out / "digits" / "config.yaml").write_text(DIGITS_CONFIG)
    facts = {"digits_test_accuracy": accuracy}
    (out / "facts.json").write_text(json.dumps(facts, indent=2))
    return facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("examples/repository"))
    args = parser.parse_args()
    facts = build_repository(args.out)
    print(f"built {args.out}: mlp, digits (test accuracy {facts['digits_test_accuracy']:.4f})")


if __name__ == "__main__":
    main()
