"""LiteRT backend: a ``.tflite`` model run by ``ai_edge_litert``'s Interpreter, the runtime
that ships to phones and ARM boards, so what goes to devices can be checked behind the same
API (batcher, cache, metrics) as the ONNX and torch models.

One Interpreter per instance (an Interpreter is not thread-safe). Names come from the
model's signature (``litert_torch`` writes the names given at conversion), else from the
tensors. Inputs and outputs quantized to INT8/UINT8 (a fully quantized model) are served as
FP32 and converted with the tensor's scale and zero point, so that clients send the same
floats to the INT8 model as to the FP32 one (``float_io: false`` serves the raw integers).

Batching: a model whose first dimensions are dynamic (-1) batches by default; an edge
model exported at batch 1 batches when ``max_batch_size`` is set, by resizing its inputs
(checked at load: a graph with a fixed reshape refuses it). The interpreter is resized and
re-allocated only when the input shapes change.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from rtserve.config import AUTO_BATCH, DEFAULT_MAX_BATCH, ModelConfig, TensorSpec, _Fields
from rtserve.errors import ConfigError, InvalidInput, runtime_message

_TYPES: dict[Any, str] = {
    np.bool_: "BOOL",
    np.uint8: "UINT8",
    np.int8: "INT8",
    np.int16: "INT16",
    np.int32: "INT32",
    np.int64: "INT64",
    np.float16: "FP16",
    np.float32: "FP32",
    np.float64: "FP64",
}
_QUANTIZED = (np.int8, np.uint8)


@dataclasses.dataclass(frozen=True)
class LiteRTOptions:
    file: str = "model.tflite"
    num_threads: int = 1
    float_io: bool = True


def parse_options(config: ModelConfig) -> LiteRTOptions:
    f = _Fields(config.backend_options, config.source, "litert")
    opts = LiteRTOptions(
        file=f.string("file", "model.tflite"),
        num_threads=f.integer("num_threads", 1, minimum=1),
        float_io=f.boolean("float_io", True),
    )
    f.check_unknown()
    return opts


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One served input or output: its tensor index, and its quantization when the served
    values are floats that the model holds as integers."""

    name: str
    index: int
    dtype: Any
    scale: float = 0.0
    zero_point: int = 0

    @property
    def quantized(self) -> bool:
        return self.scale != 0.0


def _tensors(details: dict[str, dict[str, Any]], float_io: bool, where: str) -> list[_Tensor]:
    out = []
    for name, d in details.items():
        q = d.get("quantization_parameters", {})
        scales = np.asarray(q.get("scales", ()))
        if float_io and d["dtype"] in _QUANTIZED and scales.size:
            if scales.size != 1:
                raise ConfigError(
                    f"{where}: litert.float_io: tensor {name!r} is quantized per axis; only "
                    "per-tensor quantized inputs/outputs can be served as FP32 (set float_io: "
                    "false to serve the raw integers)"
                )
            zero = int(np.asarray(q["zero_points"]).reshape(-1)[0])
            out.append(_Tensor(name, d["index"], d["dtype"], float(scales[0]), zero))
        else:
            out.append(_Tensor(name, d["index"], d["dtype"]))
    return out


def _datatype(t: _Tensor, where: str) -> str:
    if t.quantized:
        return "FP32"
    datatype = _TYPES.get(t.dtype)
    if datatype is None:
        raise ConfigError(f"{where}: tensor {t.name!r} has unsupported type {t.dtype}")
    return datatype


def _signature_details(interp: Any, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Inputs and outputs by name: the one signature's names, else the tensors' own."""
    signatures = interp.get_signature_list()
    if len(signatures) > 1:
        raise ConfigError(
            f"{where}: the model has {len(signatures)} signatures ({', '.join(signatures)}); "
            "backend litert serves models with one"
        )
    if signatures:
        runner = interp.get_signature_runner(next(iter(signatures)))
        return runner.get_input_details(), runner.get_output_details()
    return (
        {d["name"]: d for d in interp.get_input_details()},
        {d["name"]: d for d in interp.get_output_details()},
    )


class Instance:
    """One interpreter with its tensors; resized only when the input shapes change."""

    def __init__(self, interp: Any, inputs: list[_Tensor], outputs: list[_Tensor]) -> None:
        self.interpreter = interp
        self.inputs = inputs
        self.outputs = outputs
        self._shapes: tuple[tuple[int, ...], ...] = tuple(
            tuple(interp.get_tensor(t.index).shape) for t in inputs
        )

    def resize(self, shapes: tuple[tuple[int, ...], ...]) -> None:
        for t, shape in zip(self.inputs, shapes, strict=True):
            self.interpreter.resize_tensor_input(t.index, list(shape), strict=False)
        self.interpreter.allocate_tensors()
        self._shapes = shapes

    def output_rows(self) -> dict[str, int]:
        return {t.name: int(self.interpreter.get_tensor(t.index).shape[0]) for t in self.outputs}

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        shapes = tuple(feeds[t.name].shape for t in self.inputs)
        if shapes != self._shapes:
            self.resize(shapes)
        interp = self.interpreter
        for t in self.inputs:
            value = feeds[t.name]
            if t.quantized:
                value = _quantize(value, t)
            elif value.dtype != t.dtype:  # (int64 token ids for an int32 input)
                value = value.astype(t.dtype)
            interp.set_tensor(t.index, value)
        try:
            interp.invoke()
        except RuntimeError as exc:  # a kernel's check on the data: an index out of range
            raise InvalidInput(f"LiteRT could not run this input: {runtime_message(exc)}") from None
        out = {}
        for t in self.outputs:
            value = interp.get_tensor(t.index)
            out[t.name] = _dequantize(value, t) if t.quantized else value
        return out


def _quantize(value: np.ndarray, t: _Tensor) -> np.ndarray:
    if np.isnan(value).any():
        raise InvalidInput(
            f"input {t.name!r}: NaN has no {np.dtype(t.dtype).name} value (the model's input "
            "is quantized)"
        )
    info = np.iinfo(t.dtype)
    q = np.rint(value / t.scale) + t.zero_point
    return np.clip(q, info.min, info.max).astype(t.dtype)


def _dequantize(value: np.ndarray, t: _Tensor) -> np.ndarray:
    return ((value.astype(np.float32) - t.zero_point) * np.float32(t.scale)).astype(np.float32)


def _interpreter(path: Path, threads: int) -> Any:
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError as exc:
        raise ConfigError(
            f"{path}: backend litert needs the LiteRT interpreter: pip install "
            "'rtserve[edge]' (ai-edge-litert)"
        ) from exc
    try:
        interp = Interpreter(model_path=str(path), num_threads=threads)
        interp.allocate_tensors()
    except Exception as exc:  # the interpreter raises ValueError and RuntimeError alike
        raise ConfigError(f"{path}: LiteRT could not load the model: {exc}") from exc
    return interp


def open_instance(path: Path, threads: int = 1, float_io: bool = True) -> Instance:
    """One interpreter on ``path`` with the server's handling of inputs and outputs (also
    what ``rtserve export-edge`` times and checks)."""
    where = str(path)
    interp = _interpreter(path, threads)
    try:
        ins, outs = _signature_details(interp, where)
        return Instance(interp, _tensors(ins, float_io, where), _tensors(outs, float_io, where))
    except ConfigError:
        raise
    except Exception as exc:  # a damaged file can still load (a tensor name not UTF-8)
        raise ConfigError(f"{path}: LiteRT could not read the model's tensors: {exc}") from exc


class LiteRTModel:
    platform = "litert_tflite"

    def __init__(
        self,
        instances: list[Instance],
        inputs: tuple[TensorSpec, ...],
        outputs: tuple[TensorSpec, ...],
        max_batch_size: int,
    ) -> None:
        self._instances = instances
        self.inputs = inputs
        self.outputs = outputs
        self.max_batch_size = max_batch_size
        self.instance_count = len(instances)

    @classmethod
    def load(cls, config: ModelConfig, version_dir: Path) -> LiteRTModel:
        opts = parse_options(config)
        path = version_dir / opts.file
        if not path.is_file():
            raise ConfigError(
                f"{version_dir}: {opts.file} not found (backend: litert serves a .tflite file; "
                "litert.file names another; rtserve export-edge --format litert makes one)"
            )
        where = str(path)
        instances = [
            open_instance(path, opts.num_threads, opts.float_io)
            for _ in range(config.instance_count)
        ]
        in_details, out_details = _signature_details(instances[0].interpreter, where)
        inputs, outputs = instances[0].inputs, instances[0].outputs
        max_batch = _max_batch(config, [*in_details.values(), *out_details.values()])
        batched = max_batch > 0

        def specs(tensors: list[_Tensor], details: dict[str, Any]) -> tuple[TensorSpec, ...]:
            return tuple(
                TensorSpec(
                    t.name,
                    _datatype(t, where),
                    tuple(int(d) for d in details[t.name]["shape_signature"][int(batched) :]),
                )
                for t in tensors
            )

        in_specs, out_specs = specs(inputs, in_details), specs(outputs, out_details)
        model = cls(instances, in_specs, out_specs, max_batch)
        if batched:
            model._check_resizable(config, max_batch)
        return model

    def _check_resizable(self, config: ModelConfig, rows: int) -> None:
        """Every instance resized to ``rows`` rows, and the outputs follow: the graph has no
        reshape fixed at the exported batch size."""
        shapes = tuple((rows, *(max(d, 1) for d in s.shape)) for s in self.inputs)
        for instance in self._instances:
            try:
                instance.resize(shapes)
            except Exception as exc:
                raise ConfigError(
                    f"{config.source}: max_batch_size: the model cannot be resized to "
                    f"{rows} rows ({exc}); export it with a dynamic batch or set "
                    "max_batch_size: 0"
                ) from exc
        for name, got in self._instances[0].output_rows().items():
            if got != rows:
                raise ConfigError(
                    f"{config.source}: max_batch_size: output {name!r} has {got} rows "
                    f"for {rows} input rows; the graph fixes its batch size (set "
                    "max_batch_size: 0)"
                )

    def run(self, instance: int, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._instances[instance].run(feeds)

    def close(self) -> None:
        self._instances.clear()


def _max_batch(config: ModelConfig, details: list[dict[str, Any]]) -> int:
    """The config's, or (auto) the default when every tensor's first dimension is dynamic."""
    if config.max_batch_size != AUTO_BATCH:
        if config.max_batch_size > 0 and any(len(d["shape_signature"]) == 0 for d in details):
            raise ConfigError(
                f"{config.source}: max_batch_size: the model has a scalar input or output; "
                "set max_batch_size: 0"
            )
        return config.max_batch_size
    dynamic = all(len(d["shape_signature"]) and d["shape_signature"][0] == -1 for d in details)
    return DEFAULT_MAX_BATCH if dynamic else 0


def load(config: ModelConfig, version_dir: Path) -> LiteRTModel:
    """The backend entry point (see ``core.factory.BACKENDS``)."""
    return LiteRTModel.load(config, version_dir)
