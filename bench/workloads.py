"""The two workloads: the transport-bound MLP and the compute-bound MiniLM encoder."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

from bench.peers.common import TensorSpec

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench" / ".work"
MINILM_SEQ_LEN = 32


@dataclass(frozen=True)
class Workload:
    """A model every peer serves, the request every client sends, and the load grid."""

    name: str
    model_name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    intra_op_threads: int
    open_loop_rates: tuple[float, ...]
    build: Callable[[Path], Path]
    sample: Callable[[], dict[str, np.ndarray]]

    def model_path(self) -> Path:
        path = WORK / "models" / self.name / "model.onnx"
        if not path.exists():
            tmp = path.with_suffix(".tmp.onnx")
            self.build(tmp)
            tmp.rename(path)
        return path

    def v2_body(self) -> bytes:
        """The one-row V2 JSON request every HTTP peer gets."""
        rows = zip(self.inputs, self.sample().values(), strict=True)
        return orjson.dumps(
            {
                "inputs": [
                    {
                        "name": spec.name,
                        "shape": list(array.shape),
                        "datatype": spec.datatype,
                        "data": _plain(array),
                    }
                    for spec, array in rows
                ]
            }
        )

    def perf_analyzer_data(self) -> str:
        """The same row as a perf_analyzer ``--input-data`` file (shapes without the batch axis)."""
        step = {
            spec.name: {"content": _plain(array), "shape": list(spec.row_shape)}
            for spec, array in zip(self.inputs, self.sample().values(), strict=True)
        }
        return json.dumps({"data": [step]})


def _plain(array: np.ndarray) -> list[float] | list[int]:
    """Values as short JSON numbers (float32 rows would print with 17 digits otherwise)."""
    flat = array.reshape(-1)
    if flat.dtype.kind == "f":
        return [round(float(v), 6) for v in flat]
    return [int(v) for v in flat]


def _build_mlp(path: Path) -> Path:
    spec = importlib.util.spec_from_file_location(
        "_rtserve_examples_build", ROOT / "examples" / "build_repository.py"
    )
    if spec is None or spec.loader is None:
        raise RuntimeError("examples/build_repository.py not found")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return Path(module.build_mlp(path))


def _mlp_sample() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    row = np.round(rng.uniform(-1.0, 1.0, size=(1, 256)), 4).astype(np.float32)
    return {"input": row}


def _build_minilm(path: Path) -> Path:
    from bench.showcase.zoo import export_minilm

    return Path(export_minilm(path, seq_len=MINILM_SEQ_LEN))


_SENTENCE = "A real-time inference server batches requests to keep the model busy."


def _minilm_sample() -> dict[str, np.ndarray]:
    cache = WORK / "models" / "minilm" / "sample.json"
    if cache.exists():
        data = json.loads(cache.read_text())
        return {k: np.asarray(v, dtype=np.int64) for k, v in data.items()}
    from rtserve.optimize.text import minilm_tokenize

    feeds = minilm_tokenize([_SENTENCE], seq_len=MINILM_SEQ_LEN)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({k: v.tolist() for k, v in feeds.items()}))
    return feeds


MLP = Workload(
    name="mlp",
    model_name="mlp",
    inputs=(TensorSpec("input", "FP32", (256,)),),
    outputs=(TensorSpec("output", "FP32", (10,)),),
    intra_op_threads=1,
    open_loop_rates=(250, 500, 1000, 2000, 4000, 8000, 12000),
    build=_build_mlp,
    sample=_mlp_sample,
)

MINILM = Workload(
    name="minilm",
    model_name="minilm",
    inputs=(
        TensorSpec("input_ids", "INT64", (MINILM_SEQ_LEN,)),
        TensorSpec("attention_mask", "INT64", (MINILM_SEQ_LEN,)),
    ),
    outputs=(TensorSpec("embedding", "FP32", (384,)),),
    intra_op_threads=2,
    open_loop_rates=(25, 50, 100, 200, 300, 400, 600),
    build=_build_minilm,
    sample=_minilm_sample,
)

WORKLOADS = {w.name: w for w in (MLP, MINILM)}
