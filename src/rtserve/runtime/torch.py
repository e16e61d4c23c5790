"""PyTorch backend: TorchScript (``model.pt``), ``torch.export`` programs (``model.pt2``)
or a ``factory: "module:function"`` (+ ``weights``) imported from the version directory.

Only this module imports torch, and only when a torch model is loaded.

With CUDA graphs (``compile: reduce-overhead`` / ``max-autotune`` on CUDA) each instance
runs on its own dedicated thread: the graphs are recorded per thread, so warmup and serving
must happen on the same one. ``batch_buckets`` pads every batch up to the next bucket so each bucket's
graph is compiled (and captured) once at load and reused; outputs are sliced back.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib.util
import logging
import re
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rtserve.config import AUTO_BATCH, DEFAULT_MAX_BATCH, ModelConfig, TensorSpec, _Fields
from rtserve.errors import ConfigError, InferenceFailed, InvalidInput, runtime_message
from rtserve.protocol.types import DATATYPE_TO_NUMPY
from rtserve.runtime.early_exit import MODES, THRESHOLD, ExitRunner, threshold_parameter
from rtserve.runtime.parameters import RowParameter
from rtserve.runtime.python import check_outputs, require_signature

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_COMPILE = ("none", "default", "reduce-overhead", "max-autotune")
_TORCH_TYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "UINT8": torch.uint8,
    "INT8": torch.int8,
    "INT16": torch.int16,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "FP16": torch.float16,
    "FP32": torch.float32,
    "FP64": torch.float64,
}
_FLOATS = ("FP16", "FP32", "FP64")


@dataclasses.dataclass(frozen=True)
class EarlyExitOptions:
    """``torch.early_exit``: the default ``exit_threshold``, how a batch exits (``rows``
    leave it or ``all`` answer first) and the output that says which exit answered."""

    threshold: float = 0.9
    batch: str = "rows"
    output: str = "exit_layer"


@dataclasses.dataclass(frozen=True)
class TorchOptions:
    file: str = ""
    factory: str = ""
    factory_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    weights: str = ""
    device: str = "auto"
    dtype: str = "float32"
    compile: str = "none"
    batch_buckets: tuple[int, ...] = ()
    pin_memory: bool = True
    channels_last: bool = False
    warmup_iterations: int = 3
    early_exit: EarlyExitOptions | None = None


def _early_exit_options(f: _Fields) -> EarlyExitOptions | None:
    if "early_exit" not in f.data:
        f.get("early_exit")
        return None
    if f.get("early_exit") is None:  # (`early_exit:` with nothing under it)
        raise f.fail("early_exit", "a mapping ({} for the defaults)", None)
    ef = f.sub("early_exit")
    threshold = ef.number(
        "threshold", EarlyExitOptions.threshold, 0.0, 1.0, "a top-class probability"
    )
    opts = EarlyExitOptions(
        threshold=threshold,
        batch=ef.string("batch", EarlyExitOptions.batch, MODES),
        output=ef.string("output", EarlyExitOptions.output),
    )
    ef.check_unknown()
    return opts


def parse_options(config: ModelConfig) -> TorchOptions:
    f = _Fields(config.backend_options, config.source, "torch")
    factory = f.string("factory", "")
    if factory and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", factory):
        raise f.fail("factory", '"module:function" (module.py in the version directory)', factory)
    factory_args = f.get("factory_args", {})
    if not isinstance(factory_args, dict):
        raise f.fail("factory_args", "a mapping of keyword arguments", factory_args)
    device = f.string("device", "auto")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise f.fail("device", "auto, cpu, cuda or cuda:N", device)
    opts = TorchOptions(
        file=f.string("file", ""),
        factory=factory,
        factory_args=dict(factory_args),
        weights=f.string("weights", ""),
        device=device,
        dtype=f.string("dtype", "float32", tuple(_DTYPES)),
        compile=f.string("compile", "none", _COMPILE),
        batch_buckets=tuple(sorted(set(f.int_list("batch_buckets")))),
        pin_memory=f.boolean("pin_memory", True),
        channels_last=f.boolean("channels_last", False),
        warmup_iterations=f.integer("warmup_iterations", 3, minimum=1),
        early_exit=_early_exit_options(f),
    )
    if opts.weights and not opts.factory:
        raise f.fail("weights", "weights only together with factory", opts.weights)
    if opts.file and opts.factory:
        raise f.fail("file", "either file or factory, not both", opts.file)
    f.check_unknown()
    return opts


def _resolve_device(opts: TorchOptions, where: str) -> torch.device:
    if opts.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(opts.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{where}: torch.device: {opts.device} asked for, but CUDA is not available"
            )
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"{where}: torch.device: {opts.device} asked for, but this machine has "
                f"{torch.cuda.device_count()} CUDA device(s)"
            )
        device = torch.device("cuda", index)
    return device


def _import_factory(version_dir: Path, factory: str, unique: str) -> Any:
    module_name, func_name = factory.split(":")
    path = version_dir / (module_name.replace(".", "/") + ".py")
    if not path.exists():
        raise ConfigError(f"{path}: not found (torch.factory {factory!r})")
    spec = importlib.util.spec_from_file_location(f"rtserve_torch_{unique}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(version_dir))
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ConfigError(f"{path}: import failed: {type(exc).__name__}: {exc}") from exc
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(str(version_dir))
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ConfigError(f"{path}: no function {func_name!r} (torch.factory {factory!r})")
    return func


def _check_early_exit(config: ModelConfig, opts: TorchOptions, max_batch: int) -> str:
    """The logits output of an early-exit model (the declared output that is not the exit's)."""
    early = opts.early_exit
    assert early is not None and config.inputs is not None and config.outputs is not None
    where = config.source
    if max_batch == 0:
        raise ConfigError(f"{where}: torch.early_exit: needs batching (max_batch_size >= 1)")
    if opts.compile != "none" or opts.batch_buckets:
        raise ConfigError(
            f"{where}: torch.early_exit: runs eager, without compile or batch_buckets"
        )
    if any(s.name == THRESHOLD for s in config.inputs):
        raise ConfigError(f"{where}: inputs: {THRESHOLD!r} is the early exit's request parameter")
    names = [s.name for s in config.outputs]
    others = [n for n in names if n != early.output]
    exit_spec = next((s for s in config.outputs if s.name == early.output), None)
    if exit_spec is None or exit_spec.datatype != "INT32" or len(others) != 1:
        raise ConfigError(
            f"{where}: outputs: an early-exit model declares two outputs, its logits and "
            f"{early.output!r} (INT32, shape []: the depth of the exit that answered); got "
            + ", ".join(f"{o.name} {o.datatype}" for o in config.outputs)
        )
    return others[0]


def _load_module(config: ModelConfig, version_dir: Path, opts: TorchOptions) -> tuple[Any, str]:
    """The model as a callable module on the CPU, and what it was loaded from."""
    where = config.source
    if opts.factory:
        func = _import_factory(version_dir, opts.factory, f"{config.name}_{version_dir.name}")
        try:
            module = func(**opts.factory_args)
        except Exception as exc:
            raise ConfigError(
                f"{where}: torch.factory: {opts.factory} failed: {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(module, torch.nn.Module):
            raise ConfigError(
                f"{where}: torch.factory: {opts.factory} returned "
                f"{type(module).__name__}, expected a torch.nn.Module"
            )
        if opts.weights:
            path = version_dir / opts.weights
            if not path.exists():
                raise ConfigError(f"{where}: torch.weights: {path} not found")
            try:
                state = torch.load(path, map_location="cpu", weights_only=True)
                if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
                    state = state["state_dict"]
                module.load_state_dict(state)
            except Exception as exc:
                raise ConfigError(
                    f"{where}: torch.weights: {path} could not be loaded into the model: {exc}"
                ) from exc
        return module, "factory"
    candidates = [opts.file] if opts.file else ["model.pt2", "model.pt"]
    for name in candidates:
        path = version_dir / name
        if not path.exists():
            continue
        try:
            if path.suffix == ".pt2":
                return torch.export.load(str(path)).module(), "export"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # still widely deployed
                return torch.jit.load(str(path), map_location="cpu"), "torchscript"
        except Exception as exc:
            raise ConfigError(f"{path}: torch could not load the model: {exc}") from exc
    raise ConfigError(
        f"{version_dir}: no {' or '.join(candidates)} found "
        "(backend torch: a TorchScript model.pt, a torch.export model.pt2, or torch.factory)"
    )


class TorchModel:
    platform = "pytorch_libtorch"

    def __init__(
        self,
        config: ModelConfig,
        module: Any,
        opts: TorchOptions,
        device: torch.device,
        kind: str,
        logits: str = "",
    ) -> None:
        """``logits``: an early-exit model's logits output (see ``torch.early_exit``)."""
        assert config.inputs is not None and config.outputs is not None
        self.name = config.name
        self.inputs: tuple[TensorSpec, ...] = config.inputs
        self.outputs: tuple[TensorSpec, ...] = config.outputs
        self.max_batch_size = config.max_batch_size
        self.instance_count = config.instance_count
        self.device = device
        self.kind = kind
        self.options = opts
        self._module = module
        self._dtype = _DTYPES[opts.dtype]
        self._cuda = device.type == "cuda"
        self._pin = self._cuda and opts.pin_memory
        self._buckets = opts.batch_buckets
        self._input_names = [s.name for s in self.inputs]
        self._cast = {s.name: self._dtype if s.datatype in _FLOATS else None for s in self.inputs}
        self._in_types = {s.name: _TORCH_TYPES[s.datatype] for s in self.inputs}
        self._out_types = {s.name: _TORCH_TYPES[s.datatype] for s in self.outputs}
        self._fixed = all(-1 not in s.shape for s in self.inputs)
        early = opts.early_exit
        self._exit: ExitRunner | None = None
        self.row_parameters: tuple[RowParameter, ...] = ()
        if early is not None:
            self._exit = ExitRunner(
                module, logits, early.output, early.batch, early.threshold,
                self.instance_count, config.source,
            )  # fmt: skip
            self.row_parameters = (threshold_parameter(early.threshold),)
            self.exit_counts = self._exit.counts
            self.reset_exit_counts = self._exit.reset
        # Per instance: pinned staging buffers keyed by (name, rows) / (name, shape).
        self._staging: list[dict[Any, torch.Tensor]] = [{} for _ in range(self.instance_count)]
        graphs = opts.compile in ("reduce-overhead", "max-autotune")
        if graphs and self._cuda:  # imported here, the loading thread keeps its own state
            import torch._inductor.cudagraph_trees  # noqa: F401
        self._threads = (
            [
                ThreadPoolExecutor(
                    1,
                    thread_name_prefix=f"torch-{config.name}-{i}",
                    initializer=_cuda_graph_thread if graphs else None,
                )
                for i in range(self.instance_count)
            ]
            if self._cuda and graphs
            else []
        )

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, config: ModelConfig, version_dir: Path) -> TorchModel:
        require_signature(config, "torch")
        assert config.inputs is not None and config.outputs is not None
        opts = parse_options(config)
        where = config.source
        for kind, specs in (("inputs", config.inputs), ("outputs", config.outputs)):
            for i, spec in enumerate(specs):
                if spec.datatype not in _TORCH_TYPES:
                    raise ConfigError(
                        f"{where}: {kind}[{i}].datatype: backend torch supports "
                        f"{', '.join(_TORCH_TYPES)}, got {spec.datatype}"
                    )
        max_batch = config.max_batch_size
        buckets = opts.batch_buckets
        if max_batch == AUTO_BATCH:
            max_batch = buckets[-1] if buckets else DEFAULT_MAX_BATCH
        if buckets and max_batch == 0:
            raise ConfigError(
                f"{where}: torch.batch_buckets: no buckets without batching (max_batch_size 0)"
            )
        if buckets and max_batch > buckets[-1]:
            raise ConfigError(
                f"{where}: torch.batch_buckets: the largest bucket ({buckets[-1]}) must be >= "
                f"max_batch_size ({max_batch})"
            )
        config = dataclasses.replace(config, max_batch_size=max_batch)
        logits = _check_early_exit(config, opts, max_batch) if opts.early_exit else ""
        device = _resolve_device(opts, where)
        module, kind = _load_module(config, version_dir, opts)
        if kind == "torchscript" and opts.compile != "none":
            raise ConfigError(
                f"{where}: torch.compile: {opts.compile} needs an eager module (factory) or a "
                "torch.export program (model.pt2); TorchScript models run as they are"
            )
        with contextlib.suppress(AttributeError, RuntimeError):
            module = module.eval()
        module = module.to(device=device)
        if opts.dtype != "float32":
            module = module.to(dtype=_DTYPES[opts.dtype])
        if opts.channels_last:
            module = module.to(memory_format=torch.channels_last)
        if opts.compile != "none":
            limit = max(64, 4 * len(buckets) * config.instance_count + 8)
            for knob in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, knob):
                    setattr(
                        torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), limit)
                    )
            mode = None if opts.compile == "default" else opts.compile
            module = torch.compile(module, mode=mode, dynamic=False if buckets else None)
        model = cls(config, module, opts, device, kind, logits)
        try:
            start = time.perf_counter()
            model.warmup()
            log.info(
                "torch model %s (%s) on %s %s, compile %s: warmed %s in %.1f s",
                config.name, kind, device, opts.dtype, opts.compile,
                list(buckets) or [1, max_batch], time.perf_counter() - start,
            )  # fmt: skip
        except Exception as exc:
            model.close()
            raise ConfigError(
                f"{version_dir}: torch warmup failed: {type(exc).__name__}: {exc}"
            ) from exc
        return model

    def warmup(self) -> None:
        """Run every bucket on every instance (compiles graphs, captures CUDA graphs)."""
        batched = self.max_batch_size > 0
        sizes = list(self._buckets) or ([1, self.max_batch_size] if batched else [1])
        for instance in range(self.instance_count):
            for rows in sorted(set(sizes)):
                feeds = {}
                for spec in self.inputs:
                    dims = tuple(d if d >= 0 else 1 for d in spec.shape)
                    shape = (rows, *dims) if batched else dims
                    feeds[spec.name] = np.zeros(shape, DATATYPE_TO_NUMPY[spec.datatype])
                for _ in range(self.options.warmup_iterations):
                    self.run(instance, feeds)

    # ------------------------------------------------------------------ serving
    def run(self, instance: int, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._threads:
            return self._threads[instance].submit(self._run, instance, feeds).result()
        return self._run(instance, feeds)

    def _bucket(self, rows: int) -> int:
        for b in self._buckets:
            if b >= rows:
                return b
        return rows

    def _run(self, instance: int, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        batched = self.max_batch_size > 0
        rows = next(iter(feeds.values())).shape[0] if batched else 0
        padded = self._bucket(rows) if batched and self._buckets else rows
        staging = self._staging[instance]
        args = []
        for name in self._input_names:
            arr = feeds[name]
            if self._pin and self._fixed:
                key = (name, padded if batched else 0)
                host = staging.get(key)
                if host is None:
                    shape = (padded, *arr.shape[1:]) if batched else arr.shape
                    host = torch.zeros(shape, dtype=self._in_types[name], pin_memory=True)
                    staging[key] = host
                host.numpy()[: arr.shape[0] if batched else None] = arr
                tensor = host.to(self.device, non_blocking=True)
            else:
                if padded > rows:
                    pad = np.zeros((padded - rows, *arr.shape[1:]), arr.dtype)
                    arr = np.concatenate([arr, pad])
                tensor = torch.from_numpy(np.ascontiguousarray(arr)).to(self.device)
            cast = self._cast[name]
            if cast is not None and tensor.dtype != cast:
                tensor = tensor.to(cast)
            if self.options.channels_last and tensor.dim() == 4:
                tensor = tensor.contiguous(memory_format=torch.channels_last)
            args.append(tensor)
        try:
            with torch.inference_mode():
                if self._exit is not None:
                    thresholds = feeds.get(THRESHOLD)
                    result = self._exit.run(
                        self._module,
                        args,
                        None if thresholds is None else torch.from_numpy(thresholds),
                        instance,
                    )
                else:
                    result = self._module(*args)
                outs = self._collect(result)
                host_outs = self._to_host(outs, rows if batched else None, staging)
        except InferenceFailed:
            raise
        except Exception as exc:
            log.exception("torch model %s: forward failed", self.name)
            message = runtime_message(exc)  # (a TorchScript traceback stays in the log)
            if isinstance(exc, IndexError) or "index out of range" in message:
                # an embedding index the table lacks: the request's ids (run alone, if batched)
                raise InvalidInput(
                    f"torch model '{self.name}' refused the input: {message}"
                ) from None
            if not message.partition(":")[0].endswith(("Error", "Exception")):
                message = f"{type(exc).__name__}: {message}"
            raise InferenceFailed(f"torch model '{self.name}': {message}") from None
        return check_outputs(host_outs, self.outputs, rows if batched else None, self.name)

    def _collect(self, result: Any) -> dict[str, torch.Tensor]:
        names = [s.name for s in self.outputs]
        if isinstance(result, torch.Tensor):
            result = (result,)
        if isinstance(result, dict):
            return {str(k): v for k, v in result.items()}
        if isinstance(result, list | tuple) and len(result) == len(names):
            return dict(zip(names, result, strict=True))
        got = len(result) if isinstance(result, list | tuple) else type(result).__name__
        raise InferenceFailed(
            f"torch model '{self.name}' returned {got} outputs; declared {names} "
            "(return a tensor, a tuple in declared order, or a dict by name)"
        )

    def _to_host(
        self, outs: dict[str, torch.Tensor], rows: int | None, staging: dict[Any, torch.Tensor]
    ) -> dict[str, np.ndarray]:
        host: dict[str, np.ndarray] = {}
        pinned: list[tuple[str, torch.Tensor]] = []
        for name, t in outs.items():
            if not isinstance(t, torch.Tensor):
                raise InferenceFailed(
                    f"torch model '{self.name}' output {name!r} is {type(t).__name__}, not a tensor"
                )
            if rows is not None and t.dim() > 0:
                t = t[:rows]
            want = self._out_types.get(name)
            if want is not None and t.dtype != want:
                t = t.to(want)
            if self._pin:
                key = (name, tuple(t.shape), t.dtype)
                buf = staging.get(key)
                if buf is None:
                    if len(staging) > 256:  # variable shapes: do not hoard pinned memory
                        staging.clear()
                    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    staging[key] = buf
                buf.copy_(t, non_blocking=True)
                pinned.append((name, buf))
            else:
                host[name] = t.detach().to("cpu").contiguous().numpy()
        if pinned:
            torch.cuda.current_stream(self.device).synchronize()
            for name, buf in pinned:
                host[name] = buf.numpy().copy()  # the buffer is reused by the next batch
        return host

    def close(self) -> None:
        for pool in self._threads:
            pool.shutdown(wait=True)
        self._threads = []
        self._staging = []
        self._module = None
        if self._cuda:
            torch.cuda.empty_cache()


def _cuda_graph_thread() -> None:
    """Give this thread its own CUDA-graph tree manager. Inductor keeps them in thread-local
    state set up only in the thread that imported it (other threads fail an assertion)."""
    from torch._inductor import cudagraph_trees

    local = cudagraph_trees.local
    if not hasattr(local, "tree_manager_containers"):
        local.tree_manager_containers = {}
        local.tree_manager_locks = collections.defaultdict(threading.Lock)


def load(config: ModelConfig, version_dir: Path) -> TorchModel:
    """The backend entry point (see ``core.factory.BACKENDS``)."""
    return TorchModel.load(config, version_dir)
