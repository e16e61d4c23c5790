"""What every peer app shares: its settings, the ONNX session, V2 JSON in and out, batching.

Imported inside the peers' own virtual environments: depends on numpy, onnxruntime and orjson
only. Settings arrive as JSON in the ``BENCH_PEER`` environment variable.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort
import orjson

V2_DTYPES: dict[str, Any] = {
    "FP32": np.float32,
    "FP64": np.float64,
    "INT64": np.int64,
    "INT32": np.int32,
}
NUMPY_TO_V2: dict[str, str] = {np.dtype(v).name: k for k, v in V2_DTYPES.items()}
TRITON_TYPES: dict[str, str] = {k: f"TYPE_{k}" for k in V2_DTYPES}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    row_shape: tuple[int, ...]

    @property
    def dtype(self) -> Any:
        return V2_DTYPES[self.datatype]


@dataclass(frozen=True)
class PeerSettings:
    """What a peer serves and how: one model, one ORT configuration, one batching policy."""

    model_name: str
    model_path: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    intra_op_threads: int = 1
    inter_op_threads: int = 1
    max_batch_size: int = 32
    max_wait_ms: float = 0.5
    workdir: str = "."

    def to_json(self) -> str:
        data = dict(self.__dict__)
        data["inputs"] = [t.__dict__ for t in self.inputs]
        data["outputs"] = [t.__dict__ for t in self.outputs]
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> PeerSettings:
        data = json.loads(text)
        for key in ("inputs", "outputs"):
            data[key] = tuple(
                TensorSpec(t["name"], t["datatype"], tuple(t["row_shape"])) for t in data[key]
            )
        return cls(**data)


def settings() -> PeerSettings:
    return PeerSettings.from_json(os.environ["BENCH_PEER"])


def session(cfg: PeerSettings) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = cfg.intra_op_threads
    opts.inter_op_num_threads = cfg.inter_op_threads
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(cfg.model_path, opts, providers=["CPUExecutionProvider"])


Feeds = dict[str, np.ndarray]


def decode_v2(body: bytes | bytearray | str | dict[str, Any], cfg: PeerSettings) -> Feeds:
    """V2 JSON request (``{"inputs": [{"name", "shape", "datatype", "data"}]}``) to arrays."""
    doc = body if isinstance(body, dict) else orjson.loads(body)
    specs = {t.name: t for t in cfg.inputs}
    feeds: Feeds = {}
    for item in doc["inputs"]:
        spec = specs[item["name"]]
        feeds[spec.name] = np.asarray(item["data"], dtype=spec.dtype).reshape(item["shape"])
    return feeds


def encode_v2(outputs: Feeds, cfg: PeerSettings) -> bytes:
    """V2 JSON response; orjson writes the numpy arrays directly."""
    return orjson.dumps(v2_dict(outputs, cfg, plain=False), option=orjson.OPT_SERIALIZE_NUMPY)


def v2_dict(outputs: Feeds, cfg: PeerSettings, plain: bool = True) -> dict[str, Any]:
    """The V2 response; ``plain``: values as lists, for frameworks that serialise answers
    themselves (else the arrays, for ``encode_v2``)."""
    return {
        "model_name": cfg.model_name,
        "outputs": [
            {
                "name": name,
                "datatype": NUMPY_TO_V2[array.dtype.name],
                "shape": list(array.shape),
                "data": array.reshape(-1).tolist() if plain else array.reshape(-1),
            }
            for name, array in outputs.items()
        ],
    }


def run(sess: ort.InferenceSession, feeds: Feeds, cfg: PeerSettings) -> Feeds:
    names = [t.name for t in cfg.outputs]
    return dict(zip(names, sess.run(names, feeds), strict=True))


def run_batch(sess: ort.InferenceSession, requests: list[Feeds], cfg: PeerSettings) -> list[Feeds]:
    """Stack the requests' rows, run once, and hand each request its rows back."""
    if len(requests) == 1:
        return [run(sess, requests[0], cfg)]
    stacked = {t.name: np.concatenate([r[t.name] for r in requests]) for t in cfg.inputs}
    merged = run(sess, stacked, cfg)
    first = cfg.inputs[0].name
    results: list[Feeds] = []
    start = 0
    for request in requests:
        stop = start + request[first].shape[0]
        results.append({name: array[start:stop] for name, array in merged.items()})
        start = stop
    return results
