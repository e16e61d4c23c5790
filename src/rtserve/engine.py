"""rtserve without sockets: the registry, model control, dataplane, metrics and response
cache in one object, for Python programs, serverless handlers and the servers themselves.

```python
async with Engine.from_repository("examples/repository") as engine:
    out = await engine.infer("mlp", {"input": np.random.rand(4, 256).astype(np.float32)})
with Engine.from_repository("examples/repository").sync() as engine:
    out = engine.infer("digits", {...})
async with Engine.from_repository("examples/llm-repository") as engine:
    async for event in engine.generate("smollm2", messages=[{"role": "user", "content": "Hi"}]):
        print(event.text, end="")
```

``infer`` goes through the same path as an HTTP or gRPC request (input checks, response
cache, the model's batcher and SLO controller, metrics), so concurrent calls batch together
and errors are the typed ``rtserve.errors`` the servers map to statuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from rtserve.config import ServerConfig, load_server_config
from rtserve.core import generation
from rtserve.core.capabilities import GENERATE
from rtserve.core.control import ModelControl
from rtserve.core.dataplane import DataPlane, statistics_of
from rtserve.core.info import ModelConfigInfo, ModelInfo
from rtserve.core.model import BuildContext, ModelVersion
from rtserve.core.registry import ModelRegistry
from rtserve.errors import ConfigError, InvalidInput, ShuttingDown
from rtserve.observability.metrics import Metrics
from rtserve.observability.tracing import Tracer
from rtserve.observability.workers import WorkerView
from rtserve.protocol.limits import DecodeLimits
from rtserve.protocol.types import (
    DATATYPE_TO_NUMPY,
    NUMPY_TO_DATATYPE,
    InferRequest,
    RequestedOutput,
    Tensor,
    Timings,
)
from rtserve.runtime.llm.options import PRIORITY_MIN
from rtserve.runtime.llm.params import SAMPLING_NAMES, GenerationEvent, SamplingParams

if TYPE_CHECKING:
    from rtserve.cache import CacheConfig

log = logging.getLogger("rtserve")
T = TypeVar("T")
# After the grace period, how long aborted generations have to send their last event.
ABORTED_S = 1.0


class Transport(Protocol):
    """A way in (an HTTP or gRPC server) as the engine's shutdown sees it."""

    def begin_drain(self) -> None:
        """Take no new requests (answer those accepted)."""

    @property
    def busy(self) -> bool:
        """A request it accepted is still being answered."""
        ...

    async def close(self, grace_s: float) -> None:
        """Stop; what is still running after ``grace_s`` is cut."""


def failed_message(failed: Mapping[str, str]) -> str:
    return "; ".join(f"model '{name}' failed to load: {why}" for name, why in failed.items())


_now = time.perf_counter_ns
_SYNC_LOCK = threading.Lock()  # (each engine's one SyncEngine is made once)


@dataclass(frozen=True)
class ModelStatus:
    """One model version as the repository index lists it."""

    name: str
    version: str
    state: str  # READY | UNAVAILABLE | LOADING
    reason: str = ""


def _cache_default(config: ServerConfig) -> CacheConfig | None:
    """The server-wide response cache config (validated; errors name the file and field)."""
    if config.response_cache is None:
        return None
    from rtserve.cache import CacheConfig

    return CacheConfig.from_dict(config.response_cache, config.config_file or "server config")


def _utf8(name: str, value: str | bytes) -> bytes:
    if isinstance(value, bytes):
        return value
    try:
        return value.encode()
    except UnicodeEncodeError:
        raise InvalidInput(f"inputs.{name}: a string that is not valid Unicode") from None


def _from_list(name: str, value: Any, datatype: str | None) -> np.ndarray:
    """A nested list as the model's ``datatype``, checked as the JSON decoder checks it:
    no wrapping of out-of-range integers, no truncated floats, no overflow to infinity."""
    try:
        raw = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"inputs.{name}: expected {datatype or 'an array'}: {exc}") from None
    dtype = DATATYPE_TO_NUMPY.get(datatype or "")
    if dtype is None or datatype == "BYTES" or raw.size == 0:
        return raw if dtype is None or datatype == "BYTES" else raw.astype(dtype)
    target = np.dtype(dtype)
    kind = raw.dtype.kind
    fail = f"inputs.{name}: expected {datatype} values"
    if kind not in "biuf":  # strings, objects (integers past 64 bits)
        raise InvalidInput(f"{fail}, got {raw.dtype} values")
    if target.kind == "b":
        if kind != "b":
            raise InvalidInput(f"{fail} (true / false), got {raw.dtype} values")
    elif kind == "b":  # (as in JSON: true / false are not numbers)
        raise InvalidInput(f"{fail}, got booleans")
    elif target.kind in "iu":
        info = np.iinfo(target)
        if kind == "f":  # (numpy reads ints past 2**63 mixed with smaller ones as floats)
            exact = np.asarray(value, dtype=object)
            if exact.shape != raw.shape or not all(type(v) is int for v in exact.flat):
                raise InvalidInput(f"{fail} (integers), got {raw.dtype} values")
            if min(exact.flat) < info.min or max(exact.flat) > info.max:
                raise InvalidInput(f"{fail}, which range from {info.min} to {info.max}")
            return exact.astype(target)
        if raw.min() < info.min or raw.max() > info.max:
            raise InvalidInput(f"{fail}, which range from {info.min} to {info.max}")
    elif kind == "f" or kind in "iu":
        finite = raw[np.isfinite(raw)] if kind == "f" else raw
        if finite.size and np.abs(finite).max() > np.finfo(target).max:
            raise InvalidInput(f"{fail}: a number beyond {datatype}'s range")
    return raw.astype(target)


def _tensor(name: str, value: Any, datatype: str | None) -> Tensor:
    """One named input as the decoders make it: a numpy array with its V2 datatype; strings
    and bytes become a BYTES tensor. A list takes the model's ``datatype`` for the input."""
    if isinstance(value, np.ndarray):
        array = value
        if not array.dtype.isnative:  # (a big-endian array: the machine's order)
            array = array.astype(array.dtype.newbyteorder("="))
    else:
        array = _from_list(name, value, datatype)
    if array.dtype.kind in "US":
        array = np.vectorize(
            lambda v: _utf8(name, v if isinstance(v, str) else bytes(v)), otypes=[object]
        )(array)
    elif array.dtype.kind == "O":
        if not all(isinstance(v, bytes | str) for v in array.flat):
            raise InvalidInput(f"inputs.{name}: an object array must hold str or bytes")
        array = np.vectorize(lambda v: _utf8(name, v), otypes=[object])(array)
    datatype = "BYTES" if array.dtype.kind == "O" else NUMPY_TO_DATATYPE.get(array.dtype)
    if datatype is None:
        raise InvalidInput(
            f"inputs.{name}: numpy dtype {array.dtype} has no V2 datatype "
            f"(expected one of {', '.join(str(d) for d in NUMPY_TO_DATATYPE)})"
        )
    return Tensor(name, datatype, tuple(array.shape), array)


class Engine:
    """The serving core in one process, without transports."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        # Frontends' hints that another request may arrive soon (``add_activity``).
        self._activity: list[Callable[[], bool]] = []
        self.registry = ModelRegistry(
            BuildContext(
                self.metrics,
                more_expected=self.more_expected,
                cache_default=_cache_default(config),
                decode_limits=DecodeLimits(
                    max_elements=config.max_tensor_elements,
                    max_bytes_elements=config.max_bytes_elements,
                    max_json_depth=config.max_json_depth,
                    max_json_containers=config.max_json_containers,
                ),
            ),
            root=config.model_repository,
        )
        shared = Path(config.shared_dir) if config.shared_dir else None
        self.workers = (
            WorkerView(
                shared,
                config.worker_index,
                self.metrics,
                lambda: statistics_of(self.registry.loaded_versions()),
            )
            if shared is not None
            else None
        )
        self.tracer = (
            Tracer(config.trace_endpoint, config.trace_sample_ratio)
            if config.trace_endpoint
            else None
        )
        self.dataplane = DataPlane(
            self.registry, self.metrics, self.workers, self.tracer, config.access_log
        )
        self.dataplane.strict_readiness = config.strict_readiness
        self.control = ModelControl(
            self.registry,
            config.model_repository,
            config.model_control_mode,
            config.repository_poll_secs,
            config.load_models,
            journal=shared / "model-control.jsonl" if shared is not None else None,
        )
        self.started = False
        self._began = False  # start() was called (it may have failed)
        self._stopped = False  # (an engine is started once)
        self._stop_done: asyncio.Event | None = None  # set once stop() has finished
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop that started it
        self._sync: SyncEngine | None = None
        self._transports: list[Transport] = []

    def add_activity(self, source: Callable[[], bool]) -> None:
        """Register a frontend's hint that another request may arrive soon (an idle
        keep-alive connection, calls a moment ago): while one says so, a batching policy
        may wait a little for more rows instead of running a small batch at once."""
        self._activity.append(source)

    def more_expected(self) -> bool:
        """Whether any frontend expects another request soon (never without frontends)."""
        return any(source() for source in self._activity)

    @classmethod
    def from_repository(cls, path: str | Path, **settings: Any) -> Engine:
        """An engine over a model repository; ``settings``: ``ServerConfig`` fields, e.g.
        ``model_control_mode="explicit"``, ``load_models=("mlp",)``, ``response_cache``."""
        return cls(load_server_config(None, model_repository=Path(path), **settings))

    def add_transport(self, transport: Transport) -> None:
        """A transport that ``stop`` drains and closes with the engine (``rtserve serve``'s
        HTTP and gRPC servers): one shutdown for every way in."""
        self._transports.append(transport)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Load and warm up the models (those that fail are listed by ``models()``; with
        ``exit_on_error`` one that fails stops the engine with a ``ConfigError``)."""
        if self._loop is not None:
            raise RuntimeError("the engine is already started")
        if self._stopped:
            raise RuntimeError("an Engine cannot be started again after stop(); create a new one")
        self._loop = asyncio.get_running_loop()
        self._began = True
        try:
            await self.control.start()
        except BaseException:
            self._loop = None
            raise
        failed = self.registry.failed()
        if self.config.exit_on_error and failed:
            await self.stop(0)  # (nothing was served: nothing to drain)
            raise ConfigError(failed_message(failed))
        if self.workers is not None:
            self.workers.start()
        self.dataplane.started = True
        self.started = True

    def _check_serving(self) -> None:
        """A request needs a started engine, on its loop: else a clear error (not an
        unknown model before start, nor the dataplane's refusal after stop)."""
        if self._loop is None:
            if self._stopped:
                raise RuntimeError("the engine was stopped; create and start a new Engine")
            raise RuntimeError(
                "the engine is not started: `await engine.start()` or `async with engine:` first"
            )
        self._check_loop()

    def _check_loop(self) -> None:
        """Requests are answered on the loop that started the engine; awaiting one from
        another loop would never wake (the answer is set on the engine's loop)."""
        loop = self._loop
        if loop is not None and asyncio.get_running_loop() is not loop:
            raise RuntimeError(
                "this Engine runs on the event loop that started it; from another thread or "
                "loop use Engine.sync(), or asyncio.run_coroutine_threadsafe on that loop"
            )

    async def stop(
        self, grace_period_s: float | None = None, *, models_timeout_s: float | None = None
    ) -> list[str]:
        """The one shutdown: readiness turns false and new requests are refused; the
        transports stop taking new ones; what was accepted is answered. Generations still
        running after ``grace_period_s`` (default: the ``grace_period_s`` setting) end with
        ``ShuttingDown``; other models' batches in progress are waited for (at most
        ``models_timeout_s`` past the grace period when given). Returns the versions still
        running then ("name:version"; [] when all stopped). Never started: nothing to do;
        stopping or stopped already: waits for that stop."""
        done = self._stop_done
        if not self._began or (done is not None and done.is_set()):
            return []
        self._check_loop()
        if done is not None:
            await done.wait()
            return []
        self._stop_done = asyncio.Event()
        try:
            return await self._stop(grace_period_s, models_timeout_s)
        finally:
            self._stop_done.set()

    def _busy(self) -> bool:
        """An accepted request is still being answered (by a model or a transport)."""
        return any(mv.scheduler.busy for mv in self.registry.loaded_versions()) or any(
            t.busy for t in self._transports
        )

    async def _idle(self, deadline: float) -> bool:
        """Wait until nothing is in flight (True), or until ``deadline`` (False)."""
        while self._busy():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.005)
        return True

    def _abort_generations(self, grace: float) -> None:
        error = ShuttingDown(f"shutting down: generation cut after the {grace:g} s grace period")
        for mv in self.registry.loaded_versions():
            llm = mv.capability(GENERATE)
            if llm is not None:
                llm.abort_all(error)

    async def _stop(
        self, grace_period_s: float | None, models_timeout_s: float | None
    ) -> list[str]:
        self._stopped = True
        grace = self.config.grace_period_s if grace_period_s is None else grace_period_s
        deadline = time.monotonic() + grace
        self.dataplane.begin_drain()
        for transport in self._transports:
            transport.begin_drain()
        if self.started:
            log.info("draining: readiness false, finishing accepted requests")
        if not await self._idle(deadline):
            log.error("grace period of %.1f s ended with requests still in flight", grace)
            self._abort_generations(grace)
            # The aborted generations' last events reach their clients.
            await self._idle(time.monotonic() + ABORTED_S)
        for transport in self._transports:
            await transport.close(max(0.0, deadline - time.monotonic()))
        await self.control.stop()
        stuck = await self._stop_models(models_timeout_s)
        if self.workers is not None and not stuck:
            await self.workers.stop()
        if self.tracer is not None:
            self.tracer.shutdown()
        self.started = False
        self._loop = None
        return stuck

    async def _stop_models(self, timeout_s: float | None) -> list[str]:
        """Release every model; those still running after ``timeout_s`` are named."""
        try:
            await asyncio.wait_for(self.registry.stop(), timeout_s)
        except TimeoutError:
            return [
                f"{mv.name}:{mv.version}"
                for mv in self.registry.loaded_versions()
                if mv.scheduler.busy
            ] or ["none named"]
        return []

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def sync(self) -> SyncEngine:
        """The same engine for plain (non-async) code: its own event loop on a thread. One
        per engine: every call returns it (threads that each call ``sync().start()`` share
        one start)."""
        with _SYNC_LOCK:
            if self._sync is None:
                self._sync = SyncEngine(self)
            return self._sync

    # ------------------------------------------------------------------ inference
    async def infer(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        version: str = "",
        outputs: Sequence[str] | None = None,
        parameters: Mapping[str, Any] | None = None,
        request_id: str = "",
    ) -> dict[str, np.ndarray]:
        """Run one request; returns its outputs by name. ``inputs``: arrays (or nested
        lists, strings for BYTES) with the batch dimension when the model batches;
        ``parameters``: the V2 request parameters (``timeout`` in µs, ``priority``, ...).
        Raises ``ModelNotFound``, ``InvalidInput`` (naming the field), ``Overloaded``..."""
        self._check_serving()
        if not isinstance(inputs, Mapping) or not inputs:
            raise InvalidInput("inputs: expected a mapping of input names to arrays")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise InvalidInput("parameters: expected a mapping of parameter names to values")
        version = _version(version)

        def decode(mv: ModelVersion) -> InferRequest:
            specs = mv.inputs
            return InferRequest(
                model,
                version,
                [
                    _tensor(str(k), v, specs[k].datatype if k in specs else None)
                    for k, v in inputs.items()
                ],
                None if outputs is None else [RequestedOutput(str(o)) for o in outputs],
                request_id,
                dict(parameters or {}),
            )

        timings = Timings(received=_now())
        response = await self.dataplane.infer(model, version, timings, decode)
        return {t.name: t.data for t in response.outputs}

    async def generate(
        self,
        model: str,
        prompt: str | list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        *,
        version: str = "",
        request_id: str = "",
        priority: int = 0,
        **params: Any,
    ) -> AsyncGenerator[GenerationEvent, None]:
        """Generate from a ``backend: llm`` model: the events as tokens come (``text`` each,
        ``finish_reason`` and the token counts on the last). Give ``prompt`` (text or token
        ids) or chat ``messages`` (the model's chat template applies); ``params``: sampling,
        as the OpenAI API names it (``max_tokens`` (16 for a prompt; a chat stops at
        ``llm.default_max_tokens``), ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``,
        ``logprobs``, ...). Leaving the loop early stops the generation. Raises
        ``InvalidInput`` (naming the field), ``ModelNotFound``, ``ObjectiveRefused``..."""
        self._check_serving()
        timings = Timings(received=_now())
        dp = self.dataplane
        try:
            version = _version(version)
            unknown = sorted(set(params) - SAMPLING_NAMES)
            if unknown:
                raise InvalidInput(
                    f"{unknown[0]}: not a sampling parameter (known: "
                    f"{', '.join(sorted(SAMPLING_NAMES))})"
                )
            if (prompt is None) == (messages is None):
                raise InvalidInput("prompt, messages: expected exactly one of them")
            default = 16 if messages is None else None
            gen = await generation.prepare_async(
                dp,
                model,
                timings,
                SamplingParams.from_mapping(params, default_max_tokens=default),
                prompt=prompt,
                messages=messages,
                version=version,
                request_id=request_id,
                priority=priority,
                min_priority=PRIORITY_MIN,  # (the process's own code: any priority)
            )
        except Exception as exc:
            raise generation.refused(dp, timings, exc, model) from None
        async with aclosing(generation.events(dp, gen)) as events:
            async for event in events:
                yield event

    # ------------------------------------------------------------------ what is served
    def models(self) -> list[ModelStatus]:
        """Every model version the engine knows, with its state (the repository index)."""
        return [ModelStatus(e.name, e.version, e.state, e.reason) for e in self.registry.index()]

    def ready(self) -> bool:
        """Started, not stopping, and every model asked for serves (strict readiness)."""
        return self.dataplane.ready()

    def metadata(self, model: str, version: str = "") -> ModelInfo:
        return self.dataplane.model_metadata(model, version)

    def model_config(self, model: str, version: str = "") -> ModelConfigInfo:
        return self.dataplane.model_config(model, version)

    async def load(self, model: str, config: dict[str, Any] | None = None) -> None:
        """Load (or reload) a model, as ``POST /v2/repository/models/{m}/load`` does."""
        await self.control.load(model, config)

    async def unload(self, model: str) -> None:
        await self.control.unload(model)

    def metrics_text(self) -> bytes:
        """The Prometheus exposition of every model's metrics."""
        return self.dataplane.metrics_exposition()[0]


class SyncEngine:
    """``Engine`` for plain scripts: each call runs on the engine's own loop thread.

    ``start`` and ``stop`` are safe from any thread and idempotent: callers racing to start
    wait for one start and share its engine; ``stop`` without ``start``, or twice, does
    nothing. A stopped engine is not started again: a call after ``stop`` is refused with
    a ``RuntimeError`` saying so."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._lifecycle = threading.Lock()  # one start or stop at a time
        self._schedule = threading.Lock()  # the state, and each call's hand-over to the loop
        self._stopped = False

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        with self._schedule:
            loop = self._loop
            if loop is None or self._stopped or os.getpid() != self._pid:
                coro.close()
                raise self._not_serving()
            if threading.current_thread() is self._thread:
                coro.close()
                raise RuntimeError(
                    "SyncEngine called from its own loop thread (it would wait for itself): "
                    "use the Engine's async methods there"
                )
            future: Future[T] = asyncio.run_coroutine_threadsafe(coro, loop)
        return future.result()

    def _not_serving(self) -> RuntimeError:
        if os.getpid() != self._pid:  # (forked: the loop's thread is not in this process)
            return RuntimeError(
                f"this engine was started in process {self._pid}; in a forked process "
                "create and start a new Engine"
            )
        if self._stopped:
            return RuntimeError("the engine was stopped; create and start a new Engine")
        return RuntimeError("the engine is not started: use `with engine.sync() as e:`")

    def start(self) -> SyncEngine:
        """Load and warm up the models on a new loop thread. Started already (by this or
        another thread): the same engine, once its start has finished."""
        with self._lifecycle:
            if self._loop is not None and os.getpid() == self._pid:
                return self
            if self._stopped or self.engine._stopped:
                raise RuntimeError(
                    "an Engine cannot be started again after stop(); create a new one"
                )
            loop = asyncio.new_event_loop()
            thread = threading.Thread(
                target=_run_loop, args=(loop,), name="rtserve-engine", daemon=True
            )
            thread.start()
            with self._schedule:
                self._loop, self._thread, self._pid = loop, thread, os.getpid()
            try:
                self._call(self.engine.start())
            except BaseException:
                self._end_loop()
                self._stopped = False  # (nothing was served: a later start may retry)
                raise
            return self

    def stop(self) -> None:
        """Answer what was accepted, release the models and end the loop thread (waited
        for). Not started, or stopped already: nothing to do."""
        with self._lifecycle:
            if self._loop is None:
                return
            if os.getpid() != self._pid:  # a forked copy: the parent's engine is not ours
                self._loop = self._thread = None
                return
            if threading.current_thread() is self._thread:
                raise RuntimeError(
                    "SyncEngine.stop() called from its own loop thread: await Engine.stop()"
                )
            try:
                if self.engine.started:
                    self._call(self.engine.stop())
            finally:
                self._end_loop()

    def _end_loop(self) -> None:
        """Refuse new calls, stop the loop (what is still pending there is cancelled: no
        caller waits for ever), join its thread and close it."""
        with self._schedule:
            loop, thread = self._loop, self._thread
            self._stopped = True
            self._loop = self._thread = None
        assert loop is not None and thread is not None
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        if not thread.is_alive():
            loop.close()

    def __enter__(self) -> SyncEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def infer(self, model: str, inputs: Mapping[str, Any], **options: Any) -> dict[str, np.ndarray]:
        return self._call(self.engine.infer(model, inputs, **options))

    def generate(self, model: str, *args: Any, **options: Any) -> Iterator[GenerationEvent]:
        """``Engine.generate`` as a plain iterator (each event comes from the engine's loop
        thread); leaving the loop early stops the generation."""
        events = self.engine.generate(model, *args, **options)
        try:
            while True:
                try:
                    event = self._call(_next(events))
                except StopAsyncIteration:
                    return
                yield event
        finally:
            if self._loop is not None and not self._stopped:
                with contextlib.suppress(RuntimeError):  # (stopped meanwhile: nothing to close)
                    self._call(events.aclose())

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` on the engine's loop (adapters such as the serverless handler)."""
        return self._call(coro)

    def models(self) -> list[ModelStatus]:
        return self.engine.models()

    def ready(self) -> bool:
        return self.engine.ready()

    def load(self, model: str, config: dict[str, Any] | None = None) -> None:
        self._call(self.engine.load(model, config))

    def unload(self, model: str) -> None:
        self._call(self.engine.unload(model))


def _version(version: Any) -> str:
    """A version as the wire has it: a string; an int (``2``) is taken as ``"2"``."""
    if isinstance(version, bool) or not isinstance(version, str | int):
        raise InvalidInput(f"version: expected a version string such as '1', got {version!r:.40}")
    return str(version)


async def _next(events: AsyncGenerator[GenerationEvent, None]) -> GenerationEvent:
    return await events.__anext__()


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    """A SyncEngine's loop thread: run until stopped, then cancel what is still pending
    (calls handed over while it stopped: their callers get ``CancelledError``, not a wait
    for ever) and end the default executor's threads."""
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        for _ in range(10):
            loop.run_until_complete(asyncio.sleep(0))  # (hand-overs queued: their tasks)
            pending = asyncio.all_tasks(loop)
            if not pending:
                break
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_default_executor())
        asyncio.set_event_loop(None)
