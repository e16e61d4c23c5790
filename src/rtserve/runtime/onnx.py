"""ONNX Runtime backend: one InferenceSession per instance, threads fixed by config."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

from rtserve.config import AUTO_BATCH, DEFAULT_MAX_BATCH, ModelConfig, TensorSpec
from rtserve.errors import ConfigError, InvalidInput, runtime_message

log = logging.getLogger(__name__)
# What each other backend reads from a version directory, for the missing-model.onnx error.
_OTHER_BACKENDS = (
    ("model.py", "for Python code set backend: python (model.py)"),
    ("model.pt", "for TorchScript or torch.export set backend: torch (model.pt or model.pt2)"),
    ("model.tflite", "for LiteRT set backend: litert (model.tflite)"),
    ("", "for a pipeline of models set backend: ensemble (steps in config.yaml)"),
)
_LISTED_FILES = 10

_ORT_TYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}
_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "layout": getattr(
        ort.GraphOptimizationLevel, "ORT_ENABLE_LAYOUT", ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    ),
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
_PROVIDER_NAMES = {
    "CPU": "CPUExecutionProvider",
    "CUDA": "CUDAExecutionProvider",
    "TensorRT": "TensorrtExecutionProvider",
}


def available_providers(wanted: tuple[str, ...]) -> list[str]:
    """The configured providers this onnxruntime build has, CPU always last."""
    have = set(ort.get_available_providers())
    chosen = [_PROVIDER_NAMES[p] for p in wanted if p != "CPU" and _PROVIDER_NAMES[p] in have]
    return [*chosen, "CPUExecutionProvider"]


def _graph_specs(args: list[Any], batched: bool, where: str) -> list[TensorSpec]:
    specs = []
    for arg in args:
        dims = [d if isinstance(d, int) and d >= 0 else -1 for d in (arg.shape or [])]
        if batched:
            dims = dims[1:]
        datatype = _ORT_TYPES.get(arg.type)
        if datatype is None:
            raise ConfigError(
                f"{where}: tensor {arg.name!r} has type {arg.type}, which the V2 protocol "
                "cannot carry (tensors of numbers, bools or strings only)"
            )
        specs.append(TensorSpec(arg.name, datatype, tuple(dims)))
    return specs


def _zipmap_free(path: Path) -> tuple[bytes, dict[str, tuple[str, ...]]]:
    """The model with each ZipMap that makes a graph output removed, and the class labels of
    each output it made.

    Classifiers converted from scikit-learn (skl2onnx's default) end in a ZipMap: their
    probabilities come out as a sequence of maps (class label -> probability), which is not
    a tensor and has no place in the V2 protocol. ZipMap's input is the plain probability
    tensor ([batch, classes], FP32, columns in the order of its labels): that tensor is
    served under the output's name, and ORT skips building a dictionary per row."""
    model = onnx.load(str(path))
    graph = model.graph
    outputs = {o.name: o for o in graph.output}
    labels: dict[str, tuple[str, ...]] = {}
    for node in list(graph.node):
        if node.op_type != "ZipMap" or node.output[0] not in outputs:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        classes = attrs.get("classlabels_int64s") or attrs.get("classlabels_strings") or []
        name = node.output[0]
        labels[name] = tuple(c.decode() if isinstance(c, bytes) else str(c) for c in classes)
        graph.node.remove(node)
        graph.node.append(onnx.helper.make_node("Identity", [node.input[0]], [name]))
        out = outputs[name]
        out.type.CopyFrom(
            onnx.helper.make_tensor_type_proto(onnx.TensorProto.FLOAT, [None, len(classes)])
        )
    return model.SerializeToString(), labels


def _refuse_unknown_rank(path: Path, config: ModelConfig) -> None:
    """onnxruntime reports an input of unknown rank as a scalar's shape ``[]``; served as
    one, it would refuse every request that is not a scalar. Such an input's shape must be
    declared in the config (which then overrides the graph's)."""
    graph = onnx.load(str(path), load_external_data=False).graph
    initializers = {t.name for t in graph.initializer}
    for arg in graph.input:
        if arg.name in initializers or not arg.type.HasField("tensor_type"):
            continue
        if not arg.type.tensor_type.HasField("shape"):
            raise ConfigError(
                f"{config.source}: inputs: the model's input {arg.name!r} has no shape (any "
                "rank) in its graph; declare the inputs in the config, e.g. inputs: "
                f"[{{name: {arg.name}, datatype: ..., shape: [...]}}]"
            )


# Dimension names that exporters make up (ORT's shape inference, torch's unnamed axes):
# they say nothing about which axis is the batch.
_MADE_UP_DIM = re.compile(r"unk__\d+|.+_dynamic_axes_\d+")


def _dim_name(d: Any) -> str | None:
    """A dimension's name when the exporter gave it one that means something, else None."""
    return d if isinstance(d, str) and not _MADE_UP_DIM.fullmatch(d) else None


def _batchable(session: ort.InferenceSession) -> str:
    """Why requests cannot be stacked along the first dimension of every input and output
    ("" if they can): a fixed or missing first dimension, first dimensions named apart
    (``seq`` and ``batch``: not one axis), or a later dimension named as the batch (a
    time-major ``[seq, batch, ...]`` export)."""
    args = [*session.get_inputs(), *session.get_outputs()]
    for a in args:
        if not a.shape:
            return f"{a.name!r} has no first dimension"
        if isinstance(a.shape[0], int) and a.shape[0] > 0:
            return f"{a.name!r} has a fixed first dimension {a.shape[0]}"
    named = {a.name: first for a in args if (first := _dim_name(a.shape[0])) is not None}
    if len(set(named.values())) > 1:
        shown = ", ".join(f"{n!r}: {d!r}" for n, d in list(named.items())[:4])
        return f"the first dimensions have different names ({shown})"
    for a in args:
        for i, d in enumerate(a.shape[1:], 1):
            if isinstance(d, str) and "batch" in d.lower():
                return f"{a.name!r} names its dimension {i} {d!r}"
    return ""


def _shared_dims(args: list[Any]) -> list[tuple[str, list[tuple[str, int]]]]:
    """The dimension names that several inputs share (``seq`` of ``input_ids`` and
    ``attention_mask``), with the (input, axis) pairs that carry each."""
    groups: dict[str, list[tuple[str, int]]] = {}
    for a in args:
        for axis, d in enumerate(a.shape or []):
            name = _dim_name(d)
            if name is not None:
                groups.setdefault(name, []).append((a.name, axis))
    return [(d, members) for d, members in groups.items() if len({n for n, _ in members}) > 1]


def _scalars(path: Path) -> list[str]:
    """Inputs and outputs the graph declares rank 0 (ORT shows unknown rank the same)."""
    graph = onnx.load(str(path), load_external_data=False).graph
    initializers = {t.name for t in graph.initializer}
    return [
        arg.name
        for arg in [*graph.input, *graph.output]
        if arg.name not in initializers
        and arg.type.HasField("tensor_type")
        and arg.type.tensor_type.HasField("shape")
        and not arg.type.tensor_type.shape.dim
    ]


def _reconcile(
    configured: tuple[TensorSpec, ...] | None, graph: list[TensorSpec], kind: str, where: str
) -> tuple[TensorSpec, ...]:
    """Config entries override the graph's, but must name real tensors of the same type."""
    if configured is None:
        return tuple(graph)
    by_name = {s.name: s for s in graph}
    for i, spec in enumerate(configured):
        real = by_name.get(spec.name)
        if real is None:
            raise ConfigError(
                f"{where}: {kind}[{i}].name: {spec.name!r} is not a model {kind[:-1]} "
                f"(the model has {', '.join(by_name)})"
            )
        if real.datatype != spec.datatype:
            raise ConfigError(
                f"{where}: {kind}[{i}].datatype: the model's {spec.name!r} is "
                f"{real.datatype}, config says {spec.datatype}"
            )
    if kind == "inputs":
        missing = set(by_name) - {s.name for s in configured}
        if missing:
            raise ConfigError(
                f"{where}: inputs: model inputs missing from config: {sorted(missing)}"
            )
    return configured


def missing_model_message(version_dir: Path) -> str:
    """Why a version directory cannot be served as ONNX: what the directory holds and what
    each backend expects, the likeliest first (a forgotten ``backend: python`` said only
    "model.onnx not found")."""
    names = sorted(p.name for p in version_dir.iterdir()) if version_dir.is_dir() else []
    found = ", ".join(names[:_LISTED_FILES]) + (", ..." if len(names) > _LISTED_FILES else "")
    hints = sorted(
        _OTHER_BACKENDS, key=lambda h: not (h[0] and any(n.startswith(h[0]) for n in names))
    )
    return (
        f"{version_dir}: model.onnx not found, nor model.ort (backend: onnxruntime, the "
        "default); "
        f"the directory holds {found or 'no files'}; " + "; ".join(hint for _, hint in hints)
    )


def model_path(version_dir: Path) -> Path:
    """``model.onnx``, else ``model.ort`` (ONNX Runtime's format for edge and minimal builds,
    made by ``rtserve export-edge --format ort``)."""
    for name in ("model.onnx", "model.ort"):
        path = version_dir / name
        if path.exists():
            return path
    raise ConfigError(missing_model_message(version_dir))


class OnnxRuntimeModel:
    platform = "onnxruntime_onnx"

    def __init__(
        self,
        sessions: list[ort.InferenceSession],
        inputs: tuple[TensorSpec, ...],
        outputs: tuple[TensorSpec, ...],
        providers: list[str],
        max_batch_size: int,
        labels: dict[str, tuple[str, ...]] | None = None,
    ) -> None:
        self._sessions = sessions
        # Class labels of outputs a ZipMap made (see ``_zipmap_free``), in column order.
        self.labels = labels or {}
        self.max_batch_size = max_batch_size
        self.inputs = inputs
        self.outputs = outputs
        self.instance_count = len(sessions)
        self.providers = providers
        self._output_names = [o.name for o in outputs]
        self._runs = [s.run for s in sessions]
        self._string_inputs = [i.name for i in inputs if i.datatype == "BYTES"]
        self._string_outputs = [o.name for o in outputs if o.datatype == "BYTES"]
        self._shared_dims = _shared_dims(sessions[0].get_inputs())

    @classmethod
    def load(cls, config: ModelConfig, version_dir: Path) -> OnnxRuntimeModel:
        path = model_path(version_dir)
        opts = config.onnxruntime
        providers = available_providers(opts.execution_providers)
        sessions = cls._sessions_for(str(path), config, providers, 1)
        labels: dict[str, tuple[str, ...]] = {}
        if path.suffix == ".onnx" and any(
            o.type.startswith("seq(map(") for o in sessions[0].get_outputs()
        ):
            try:
                model_bytes, labels = _zipmap_free(path)
            except Exception as exc:  # a graph onnx cannot load or save: report the type below
                log.warning("%s: could not remove the model's ZipMap: %s", path, exc)
            else:
                if labels:  # the first session, of the graph with ZipMap, is not kept
                    sessions = cls._sessions_for(model_bytes, config, providers)
                    for name, classes in labels.items():
                        log.info(
                            "%s: output %r (a ZipMap of class probabilities) is served as an "
                            "FP32 tensor [batch, %d], columns in class order %s",
                            path, name, len(classes), list(classes),
                        )  # fmt: skip
        if len(sessions) < config.instance_count:
            sessions += cls._sessions_for(
                str(path), config, providers, config.instance_count - len(sessions)
            )
        s0 = sessions[0]
        max_batch = config.max_batch_size
        if max_batch == AUTO_BATCH:
            why_not = _batchable(s0)
            max_batch = 0 if why_not else DEFAULT_MAX_BATCH
            if why_not:
                log.info(
                    "%s: served without batching (max_batch_size 0): %s; set max_batch_size "
                    "in config.yaml if requests stack along the first dimension", path, why_not,
                )  # fmt: skip
        batched = max_batch > 0
        graph_inputs = _graph_specs(s0.get_inputs(), batched, str(path))
        graph_outputs = _graph_specs(s0.get_outputs(), batched, str(path))
        if batched and path.suffix == ".onnx":
            scalars = [a.name for a in [*s0.get_inputs(), *s0.get_outputs()] if not a.shape]
            scalars = [n for n in _scalars(path) if n in scalars] if scalars else []
            if scalars:
                raise ConfigError(
                    f"{config.source}: max_batch_size: {scalars[0]!r} is a scalar (rank 0) "
                    "in the model; batching stacks requests along a first dimension it "
                    "does not have (set max_batch_size: 0)"
                )
        if batched:
            for arg in [*s0.get_inputs(), *s0.get_outputs()]:
                first = arg.shape[0] if arg.shape else None
                if isinstance(first, int) and first > 0 and max_batch > 1:
                    raise ConfigError(
                        f"{config.source}: max_batch_size: {arg.name!r} has a fixed first "
                        f"dimension {first}; batching needs a dynamic batch axis "
                        "(or set max_batch_size: 0)"
                    )
        inputs = _reconcile(config.inputs, graph_inputs, "inputs", config.source)
        outputs = _reconcile(config.outputs, graph_outputs, "outputs", config.source)
        if (
            config.inputs is None
            and path.suffix == ".onnx"
            and any(not i.shape for i in s0.get_inputs())
        ):
            _refuse_unknown_rank(path, config)
        return cls(sessions, inputs, outputs, providers, max_batch, labels)

    @staticmethod
    def _sessions_for(
        model: str | bytes, config: ModelConfig, providers: list[str], count: int = 0
    ) -> list[ort.InferenceSession]:
        """``count`` (default: ``config.instance_count``) sessions of ``model`` (a path, or
        the model's bytes)."""
        opts = config.onnxruntime
        where = model if isinstance(model, str) else config.source
        sessions = []
        for _ in range(count or config.instance_count):
            so = ort.SessionOptions()
            so.intra_op_num_threads = opts.intra_op_threads
            so.inter_op_num_threads = opts.inter_op_threads
            so.graph_optimization_level = _LEVELS[opts.graph_optimization_level]
            so.log_severity_level = 3
            if opts.intra_op_threads == 1:
                # No thread pool to spin: keeps the event loop's core free between batches.
                so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            try:
                sessions.append(ort.InferenceSession(model, so, providers=providers))
            except Exception as exc:  # onnxruntime raises several unrelated types
                raise ConfigError(f"{where}: onnxruntime could not load the model: {exc}") from exc
        return sessions

    def run(self, instance: int, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for dim, members in self._shared_dims:
            sizes = [(n, feeds[n].shape[a]) for n, a in members if n in feeds]
            if len({size for _, size in sizes}) > 1:  # (ORT would fail deep in the graph)
                names = " and ".join(repr(n) for n, _ in sizes[:4])
                got = " and ".join(str(size) for _, size in sizes[:4])
                raise InvalidInput(
                    f"inputs {names} share the model's dimension {dim!r} and must agree "
                    f"there, got {got}"
                )
        if self._string_inputs:
            feeds = dict(feeds)
            for name in self._string_inputs:
                feeds[name] = _to_str_array(feeds[name], name)
        try:
            results = self._runs[instance](self._output_names, feeds)
        except InvalidArgument as exc:  # the data, not the model (shapes were checked)
            raise InvalidInput(f"ONNX Runtime refused the input: {runtime_message(exc)}") from None
        out = dict(zip(self._output_names, results, strict=True))
        for name in self._string_outputs:
            out[name] = _to_bytes_array(out[name])
        return out

    def close(self) -> None:
        self._sessions.clear()
        self._runs.clear()


def _to_str_array(arr: np.ndarray, name: str) -> np.ndarray:
    """BYTES tensors hold bytes; onnxruntime's string tensors take UTF-8 text (its Python
    API has no way to pass other bytes), so anything else is the client's error."""
    out = np.empty(arr.shape, dtype=object)
    flat_in = arr.reshape(-1)
    flat_out = out.reshape(-1)
    for i, item in enumerate(flat_in):
        try:
            flat_out[i] = item.decode() if isinstance(item, bytes) else str(item)
        except UnicodeDecodeError as exc:
            raise InvalidInput(
                f"input '{name}': element {i} is not UTF-8 text ({exc.reason} at byte "
                f"{exc.start}); this model's string tensors take UTF-8"
            ) from None
    return out


def _to_bytes_array(arr: np.ndarray) -> np.ndarray:
    out = np.empty(arr.shape, dtype=object)
    flat_in = arr.reshape(-1)
    flat_out = out.reshape(-1)
    for i, item in enumerate(flat_in):
        flat_out[i] = item.encode("utf-8", "surrogateescape") if isinstance(item, str) else item
    return out


def load(config: ModelConfig, version_dir: Path) -> OnnxRuntimeModel:
    """The backend entry point (see ``core.factory.BACKENDS``)."""
    return OnnxRuntimeModel.load(config, version_dir)
