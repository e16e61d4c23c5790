"""The dataplane: the single entry for health, metadata and inference.

Every frontend (HTTP, gRPC, the in-process ``Engine``) hands an inference request to
``submit`` with a decoder and a sink: the dataplane finds the model, refuses early under
overload before anything is decoded, decodes with the model's limits, checks the inputs
against the model's precomputed signature, applies the deadline and the response cache,
submits to the model's scheduler, gives the answer (an ``InferResponse`` or an
``RTServeError``) to the sink, then records the metrics (``observe``: nowhere else).

Without a cache the path runs with no task and no coroutine: the request is checked and
queued synchronously and the batch future's callback produces the answer.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from rtserve import __version__
from rtserve.config import SLO
from rtserve.core.capabilities import GENERATE
from rtserve.core.info import (
    ConfigTensor,
    ModelConfigInfo,
    ModelInfo,
    ServerInfo,
    TensorInfo,
)
from rtserve.core.model import ModelVersion
from rtserve.core.registry import IndexEntry, ModelRegistry
from rtserve.errors import (
    ClientClosed,
    InvalidInput,
    ModelNotReady,
    RTServeError,
    ShuttingDown,
    as_error,
)
from rtserve.observability.logs import access_line
from rtserve.observability.metrics import Metrics, VersionStatistics, outcome_of
from rtserve.observability.tracing import Tracer
from rtserve.observability.workers import WorkerView
from rtserve.protocol.limits import shown_name
from rtserve.protocol.types import InferRequest, InferResponse, Tensor, Timings
from rtserve.runtime.llm.params import SAMPLING_NAMES
from rtserve.runtime.parameters import add_row_parameters

EXTENSIONS = (
    "binary_tensor_data",
    "classification",
    "model_configuration",
    "statistics",
    "model_repository",
    "schedule_policy",
)
_now = time.perf_counter_ns

# Where a request's answers go: sink(request, model version or None, response or None, error
# or None, final). A tensor model's request gets one call, final; a streaming (generative)
# request may get partial answers first (final False), then exactly one final call. The sink
# returns the error the frontend met delivering the answer (encoding it, say) or None; the
# dataplane records the request's metrics once, after the final call returns.
Sink = Callable[
    [InferRequest, ModelVersion | None, InferResponse | None, RTServeError | None, bool],
    RTServeError | None,
]
# A frontend's decoder: the request decoded with the model's limits (``mv.decode_limits``), or
# None when the frontend finishes decoding later (a body decompressed on a thread) and then
# calls ``submit`` again.
Decode = Callable[[ModelVersion], InferRequest | None]
# How a streamed request hands the dataplane its outputs: emit(output, error, final).
Emit = Callable[[Any, RTServeError | None, bool], None]


@dataclass(slots=True)
class StreamRequest(InferRequest):
    """A request answered by many outputs (a generation). Once the dataplane accepted it,
    it calls ``start(emit)``: the backend then emits each output (``final`` False) and
    exactly one final call (its error, or None); ``start`` returns what to call if the
    client goes away. Each emit reaches the sink as is; the final one records the request."""

    start: Callable[[Emit], Callable[[], object]] | None = None


def _settle(
    answer: asyncio.Future[InferResponse],
    _: InferRequest,
    __: ModelVersion | None,
    response: InferResponse | None,
    error: RTServeError | None,
    final: bool,
) -> None:
    """The sink of ``DataPlane.infer`` (one answer): the final answer into its future."""
    if answer.done() or not final:  # the caller was cancelled first
        return None
    if error is not None:
        # A copy, without the traceback: refusals under overload are one shared object, and
        # a traceback would hold the frames (and the request) that raised it.
        answer.set_exception(copy.copy(error))
    else:
        answer.set_result(response)  # type: ignore[arg-type]
    return None


def statistics_of(versions: Iterable[ModelVersion]) -> list[VersionStatistics]:
    """This process's statistics of ``versions``."""
    return [VersionStatistics(mv.name, mv.version, mv.metrics.stats) for mv in versions]


def _timeout_s(request: InferRequest, mv: ModelVersion) -> float:
    """The V2 ``timeout`` request parameter, in microseconds (as Triton's clients send it)."""
    value = request.parameters.get("timeout")
    if value is None:
        return mv.config.dynamic_batching.default_timeout_us / 1e6
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not value >= 0  # also NaN
        or value >= 1 << 64  # Triton's uint64; a larger one overflowed the deadline (a 500)
    ):
        raise InvalidInput(
            "parameters.timeout: expected microseconds (a finite number >= 0, below 2**64), "
            f"got {value!r:.100}"
        )
    return float(value) / 1e6


def _refuse_sampling(request: InferRequest, mv: ModelVersion) -> None:
    """V2 ``infer`` on a generative model answers with the model's default sampling: a
    sampling parameter there would be ignored, so it is refused, pointing to the routes
    that take it."""
    given = sorted(k for k in request.parameters if k in SAMPLING_NAMES)
    if given:
        raise InvalidInput(
            f"parameters.{given[0]}: infer on generative model '{mv.name}' uses its default "
            f"sampling; send sampling parameters to /v2/models/{mv.name}/generate (or gRPC "
            "ModelStreamInfer, or the OpenAI API)"
        )


def _given_twice(where: str, i: int, name: str) -> InvalidInput:
    return InvalidInput(
        f"{where}[{i}].name: {shown_name(name)} is given more than once, expected distinct names"
    )


def _check_priority(request: InferRequest, mv: ModelVersion) -> None:
    """The request parameter ``priority`` (Triton's uint64) on a model without levels (an
    ensemble, or a model that ignores it): a bad value is still an error. A model's own
    levels are checked where it queues the request."""
    value = request.parameters.get("priority")
    if (
        value is not None
        and mv.config.priority_levels <= 1
        and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 64)
    ):
        raise InvalidInput(
            f"parameters.priority: expected an integer >= 0 (1 is the highest), got {value!r:.100}"
        )


def _config_type(datatype: str) -> str:
    return "STRING" if datatype == "BYTES" else datatype


def _slo_parameters(slo: SLO | None) -> tuple[tuple[str, str], ...]:
    """A model's latency objective as Triton config ``parameters`` (strings, in ms)."""
    if slo is None:
        return ()
    out = [("slo_p99_ms", f"{slo.p99_ms:.15g}")]
    if slo.p50_ms:
        out.append(("slo_p50_ms", f"{slo.p50_ms:.15g}"))
    return tuple(out)


Wanted = tuple[str, int]  # an output to answer with, and its classification count (0: none)


def top_classes(
    arr: np.ndarray, top: int, batched: bool, labels: tuple[str, ...] | None = None
) -> np.ndarray:
    """The classification extension: each row's ``top`` largest values (all, if fewer) as
    ``value:index`` BYTES, with ``:label`` where the output has class labels; [batch, top]
    for a batched model, [top] otherwise. Ties keep the lower index first."""
    rows = arr.reshape(arr.shape[0], -1) if batched and arr.ndim else arr.reshape(1, -1)
    k = min(top, rows.shape[1])
    order = np.argsort(-rows.astype(np.float64), axis=1, kind="stable")[:, :k]
    floats = rows.dtype.kind == "f"
    out = np.empty(order.shape, dtype=object)
    for r in range(order.shape[0]):
        row = rows[r]
        for j, index in enumerate(order[r].tolist()):
            value = f"{float(row[index]):f}" if floats else str(int(row[index]))
            label = f":{labels[index]}" if labels is not None and index < len(labels) else ""
            out[r, j] = f"{value}:{index}{label}".encode()
    return out if batched and arr.ndim else out.reshape(k)


def _label_parameters(mv: ModelVersion) -> tuple[tuple[str, str], ...]:
    """Class labels of outputs that have them (a ZipMap'd scikit-learn classifier's, or the
    config's labels files), in index order: ``labels:<output>`` -> a JSON list."""
    return tuple((f"labels:{name}", json.dumps(list(c))) for name, c in mv.labels.items())


class DataPlane:
    def __init__(
        self,
        registry: ModelRegistry,
        metrics: Metrics,
        workers: WorkerView | None = None,
        tracer: Tracer | None = None,
        access_log: bool = False,
    ) -> None:
        """``workers``: with ``--workers N``, the merged view of every worker's metrics and
        statistics (None: this process is the whole server). ``tracer``/``access_log``:
        what else ``observe`` emits per finished request (both off by default)."""
        self.registry = registry
        self.metrics = metrics
        self.workers = workers
        self.tracer = tracer
        self.access_log = access_log
        self.started = False
        self.strict_readiness = True  # ready only while every model asked for serves
        self.draining = False
        self.drain_started_ns = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def begin_drain(self) -> None:
        self.drain_started_ns = _now()
        self.draining = True

    # ------------------------------------------------------------------ health
    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        """Started, not draining and (strict readiness) no model asked for has failed."""
        if not self.started or self.draining:
            return False
        return not (self.strict_readiness and self.registry.failed())

    def model_ready(self, name: str, version: str = "") -> bool:
        """False for a model that is unloaded or failed to load; ModelNotFound (HTTP 404,
        gRPC NOT_FOUND) only for a name the server never knew or an unknown version."""
        if name in self.registry.unloaded:
            return False
        try:
            mv = self.registry.get_loaded(name, version)
        except ModelNotReady:
            return False
        return mv.ready and not self.draining

    # ------------------------------------------------------------------ metadata
    def server_metadata(self) -> ServerInfo:
        return ServerInfo("rtserve", __version__, EXTENSIONS)

    def model_metadata(self, name: str, version: str = "") -> ModelInfo:
        mv = self.registry.get_loaded(name, version)
        batch = (-1,) if mv.config.max_batch_size > 0 else ()
        return ModelInfo(
            name=mv.name,
            versions=tuple(self.registry.entry(mv.name).versions),
            platform=mv.platform,
            inputs=tuple(  # (one value a row: [-1, 1], the config's dims, as Triton says)
                TensorInfo(s.name, s.datatype, (*batch, *(s.shape or batch and (1,))))
                for s in mv.inputs.values()
            ),
            outputs=tuple(
                TensorInfo(s.name, s.datatype, (*batch, *s.shape)) for s in mv.outputs.values()
            ),
        )

    def model_config(self, name: str, version: str = "") -> ModelConfigInfo:
        mv = self.registry.get_loaded(name, version)
        cfg = mv.config
        db = cfg.dynamic_batching
        return ModelConfigInfo(
            name=mv.name,
            platform=mv.platform,
            backend=cfg.backend,
            max_batch_size=max(0, cfg.max_batch_size),
            inputs=tuple(
                ConfigTensor(s.name, f"TYPE_{_config_type(s.datatype)}", tuple(s.shape) or (1,))
                for s in mv.inputs.values()
            ),
            outputs=tuple(
                ConfigTensor(s.name, f"TYPE_{_config_type(s.datatype)}", tuple(s.shape) or (1,))
                for s in mv.outputs.values()
            ),
            preferred_batch_sizes=db.preferred_batch_sizes,
            max_queue_delay_us=db.max_queue_delay_us,
            instance_count=cfg.instance_count,
            priority_levels=cfg.priority_levels,
            default_priority=cfg.default_priority,  # 0 without levels (config checks it)
            parameters=_slo_parameters(cfg.slo) + _label_parameters(mv),
        )

    def repository_index(self) -> list[IndexEntry]:
        return self.registry.index()

    def statistics(self, name: str | None, version: str = "") -> list[VersionStatistics]:
        if name is None:
            versions = self.registry.loaded_versions()
        else:
            mv = self.registry.get_loaded(name, version)
            versions = [mv] if version else list(self.registry.entry(mv.name).versions.values())
        own = statistics_of(versions)
        return self.workers.statistics(own) if self.workers is not None else own

    def metrics_exposition(self) -> tuple[bytes, str]:
        """The Prometheus text of the whole server (every worker's, merged)."""
        if self.workers is not None:
            return self.workers.exposition()
        return self.metrics.exposition()

    # ------------------------------------------------------------------ inference
    def resolve(self, name: str, version: str, timings: Timings) -> ModelVersion:
        """Find the model version; during a drain only requests received before it began
        are accepted."""
        if self.draining and timings.received >= self.drain_started_ns:
            raise ShuttingDown("server is shutting down; not accepting new requests")
        return self.registry.get(name, version)

    def submit(
        self, model: str, version: str, timings: Timings, decode: Decode, sink: Sink
    ) -> Callable[[], object] | None:
        """The one lifecycle of an inference request, for every frontend: find the model,
        refuse early under overload (before decoding anything), decode with the model's
        limits, check the inputs, answer from the cache or schedule; the answer goes to
        ``sink`` exactly once (maybe before this returns), then the metrics are recorded.

        Returns what to call if the client goes away first (the request is then dropped
        from its queue, never computed, and ``sink`` gets a ``ClientClosed``), or None."""
        mv = None
        try:
            mv = self.resolve(model, version, timings)
            refusal = mv.early_refusal(timings.received)
            if refusal is None:
                request = decode(mv)
                if request is None:
                    return None
                request.timings = timings
                if type(request) is StreamRequest:
                    return self._stream(request, sink, mv)
                return self._schedule(request, sink, mv)
        except Exception as exc:
            # No local may hold the error: its traceback holds this frame, and the cycle would
            # keep the request (its body) alive until the rare cyclic collection.
            self.refuse(sink, timings, as_error(exc, "inference request"), model, version, mv)
            return None
        self.refuse(sink, timings, refusal, model, version, mv)
        return None

    def refuse(
        self,
        sink: Sink,
        timings: Timings,
        error: RTServeError,
        model: str = "",
        version: str = "",
        mv: ModelVersion | None = None,
    ) -> None:
        """Answer a request that failed before it was decoded (a bad route, an overload
        refusal, a body that does not decode) through ``sink``, and record it."""
        self._deliver(sink, InferRequest(model, version, [], timings=timings), mv, None, error)

    def record_refusal(
        self, timings: Timings, error: RTServeError, model: str = "", version: str = ""
    ) -> None:
        """Record a request a frontend refused itself (a key, a rate limit): counted under
        its model when that is loaded (else as unrouted) and in the access log."""
        try:
            mv: ModelVersion | None = self.registry.get_loaded(model, version)
        except RTServeError:
            mv = None
        self.observe(InferRequest(model, version, [], timings=timings), mv, error, _now())

    async def infer(
        self, model: str, version: str, timings: Timings, decode: Decode
    ) -> InferResponse:
        """``submit`` for callers that want one answer: returns the response or raises the
        request's ``RTServeError``; cancelling the caller drops the request."""
        answer: asyncio.Future[InferResponse] = asyncio.get_running_loop().create_future()
        sink = partial(_settle, answer)
        cancel = self.submit(model, version, timings, decode, sink)
        try:
            return await answer
        except asyncio.CancelledError:  # the caller went away (a cancelled gRPC call)
            if cancel is not None:
                cancel()
            raise
        finally:
            # The future keeps the error raised here, whose traceback holds this frame: a
            # cycle that would keep the request (its body, through ``decode``) alive until
            # the rare cyclic collection.
            del answer, sink, cancel

    def _deliver(
        self,
        sink: Sink,
        request: InferRequest,
        mv: ModelVersion | None,
        response: InferResponse | None,
        error: RTServeError | None,
        final: bool = True,
    ) -> None:
        """Give ``sink`` an answer; after the final one, record the request."""
        failed = sink(request, mv, response, error, final)
        if final:
            self.observe(request, mv, failed or error, _now())

    def _stream(
        self, request: StreamRequest, sink: Sink, mv: ModelVersion
    ) -> Callable[[], object] | None:
        """Start a streamed request: its outputs go to ``sink`` as they come."""

        def emit(output: Any, error: RTServeError | None, final: bool) -> None:
            self._deliver(sink, request, mv, output, error, final)

        try:
            assert request.start is not None
            return request.start(emit)
        except Exception as exc:
            self._deliver(sink, request, mv, None, as_error(exc, "streamed request"))
            return None

    def _schedule(
        self, request: InferRequest, sink: Sink, mv: ModelVersion
    ) -> Callable[[], object] | None:
        """Check a decoded request, then answer it from the cache or submit it to the model's
        scheduler; the answer goes to ``sink``. Returns the cancel of ``submit``."""
        try:
            feeds, rows = self._check_inputs(request, mv)
            wanted = self._check_outputs(request, mv)
            timeout_s = _timeout_s(request, mv)
            _check_priority(request, mv)
            if request.parameters and mv.capability(GENERATE) is not None:
                _refuse_sampling(request, mv)
            if mv.row_parameters:
                feeds = add_row_parameters(mv.row_parameters, request, feeds, rows)
            cache = mv.cache
            if cache is not None:
                outputs, key = cache.lookup_memory(request)
                if outputs is not None:
                    request.timings.cache = "memory"
                    request.timings.done = _now()
                    response = InferResponse(mv.name, mv.version, outputs, request.id)
                    self._deliver(sink, request, mv, response, None)
                    return None
                if key is not None:
                    task = asyncio.get_running_loop().create_task(
                        self._fill(request, mv, feeds, rows, wanted, timeout_s, key, sink)
                    )
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                    return None
                request.timings.cache = "bypass"
            future = mv.scheduler.submit(
                feeds,
                rows,
                request.timings,
                timeout_s,
                request.parameters.get("priority"),
                partial(self._complete, request, mv, wanted, sink),
            )
        except Exception as exc:
            self._deliver(sink, request, mv, None, as_error(exc, "inference request"))
            return None
        return future.cancel

    def observe(
        self,
        request: InferRequest,
        mv: ModelVersion | None,
        error: RTServeError | None,
        end_ns: int,
    ) -> None:
        """Record the finished request: metrics, and when enabled its trace and access-log
        line. The frontends call this once per request, after sending the answer."""
        rows = 1
        if mv is None:
            self.metrics.unrouted.labels(outcome_of(error) if error else "error").inc()
        else:
            mv.metrics.client_requests += 1  # step requests of an ensemble are not
            if error is None:
                if mv.config.max_batch_size > 0 and request.inputs and request.inputs[0].shape:
                    rows = request.inputs[0].shape[0]
                mv.metrics.observe_success(request.timings, rows, end_ns)
            else:
                mv.metrics.observe_failure(outcome_of(error), request.timings, end_ns)
        if self.tracer is not None or self.access_log:
            self._trace_and_log(request, mv, error, rows, end_ns)

    def _trace_and_log(
        self,
        request: InferRequest,
        mv: ModelVersion | None,
        error: RTServeError | None,
        rows: int,
        end_ns: int,
    ) -> None:
        model = mv.name if mv is not None else request.model_name[:100]
        version = mv.version if mv is not None else request.model_version[:20]
        status = error.http_status if error is not None else 200
        trace_id = ""
        if self.tracer is not None:
            trace_id = self.tracer.record(
                request.timings,
                model,
                version,
                status,
                error.message if error is not None else "",
                end_ns,
                routed=mv is not None,
            )
        if self.access_log:
            access_line(request.timings, model, version, status, rows, end_ns, trace_id)

    def _complete(
        self,
        request: InferRequest,
        mv: ModelVersion,
        wanted: list[Wanted],
        sink: Sink,
        future: asyncio.Future[dict[str, np.ndarray]],
    ) -> None:
        if future.cancelled():
            closed = ClientClosed("the client went away before the answer")
            self._deliver(sink, request, mv, None, closed)
            return
        try:
            outputs = self._select(mv, future.result(), wanted)
        except BaseException as exc:
            self._deliver(sink, request, mv, None, as_error(exc, "inference request"))
            return
        request.timings.done = _now()
        response = InferResponse(mv.name, mv.version, outputs, request.id)
        self._deliver(sink, request, mv, response, None)

    async def _fill(
        self,
        request: InferRequest,
        mv: ModelVersion,
        feeds: dict[str, np.ndarray],
        rows: int,
        wanted: list[Wanted],
        timeout_s: float,
        key: bytes,
        sink: Sink,
    ) -> None:
        """After an L1 miss: single-flight, then Redis, then the model."""

        async def run() -> list[Tensor]:
            results = await mv.scheduler.submit(
                feeds, rows, request.timings, timeout_s, request.parameters.get("priority")
            )
            return self._select(mv, results, wanted)

        assert mv.cache is not None
        try:
            outputs, tier = await mv.cache.fill(key, request, run, timeout_s)
        except BaseException as exc:
            self._deliver(sink, request, mv, None, as_error(exc, "inference request"))
            return
        request.timings.cache = tier or "miss"
        request.timings.done = _now()
        response = InferResponse(mv.name, mv.version, outputs, request.id)
        self._deliver(sink, request, mv, response, None)

    @staticmethod
    def _select(
        mv: ModelVersion, results: dict[str, np.ndarray], wanted: list[Wanted]
    ) -> list[Tensor]:
        specs = mv.outputs
        out = []
        for name, top in wanted:
            arr = results[name]
            if top:
                arr = top_classes(arr, top, mv.config.max_batch_size > 0, mv.labels.get(name))
                out.append(Tensor(name, "BYTES", arr.shape, arr))
            else:
                out.append(Tensor(name, specs[name].datatype, arr.shape, arr))
        return out

    @staticmethod
    def _check_outputs(request: InferRequest, mv: ModelVersion) -> list[Wanted]:
        # Outputs computed on request (a tree model's contributions): output -> the row
        # parameter that asks for them; asking for the output sets the parameter.
        on_request: dict[str, str] = getattr(mv.runtime, "on_request_outputs", None) or {}
        if not request.outputs:
            return [
                (name, 0)
                for name in mv.outputs
                if name not in on_request or request.parameters.get(on_request[name])
            ]
        for out in request.outputs:
            if out.name in on_request and on_request[out.name] not in request.parameters:
                request.parameters[on_request[out.name]] = True
        wanted: list[Wanted] = []
        for i, out in enumerate(request.outputs):
            spec = mv.outputs.get(out.name)
            if spec is None:
                raise InvalidInput(
                    f"outputs[{i}].name: model '{mv.name}' has no output '{out.name:.100}' "
                    f"(expected one of: {', '.join(mv.outputs)})"
                )
            if any(name == out.name for name, _ in wanted):  # (distinct: at most one each)
                raise _given_twice("outputs", i, out.name)
            if out.classification and spec.datatype in ("BYTES", "BOOL"):
                raise InvalidInput(
                    f"outputs[{i}].parameters.classification: output '{out.name}' is "
                    f"{spec.datatype}; classification ranks a numeric output"
                )
            wanted.append((out.name, out.classification))
        return wanted

    @staticmethod
    def _check_inputs(request: InferRequest, mv: ModelVersion) -> tuple[dict[str, np.ndarray], int]:
        specs = mv.inputs
        max_batch = mv.config.max_batch_size
        feeds: dict[str, np.ndarray] = {}
        rows = 1
        for i, t in enumerate(request.inputs):
            spec = specs.get(t.name)
            if spec is None:
                raise InvalidInput(
                    f"input '{t.name:.100}': model '{mv.name}' has no such input "
                    f"(expected: {', '.join(specs)})"
                )
            if t.name in feeds:
                raise _given_twice("inputs", i, t.name)
            if t.datatype != spec.datatype:
                raise InvalidInput(
                    f"input '{t.name}': datatype {t.datatype} does not match the model's {spec.datatype}"
                )
            shape = t.shape
            expected = spec.shape
            data = t.data
            if max_batch > 0:
                if not expected and len(shape) == 2 and shape[1] == 1:
                    # one value a row, sent as the config's dims [1] (Triton's reshape [])
                    shape = shape[:1]
                    data = data.reshape(shape)
                if len(shape) != len(expected) + 1 or shape[0] < 1:
                    raise InvalidInput(
                        f"input '{t.name}': shape {list(shape)} does not match the model's "
                        f"{[-1, *expected]} (first dimension is the batch)"
                    )
                n = shape[0]
                if n > max_batch:
                    raise InvalidInput(
                        f"input '{t.name}': batch of {n} rows exceeds the model's "
                        f"max_batch_size {max_batch}"
                    )
                if feeds and n != rows:
                    raise InvalidInput(
                        f"input '{t.name}': batch size {n} differs from the other inputs' {rows}"
                    )
                rows = n
                dims = shape[1:]
            else:
                dims = shape
                if len(dims) != len(expected):
                    raise InvalidInput(
                        f"input '{t.name}': shape {list(shape)} does not match the model's {list(expected)}"
                    )
            for got, want in zip(dims, expected, strict=True):
                if want != -1 and got != want:
                    shown = [-1, *expected] if max_batch > 0 else list(expected)
                    raise InvalidInput(
                        f"input '{t.name}': shape {list(shape)} does not match the model's {shown}"
                    )
            feeds[t.name] = data
        if len(feeds) != len(specs):
            missing = [n for n in specs if n not in feeds]
            raise InvalidInput(
                f"missing input(s) {', '.join(repr(m) for m in missing)} for model '{mv.name}'"
            )
        return feeds, rows
