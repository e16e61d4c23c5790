"""Write a chosen variant into the server's model repository.

Layout: ``<repo>/<name>/config.yaml`` and ``<repo>/<name>/<version>/model.onnx`` (or
``model.ort`` for a variant in the ORT format), with
``optimization.json`` next to ``config.yaml`` recording the choice and its measurements.
"""

from __future__ import annotations

import json
import pathlib
import shutil
from collections.abc import Sequence
from typing import Any

from rtserve.optimize.check import load_model
from rtserve.optimize.errors import OptimizeError
from rtserve.optimize.evaluate import Measurement

_DTYPES = {
    1: "FP32",
    10: "FP16",
    11: "FP64",
    7: "INT64",
    6: "INT32",
    3: "INT8",
    2: "UINT8",
    9: "BOOL",
}


def _tensor_entries(values: Any) -> list[dict[str, Any]]:
    entries = []
    for v in values:
        t = v.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
        entries.append(
            {"name": v.name, "datatype": _DTYPES.get(t.elem_type, "FP32"), "shape": dims[1:]}
        )
    return entries


def _next_version(model_dir: pathlib.Path) -> int:
    versions = [int(p.name) for p in model_dir.glob("*") if p.is_dir() and p.name.isdigit()]
    return max(versions, default=0) + 1


_ORT_TYPES = {f"tensor({k})": v for k, v in {
    "float": "FP32", "float16": "FP16", "double": "FP64", "int64": "INT64", "int32": "INT32",
    "int8": "INT8", "uint8": "UINT8", "bool": "BOOL",
}.items()}  # fmt: skip


def _signature(model_path: pathlib.Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(inputs, outputs) per row: from the graph, or from a session for an ``.ort`` file."""
    if model_path.suffix == ".ort":
        from rtserve.optimize.evaluate import open_session

        session = open_session(model_path, threads=1)

        def entries(args: Any) -> list[dict[str, Any]]:
            return [
                {
                    "name": a.name,
                    "datatype": _ORT_TYPES.get(a.type, "FP32"),
                    "shape": [d if isinstance(d, int) else -1 for d in a.shape][1:],
                }
                for a in args
            ]

        return entries(session.get_inputs()), entries(session.get_outputs())
    model = load_model(model_path)
    initializers = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializers]
    return _tensor_entries(inputs), _tensor_entries(model.graph.output)


def config_yaml(model_path: pathlib.Path, max_batch_size: int = 32, threads: int = 2) -> str:
    """The config.yaml text: per-row shapes (batch axis dropped) read from the model."""
    import yaml

    inputs, outputs = _signature(model_path)
    config: dict[str, Any] = {
        "max_batch_size": max_batch_size,
        "inputs": inputs,
        "outputs": outputs,
        "dynamic_batching": {
            "max_queue_delay_us": 500,
            "preferred_batch_sizes": [b for b in (8, 16, 32) if b <= max_batch_size],
            "max_queue_size": 1024,
        },
        "instance_count": 1,
        "onnxruntime": {
            "intra_op_threads": threads,
            "inter_op_threads": 1,
            "graph_optimization_level": "all",
            "execution_providers": ["CPU"],
        },
        "warmup": {"batch_sizes": [1, 8], "iterations": 2},
    }
    return str(yaml.safe_dump(config, sort_keys=False, default_flow_style=None))


def publish(
    out: pathlib.Path,
    chosen: Measurement,
    measurements: Sequence[Measurement],
    max_accuracy_drop: float,
    max_batch_size: int = 32,
) -> pathlib.Path:
    """Copy the chosen variant to ``out`` (``REPO/NAME``) as the next version; return its file."""
    out = pathlib.Path(out)
    if not out.name or out.name in (".", ".."):
        raise OptimizeError(f"--out must be REPO/NAME, got {out}")
    src = pathlib.Path(chosen.path)
    out.mkdir(parents=True, exist_ok=True)
    version = _next_version(out)
    vdir = out / str(version)
    vdir.mkdir()
    dst = vdir / ("model.ort" if src.suffix == ".ort" else "model.onnx")
    shutil.copyfile(src, dst)
    (out / "config.yaml").write_text(config_yaml(dst, max_batch_size))
    record = {
        "chosen": chosen.name,
        "version": version,
        "max_accuracy_drop": max_accuracy_drop,
        "rule": "fastest p50 at batch 1 within the accuracy budget",
        "measurements": [m.as_dict() for m in measurements],
    }
    (out / "optimization.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    return dst
