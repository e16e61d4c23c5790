"""Small ONNX and Python-backend models and repositories built for the tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx
import yaml
from onnx import TensorProto, helper

from examples.build_repository import build_digits, build_mlp
from rtserve.config import ModelConfig, parse_model_config

ALL_TYPES = {
    "FP32": TensorProto.FLOAT,
    "FP16": TensorProto.FLOAT16,
    "FP64": TensorProto.DOUBLE,
    "INT8": TensorProto.INT8,
    "INT16": TensorProto.INT16,
    "INT32": TensorProto.INT32,
    "INT64": TensorProto.INT64,
    "UINT8": TensorProto.UINT8,
    "BOOL": TensorProto.BOOL,
    "BYTES": TensorProto.STRING,
}


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def build_identity_all_types(path: Path) -> Path:
    """One Identity per datatype: input ``in_<T>`` [batch, 3] -> output ``out_<T>``."""
    nodes, inputs, outputs = [], [], []
    for name, elem in ALL_TYPES.items():
        inputs.append(helper.make_tensor_value_info(f"in_{name}", elem, ["batch", 3]))
        outputs.append(helper.make_tensor_value_info(f"out_{name}", elem, ["batch", 3]))
        nodes.append(helper.make_node("Identity", [f"in_{name}"], [f"out_{name}"]))
    graph = helper.make_graph(nodes, "identity_all_types", inputs, outputs)
    return _save(graph, path)


def build_scale(path: Path, factor: float) -> Path:
    """y = x * factor, x FP32 [batch, 4]: distinguishes model versions by their answer."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["y"])],
        "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor("k", TensorProto.FLOAT, [], [factor])],
    )
    return _save(graph, path)


def build_row_sum(path: Path) -> Path:
    """y[b] = sum(x[b, :]) with x FP32 [batch, seq]: a dynamic non-batch dimension."""
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)],
        "row_sum",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch"])],
        [helper.make_tensor("axes", TensorProto.INT64, [1], [1])],
    )
    return _save(graph, path)


def build_test_repository(root: Path) -> Path:
    build_mlp(root / "mlp" / "1" / "model.onnx")
    (root / "mlp" / "config.yaml").write_text(
        "max_batch_size: 32\n"
        "dynamic_batching: {max_queue_delay_us: 2000, preferred_batch_sizes: [32]}\n"
        "warmup: {batch_sizes: [1, 32], iterations: 1}\n"
    )
    build_mlp(root / "mlp_threads" / "1" / "model.onnx")
    (root / "mlp_threads" / "config.yaml").write_text(
        "max_batch_size: 16\n"
        "dynamic_batching: {max_queue_delay_us: 1000}\n"
        "instance_count: 2\n"
        "onnxruntime: {execution: thread}\n"
    )
    build_digits(root / "digits" / "1" / "model.onnx")
    (root / "digits" / "config.yaml").write_text("max_batch_size: 64\n")
    build_identity_all_types(root / "dtypes" / "1" / "model.onnx")
    (root / "dtypes" / "config.yaml").write_text("max_batch_size: 8\n")
    build_scale(root / "scale" / "1" / "model.onnx", 1.0)
    build_scale(root / "scale" / "2" / "model.onnx", 2.0)
    (root / "scale" / "config.yaml").write_text(
        "max_batch_size: 4\ndynamic_batching: {max_queue_delay_us: 100}\n"
    )
    # No config.yaml at all: everything is read from the graph, batching detected.
    build_scale(root / "noconfig" / "1" / "model.onnx", 5.0)
    build_row_sum(root / "ragged" / "1" / "model.onnx")
    (root / "ragged" / "config.yaml").write_text(
        "max_batch_size: 16\ndynamic_batching: {max_queue_delay_us: 5000}\n"
    )
    # A model whose config is wrong: it must not load, and must not stop the others.
    build_scale(root / "broken" / "1" / "model.onnx", 1.0)
    (root / "broken" / "config.yaml").write_text(
        "max_batch_size: 4\ndynamic_batching: {max_queue_size: 0}\n"
    )
    return root


def build_slow_repository(root: Path, max_queue_size: int, delay_us: int) -> Path:
    """A model whose requests wait ``delay_us`` in the queue: in flight long enough to test
    overload, timeouts and draining."""
    build_scale(root / "slow" / "1" / "model.onnx", 3.0)
    (root / "slow" / "config.yaml").write_text(
        "max_batch_size: 4\n"
        f"dynamic_batching: {{max_queue_delay_us: {delay_us}, max_queue_size: {max_queue_size},"
        " adaptive_delay: false}\n"
    )
    return root


DOUBLE_PY = """
import time

import numpy as np

class Model:
    def load(self, context):
        pass

    def infer(self, inputs):
        time.sleep(SLEEP)
        return {"y": (inputs["x"] * 2).astype(np.float32)}
"""


# The signature of ``double_py`` per row (FP32 ``x`` -> ``y``, one value each).
XY_ROWS = (
    "inputs: [{name: x, datatype: FP32, shape: [1]}]\n"
    "outputs: [{name: y, datatype: FP32, shape: [1]}]\n"
)


def double_py(sleep: float = 0.0) -> str:
    """A Python-backend model: ``y = 2 * x`` (FP32), after sleeping ``sleep`` s per batch."""
    return DOUBLE_PY.replace("SLEEP", repr(sleep))


def write_config(root: Path, name: str, config: dict[str, Any] | str) -> Path:
    """``root/name`` with an empty version 1 and a ``config.yaml`` (a dict is written as
    YAML, a string as it is): an ensemble, or a model whose files come next."""
    model_dir = root / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    text = config if isinstance(config, str) else yaml.safe_dump(config)
    (model_dir / "config.yaml").write_text(text)
    return model_dir


def write_python_model(root: Path, name: str, config: dict[str, Any] | str, model_py: str) -> Path:
    """``root/name`` with version 1's ``model.py`` and a ``config.yaml`` (see ``write_config``)."""
    model_dir = write_config(root, name, config)
    (model_dir / "1" / "model.py").write_text(model_py)
    return model_dir


def write_double_chain(root: Path) -> Path:
    """``chain``: an ensemble (max batch 8) of one step, the model ``double``, that takes
    ``X`` and answers ``Y``."""
    return write_config(
        root,
        "chain",
        "backend: ensemble\nmax_batch_size: 8\n"
        + XY_ROWS.replace("x,", "X,").replace("y,", "Y,")
        + "steps:\n  - {model: double, inputs: {x: X}, outputs: {y: Y}}\n",
    )


def config_of(model_dir: Path) -> ModelConfig:
    """The parsed ``config.yaml`` of ``model_dir``, as the repository loader reads it."""
    where = str(model_dir / "config.yaml")
    return parse_model_config(yaml.safe_load(Path(where).read_text()), model_dir.name, where)


def edit_config(model_dir: Path, change: dict[str, Any]) -> None:
    """Merge ``change`` into ``model_dir``'s ``config.yaml``; a ``None`` value removes the key."""
    path = model_dir / "config.yaml"
    data = {**yaml.safe_load(path.read_text()), **change}
    path.write_text(yaml.safe_dump({k: v for k, v in data.items() if v is not None}))
