"""Python backend: the user's ``class Model`` in ``<version>/model.py``.

``isolation: thread`` (default) runs ``infer`` in the server process, on the batcher's
executor thread; ``isolation: process`` gives each instance its own worker process
(multiprocessing spawn), with tensors passed through shared memory. A worker that
raises, exits, is killed or hangs past ``batch_timeout_s`` fails only its batch; it is
restarted in the background and the next batch on that instance waits for it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from rtserve.config import ModelConfig, TensorSpec, _Fields
from rtserve.errors import ConfigError, InferenceFailed, InstanceFailed, SharedMemoryFull
from rtserve.extras import install_hint
from rtserve.protocol.types import DATATYPE_TO_NUMPY
from rtserve.runtime import _shm

log = logging.getLogger(__name__)

Tensors = dict[str, np.ndarray]


@dataclass(frozen=True)
class ModelContext:
    """What ``Model.load(context)`` receives."""

    model_name: str
    model_version: str
    model_dir: Path
    version_dir: Path
    config: ModelConfig
    device: str
    instance: int
    parameters: dict[str, Any] = field(default_factory=dict)  # ``python.parameters``


@dataclass(frozen=True)
class PythonOptions:
    isolation: str = "thread"
    batch_timeout_s: float = 0.0  # 0: no limit
    load_timeout_s: float = 300.0
    device: str = "cpu"
    parameters: dict[str, Any] = field(default_factory=dict)


def parse_options(config: ModelConfig) -> PythonOptions:
    f = _Fields(config.backend_options, config.source, "python")
    isolation = f.string("isolation", "thread", ("thread", "process"))
    if isolation == "thread" and "load_timeout_s" in f.data:  # (it would be ignored)
        raise f.fail(
            "load_timeout_s",
            "no value with isolation: thread (a thread's load() cannot be stopped; use "
            "isolation: process)",
            f.data["load_timeout_s"],
        )
    opts = PythonOptions(
        isolation=isolation,
        batch_timeout_s=f.number("batch_timeout_s", 30.0 if isolation == "process" else 0.0),
        load_timeout_s=f.number("load_timeout_s", 300.0, minimum=1.0),
        device=f.string("device", "cpu"),
        parameters=f.get("parameters") or {},
    )
    if not isinstance(opts.parameters, dict):
        raise f.fail(
            "parameters", "a mapping (handed to Model.load as context.parameters)", opts.parameters
        )
    f.check_unknown()
    return opts


def require_signature(config: ModelConfig, backend: str) -> None:
    """Python and torch models have no graph to read: inputs and outputs must be declared."""
    for kind in ("inputs", "outputs"):
        if getattr(config, kind) is None:
            raise ConfigError(
                f"{config.source}: {kind}: required for backend {backend} "
                "(a list of {name, datatype, shape})"
            )


class _UserError(Exception):
    """User code failed; ``message`` is for clients, ``detail`` (traceback) for the log;
    ``instance``: the instance hung or died (not an exception from ``infer``)."""

    def __init__(self, message: str, detail: str = "", instance: bool = False) -> None:
        super().__init__(message)
        self.detail = detail
        self.instance = instance


def _import_model_class(version_dir: Path, unique: str) -> type:
    path = version_dir / "model.py"
    if not path.exists():
        raise ConfigError(f"{version_dir}: model.py not found (backend python)")
    spec = importlib.util.spec_from_file_location(f"rtserve_user_{unique}", path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{path}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    try:
        with _on_path(version_dir):
            spec.loader.exec_module(module)
    except Exception as exc:
        hint = install_hint(exc)
        raise ConfigError(f"{path}: import failed: {type(exc).__name__}: {exc}{hint}") from exc
    cls = getattr(module, "Model", None)
    if not isinstance(cls, type) or not callable(getattr(cls, "infer", None)):
        raise ConfigError(f"{path}: expected a class Model with an infer(self, inputs) method")
    return cls


@contextlib.contextmanager
def _on_path(directory: Path) -> Iterator[None]:
    """Sibling modules of model.py import normally while it is imported and loaded."""
    sys.path.insert(0, str(directory))
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(str(directory))


def _new_model(cls: type, context: ModelContext) -> Any:
    where = context.version_dir / "model.py"
    try:
        model = cls()
        if callable(getattr(model, "load", None)):
            with _on_path(context.version_dir):
                model.load(context)
    except Exception as exc:
        log.error("model %s: load failed\n%s", context.model_name, traceback.format_exc())
        hint = install_hint(exc)
        raise ConfigError(f"{where}: Model.load failed: {type(exc).__name__}: {exc}{hint}") from exc
    return model


def _unload(model: Any, name: str) -> None:
    unload = getattr(model, "unload", None)
    if callable(unload):
        try:
            unload()
        except Exception:
            log.exception("model %s: unload failed", name)


def _call_infer(model: Any, feeds: Tensors) -> Tensors:
    try:
        result = model.infer(feeds)
    except BaseException as exc:  # SystemExit, KeyboardInterrupt too: user code must not
        # stop the server or its instance (the server's own signals never raise here)
        raise _UserError(f"{type(exc).__name__}: {exc}", traceback.format_exc()) from exc
    if not isinstance(result, dict):
        raise _UserError(f"infer returned {type(result).__name__}, expected a dict of arrays")
    return {str(k): v if isinstance(v, np.ndarray) else np.asarray(v) for k, v in result.items()}


def _bytes_inputs(feeds: Tensors, names: list[str]) -> Tensors:
    """BYTES inputs reach user code as object arrays of ``bytes`` (str is encoded)."""
    if not names:
        return feeds
    feeds = dict(feeds)
    for name in names:
        arr = feeds[name]
        flat = arr.reshape(-1)
        if arr.dtype != object or any(type(x) is not bytes for x in flat):
            items = np.empty(flat.shape[0], dtype=object)
            for i, x in enumerate(flat):
                items[i] = _shm._as_bytes(x)
            feeds[name] = items.reshape(arr.shape)
    return feeds


def check_outputs(
    outputs: Tensors, specs: tuple[TensorSpec, ...], rows: int | None, model: str
) -> Tensors:
    """The declared outputs, each of its declared datatype and shape (``rows`` first when
    batching); anything else is a clear error naming the model and the tensor."""
    got = set(outputs)
    want = [s.name for s in specs]
    if got != set(want):
        missing = [n for n in want if n not in got]
        extra = sorted(got - set(want))
        raise InferenceFailed(
            f"model '{model}' returned outputs {sorted(got)}; declared {want}"
            + (f" (missing {missing})" if missing else "")
            + (f" (undeclared {extra})" if extra else "")
        )
    checked: Tensors = {}
    for spec in specs:
        arr = outputs[spec.name]
        if spec.datatype == "BYTES":
            if arr.dtype != object and arr.dtype.kind not in "SU":
                raise InferenceFailed(
                    f"model '{model}' output {spec.name!r}: expected BYTES "
                    f"(an object array of bytes), got dtype {arr.dtype}"
                )
            try:
                arr = _bytes_inputs({spec.name: arr}, [spec.name])[spec.name]
            except TypeError as exc:  # an element that is not bytes or str
                raise InferenceFailed(f"model '{model}' output {spec.name!r}: {exc}") from None
        elif arr.dtype != DATATYPE_TO_NUMPY[spec.datatype]:
            raise InferenceFailed(
                f"model '{model}' output {spec.name!r}: expected datatype {spec.datatype} "
                f"({DATATYPE_TO_NUMPY[spec.datatype]}), got {arr.dtype}"
            )
        dims = tuple(arr.shape[1:]) if rows is not None else tuple(arr.shape)
        if rows is not None and (arr.ndim == 0 or arr.shape[0] != rows):
            raise InferenceFailed(
                f"model '{model}' output {spec.name!r}: expected {rows} rows along "
                f"dimension 0 (one per input row), got shape {list(arr.shape)}"
            )
        if len(dims) != len(spec.shape) or any(
            d != s and s != -1 for d, s in zip(dims, spec.shape, strict=False)
        ):
            what = "per-row shape" if rows is not None else "shape"
            raise InferenceFailed(
                f"model '{model}' output {spec.name!r}: expected {what} {list(spec.shape)}, "
                f"got {list(dims)}"
            )
        checked[spec.name] = arr
    return checked


# ---------------------------------------------------------------------- thread isolation
class _Runner:
    """A daemon thread that runs calls for one instance, so a hung call can be abandoned
    (a daemon thread never blocks interpreter exit)."""

    def __init__(self, name: str) -> None:
        self._jobs: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        with self._cond:
            self._jobs.append((fn, fut))
            self._cond.notify()
        return fut

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    self._cond.wait()
                fn, fut = self._jobs.pop(0)
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)


class _ThreadInstance:
    def __init__(self, cls: type, context: ModelContext, timeout_s: float) -> None:
        self._cls = cls
        self._context = context
        self._timeout = timeout_s
        self.model: Any = _new_model(cls, context)
        self._runner = _Runner(f"py-{context.model_name}-{context.instance}") if timeout_s else None
        self._replacing: threading.Thread | None = None

    def infer(self, feeds: Tensors) -> Tensors:
        if self._replacing is not None:
            self._replacing.join()
            self._replacing = None
        if self._runner is None:
            return _call_infer(self.model, feeds)
        model = self.model
        fut = self._runner.submit(lambda: _call_infer(model, feeds))
        try:
            return fut.result(self._timeout)
        except TimeoutError:
            # The hung thread cannot be stopped: abandon it with its model, start afresh.
            self._runner = _Runner(f"py-{self._context.model_name}-{self._context.instance}")
            self._replacing = threading.Thread(target=self._reload, daemon=True)
            self._replacing.start()
            raise _UserError(
                f"infer did not finish within batch_timeout_s={self._timeout:g} s "
                "(the instance was replaced)",
                instance=True,
            ) from None

    def _reload(self) -> None:
        try:
            self.model = _new_model(self._cls, self._context)
        except ConfigError:
            log.exception("model %s: reload after a timeout failed", self._context.model_name)

    def close(self) -> None:
        _unload(self.model, self._context.model_name)


# ---------------------------------------------------------------------- process isolation
def _worker_main(conn: Connection, version_dir: str, unique: str, context: ModelContext) -> None:
    """The worker process: load the model, then serve batches until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when workers stop
    sys.path.insert(0, version_dir)
    try:
        cls = _import_model_class(Path(version_dir), unique)
        model = _new_model(cls, context)
    except Exception as exc:
        conn.send(("load_error", str(exc)))
        return
    conn.send(("ready", os.getpid()))
    inputs = _shm.Attached()
    outputs = _shm.Attached()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the server went away
            break
        if msg[0] == "stop":
            break
        _, in_name, in_layout, out_name, out_size = msg
        try:
            feeds = _shm.read(inputs.attach(in_name), in_layout, copy=False)
            result = _call_infer(model, feeds)
            layout, payloads, total = _shm.plan(result)
            full = ""
            if total <= out_size:
                try:
                    _shm.write(outputs.attach(out_name, total), layout, payloads)
                    conn.send(("ok", layout))
                    continue
                except SharedMemoryFull as exc:
                    full = exc.message
            # Too big for the segment this time, or no room in /dev/shm: pickle it.
            conn.send(("big", result, total, full))
        except _UserError as exc:
            conn.send(("error", str(exc), exc.detail))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    _unload(model, context.model_name)


class _WorkerDied(Exception):
    pass


class _ProcessInstance:
    def __init__(
        self, version_dir: Path, unique: str, context: ModelContext, options: PythonOptions
    ) -> None:
        self._version_dir = version_dir
        self._unique = unique
        self._context = context
        self._options = options
        tag = _shm.segment_tag(context.instance)
        self._in = _shm.Segment(tag + "in")
        self._out = _shm.Segment(tag + "out")
        self._mp = multiprocessing.get_context("spawn")
        self._proc: Any = None
        self._conn: Connection | None = None
        self._restart: threading.Thread | None = None
        self._restart_error: BaseException | None = None
        self.restarts = 0
        self._warned_full = False
        self._start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _start(self) -> None:
        parent, child = self._mp.Pipe(duplex=True)
        proc = self._mp.Process(
            target=_worker_main,
            args=(child, str(self._version_dir), self._unique, self._context),
            name=f"rtserve-{self._context.model_name}-{self._context.instance}",
            daemon=True,
        )
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        where = self._version_dir / "model.py"
        if not parent.poll(self._options.load_timeout_s):
            self._kill()
            raise ConfigError(
                f"{where}: the worker did not load within "
                f"load_timeout_s={self._options.load_timeout_s:g} s"
            )
        try:
            msg = parent.recv()
        except EOFError:
            code = self._reap()
            raise ConfigError(f"{where}: the worker process died while loading ({code})") from None
        if msg[0] != "ready":
            self._reap()
            raise ConfigError(msg[1])

    def _reap(self) -> str:
        """Wait for the dead worker; describe how it ended."""
        proc = self._proc
        if proc is None:
            return "no process"
        proc.join(5)
        if proc.exitcode is None:
            proc.kill()
            proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None
        code = proc.exitcode
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    def _kill(self) -> None:
        if self._proc is not None and self._proc.exitcode is None:
            self._proc.kill()
        self._reap()

    def _restart_later(self) -> None:
        def restart() -> None:
            try:
                self._start()
                self.restarts += 1
                log.warning(
                    "model %s instance %d: worker restarted (pid %s)",
                    self._context.model_name, self._context.instance, self.pid,
                )  # fmt: skip
            except BaseException as exc:
                self._restart_error = exc
                log.error("model %s: worker restart failed: %s", self._context.model_name, exc)

        self._restart = threading.Thread(target=restart, daemon=True)
        self._restart.start()

    def _ready(self) -> Connection:
        if self._restart is not None:
            self._restart.join()
            self._restart = None
        if self._proc is not None and not self._proc.is_alive():  # died while idle
            how = self._reap()
            log.warning("model %s: idle worker died (%s)", self._context.model_name, how)
        if self._conn is None:  # a failed restart: try again now
            error = self._restart_error
            self._restart_error = None
            try:
                self._start()
            except ConfigError as exc:
                raise _UserError(f"worker could not be restarted: {exc}", instance=True) from error
        assert self._conn is not None
        return self._conn

    def infer(self, feeds: Tensors, out_hint: int) -> Tensors:
        conn = self._ready()
        layout, payloads, total = _shm.plan(feeds)
        self._room_for_inputs(total)
        _shm.write(self._in.buf, layout, payloads)
        self._out.ensure(out_hint)
        try:
            conn.send(("run", self._in.name, layout, self._out.name, self._out.size))
            timeout = self._options.batch_timeout_s
            if not conn.poll(timeout or None):
                self._kill()
                self._restart_later()
                raise _UserError(
                    f"infer did not finish within batch_timeout_s={timeout:g} s "
                    "(the worker was killed and is being restarted)",
                    instance=True,
                )
            reply = conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            how = self._reap()
            self._restart_later()
            raise _UserError(
                f"the worker process died during infer ({how}); it is being restarted",
                instance=True,
            ) from None
        if reply[0] == "ok":
            return _shm.read(self._out.buf, reply[1], copy=True)
        if reply[0] == "big":
            if reply[3]:
                self._outputs_through_pipe(reply[3])
            self._out.ensure(reply[2])
            result: Tensors = reply[1]
            return result
        raise _UserError(reply[1], reply[2])

    def _room_for_inputs(self, nbytes: int) -> None:
        """Reserve the input segment; when ``/dev/shm`` is full, free this instance's output
        segment and try once more, else refuse the batch (``SharedMemoryFull``, a 507)."""
        try:
            self._in.ensure(nbytes, "this batch's inputs")
        except SharedMemoryFull:
            self._out.release()
            self._in.ensure(nbytes, "this batch's inputs")

    def _outputs_through_pipe(self, why: str) -> None:
        if not self._warned_full:
            self._warned_full = True
            log.warning(
                "model %s instance %d: outputs cross the pipe (slower): %s",
                self._context.model_name, self._context.instance, why,
            )  # fmt: skip

    def close(self) -> None:
        if self._restart is not None:
            self._restart.join()
        if self._conn is not None and self._proc is not None:
            with contextlib.suppress(OSError):
                self._conn.send(("stop",))
            self._proc.join(10)
        self._kill()
        self._in.release()
        self._out.release()


# ---------------------------------------------------------------------- the runtime
class PythonModel:
    platform = "python"

    def __init__(
        self,
        config: ModelConfig,
        version_dir: Path,
        options: PythonOptions,
        instances: list[Any],
    ) -> None:
        assert config.inputs is not None and config.outputs is not None
        self.name = config.name
        self.inputs: tuple[TensorSpec, ...] = config.inputs
        self.outputs: tuple[TensorSpec, ...] = config.outputs
        self.max_batch_size = config.max_batch_size
        self.instance_count = len(instances)
        self.isolation = options.isolation
        self._instances = instances
        self._bytes_inputs = [s.name for s in self.inputs if s.datatype == "BYTES"]
        self._row_bytes = _fixed_row_bytes(self.outputs)
        self._log_name = f"{config.name}:{version_dir.name}"

    @classmethod
    def load(cls, config: ModelConfig, version_dir: Path) -> PythonModel:
        require_signature(config, "python")
        options = parse_options(config)
        if config.max_batch_size < 0:  # not set: no graph tells us; user code opts in
            import dataclasses

            config = dataclasses.replace(config, max_batch_size=0)
        unique = f"{config.name}_{version_dir.name}_{id(config):x}".replace("-", "_")
        instances: list[Any] = []
        try:
            if options.isolation == "thread":
                model_cls = _import_model_class(version_dir, unique)
            for i in range(config.instance_count):
                context = ModelContext(
                    model_name=config.name,
                    model_version=version_dir.name,
                    model_dir=version_dir.parent,
                    version_dir=version_dir,
                    config=config,
                    device=options.device,
                    instance=i,
                    parameters=dict(options.parameters),
                )
                if options.isolation == "thread":
                    instances.append(_ThreadInstance(model_cls, context, options.batch_timeout_s))
                else:
                    instances.append(_ProcessInstance(version_dir, unique, context, options))
        except BaseException:
            for inst in instances:
                inst.close()
            raise
        return cls(config, version_dir, options, instances)

    def worker_pids(self) -> list[int | None]:
        """The worker process of each instance (process isolation), for tests and tools."""
        return [getattr(inst, "pid", None) for inst in self._instances]

    def run(self, instance: int, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feeds = _bytes_inputs(feeds, self._bytes_inputs)
        rows = next(iter(feeds.values())).shape[0] if self.max_batch_size > 0 and feeds else None
        inst = self._instances[instance]
        try:
            if self.isolation == "thread":
                result = inst.infer(feeds)
            else:
                hint = (rows or 1) * self._row_bytes if self._row_bytes else 1 << 20
                result = inst.infer(feeds, hint)
        except _UserError as exc:
            if exc.detail:
                log.error("model %s: infer failed\n%s", self._log_name, exc.detail)
            failed = InstanceFailed if exc.instance else InferenceFailed
            raise failed(f"python model '{self.name}': {exc}") from None
        except SharedMemoryFull as exc:
            raise SharedMemoryFull(f"python model '{self.name}': {exc.message}") from None
        return check_outputs(result, self.outputs, rows, self.name)

    def close(self) -> None:
        for inst in self._instances:
            inst.close()
        self._instances.clear()


def _fixed_row_bytes(specs: tuple[TensorSpec, ...]) -> int:
    """Bytes of one row of every output when all are fixed-size numerics; 0 otherwise."""
    total = 0
    for spec in specs:
        if spec.datatype == "BYTES" or -1 in spec.shape:
            return 0
        n = int(np.prod(spec.shape, dtype=np.int64)) if spec.shape else 1
        total += n * DATATYPE_TO_NUMPY[spec.datatype].itemsize + 64
    return total


def load(config: ModelConfig, version_dir: Path) -> PythonModel:
    """The backend entry point (see ``core.factory.BACKENDS``)."""
    start = time.perf_counter()
    model = PythonModel.load(config, version_dir)
    log.info(
        "python model %s: %d instance(s), isolation %s, loaded in %.2f s",
        config.name, model.instance_count, model.isolation, time.perf_counter() - start,
    )  # fmt: skip
    return model
