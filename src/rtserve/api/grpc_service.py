"""The V2 gRPC service (``inference.GRPCInferenceService``) without a transport: its
handlers and ``GRPC_ROUTES``, the table from a method's path to its handler that both gRPC
transports (grpcio, ``server/grpc.py``; our own HTTP/2, ``server/grpc_h2.py``) dispatch
through. They only turn their I/O into a call (the request message, its metadata, its
context) and send the answer back.

Thin: decode into an ``InferRequest``, call the dataplane, encode. Every handler runs
inside ``_unary``, the one place where exceptions become a gRPC status (through
``server.errors.grpc_error``); stream requests always get an answer on the stream.

A generative (``backend: llm``, decoupled) model on ``ModelStreamInfer`` answers as Triton's
decoupled models do for tritonclient's streaming client: input ``text_input`` (BYTES),
sampling parameters as request parameters or scalar inputs (``max_tokens``,
``temperature``, ...); one response per piece of text (output ``text_output``), each with
the parameter ``triton_final_response``; the last is flagged true, or, when the request
asks for it (``triton_enable_empty_final_response``), an empty response flagged true
follows. Cancelling the call stops the generation.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from types import MethodType
from typing import Any

import numpy as np

from rtserve.api.context import error_metadata, grpc_metadata, read_metadata
from rtserve.core import generation
from rtserve.core.control import ModelControl
from rtserve.core.dataplane import DataPlane
from rtserve.core.model import ModelVersion
from rtserve.errors import InvalidInput, RTServeError, as_error
from rtserve.protocol import grpc_service_pb2 as pb
from rtserve.protocol.bytes_codec import encode_bytes_elements
from rtserve.protocol.grpc_codec import (
    decode_model_infer,
    encode_model_infer,
    parameters_to_dict,
)
from rtserve.protocol.limits import MAX_ID_CHARS
from rtserve.protocol.load_request import config_from_grpc
from rtserve.protocol.shared_memory import SharedMemoryRegions, cuda_refusal, disabled
from rtserve.protocol.types import InferRequest, Timings
from rtserve.runtime.llm.params import SamplingParams
from rtserve.server.errors import grpc_error, grpc_trailers
from rtserve.server.security import _ADMIN_GRPC, _OPEN_GRPC, Guard, Unauthenticated
from rtserve.server.stats import inference_stats

_now = time.perf_counter_ns


def _unsent(*_: object) -> None:
    """The sink of a call refused before the dataplane: the frontend raises its error."""
    return None


log = logging.getLogger("rtserve.server.grpc")  # (where its failures were logged)


class _Malformed:
    """Stands in for a request message that did not parse."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _parser(message_class: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except Exception as exc:
            return _Malformed(f"malformed {message_class.__name__} message: {type(exc).__name__}")

    return parse


def _check(request: Any) -> Any:
    if isinstance(request, _Malformed):
        raise InvalidInput(request.reason)
    return request


Handler = Callable[[Any, Any, Any], Awaitable[Any]]


_CREDENTIALS = ("authorization", "x-api-key")


def check_call_headers(
    guard: Guard | None, method: str | None, metadata: list[tuple[str, str | bytes]]
) -> None:
    """Refuse a call from its headers, before its message is read or inflated: the key must
    be valid (an admin's for the admin methods; the model named in the message is checked
    by the handler). ``method``: None for an unknown one, which gets the same refusal as a
    known one (it is not revealed before authentication). Raises ``Unauthenticated`` or
    ``Forbidden``; also for a credential sent twice (either could be meant)."""
    auth = guard.auth if guard is not None else None
    if auth is None or method in _OPEN_GRPC:
        return
    found: dict[str, str] = {}
    for key, value in metadata:
        if key in _CREDENTIALS:
            if key in found:
                raise Unauthenticated(f"duplicate '{key}' metadata: send the credential once")
            found[key] = str(value)
    credential = found.get("authorization") or found.get("x-api-key")  # (as grpc_credential)
    if method in _ADMIN_GRPC:
        auth.check_admin(credential)
    else:
        auth.check_any(credential)


def _unary(fn: Handler) -> Handler:
    """Run a unary handler; any exception aborts the call with its mapped status."""

    @functools.wraps(fn)
    async def handler(self: Any, request: Any, context: Any) -> Any:
        try:
            if self.guard is not None:
                self.guard.grpc(fn.__name__, _check(request), context)
            return await fn(self, _check(request), context)
        except Exception as exc:
            code, details = grpc_error(exc)
            await context.abort(code, details, grpc_trailers(exc))

    return handler


class GrpcFrontend:
    def __init__(
        self,
        dataplane: DataPlane,
        max_message_bytes: int,
        control: ModelControl | None = None,
        guard: Guard | None = None,
        shm: SharedMemoryRegions | None = None,
    ) -> None:
        """``shm``: the system shared memory regions (None: the extension is off)."""
        self.control = control
        self.guard = guard
        self.shm = shm
        self.dataplane = dataplane
        self.max_message_bytes = max_message_bytes
        self.in_flight = 0
        self.last_request_s = 0.0  # time.monotonic() of the last inference RPC

    # ------------------------------------------------------------------ health & metadata
    @_unary
    async def ServerLive(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=self.dataplane.live())

    @_unary
    async def ServerReady(self, request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=self.dataplane.ready())

    @_unary
    async def ModelReady(self, request: Any, context: Any) -> Any:
        return pb.ModelReadyResponse(
            ready=self.dataplane.model_ready(request.name, request.version)
        )

    @_unary
    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        meta = self.dataplane.server_metadata()
        return pb.ServerMetadataResponse(
            name=meta.name, version=meta.version, extensions=list(meta.extensions)
        )

    @_unary
    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        meta = self.dataplane.model_metadata(request.name, request.version)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=meta.name,
            versions=list(meta.versions),
            platform=meta.platform,
            inputs=[tensor(name=t.name, datatype=t.datatype, shape=t.shape) for t in meta.inputs],
            outputs=[tensor(name=t.name, datatype=t.datatype, shape=t.shape) for t in meta.outputs],
        )

    @_unary
    async def ModelConfig(self, request: Any, context: Any) -> Any:
        cfg = self.dataplane.model_config(request.name, request.version)
        config = pb.ModelConfig(
            name=cfg.name,
            platform=cfg.platform,
            backend=cfg.backend,
            max_batch_size=cfg.max_batch_size,
            input=[
                pb.ModelInput(name=t.name, data_type=t.data_type, dims=t.dims) for t in cfg.inputs
            ],
            output=[
                pb.ModelOutput(name=t.name, data_type=t.data_type, dims=t.dims) for t in cfg.outputs
            ],
            dynamic_batching=pb.ModelDynamicBatching(
                preferred_batch_size=cfg.preferred_batch_sizes,
                max_queue_delay_microseconds=cfg.max_queue_delay_us,
                priority_levels=cfg.priority_levels,
                default_priority_level=cfg.default_priority,
            ),
            instance_group=[
                pb.ModelInstanceGroup(
                    name=cfg.name, kind=pb.ModelInstanceGroup.KIND_CPU, count=cfg.instance_count
                )
            ],
            parameters={k: pb.ModelParameter(string_value=v) for k, v in cfg.parameters},
        )
        return pb.ModelConfigResponse(config=config)

    @_unary
    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        versions = self.dataplane.statistics(request.name or None, request.version)
        response = pb.ModelStatisticsResponse()
        for v in versions:
            s = v.stats
            m = response.model_stats.add(
                name=v.name,
                version=v.version,
                last_inference=s.last_inference_ms,
                inference_count=s.inference_count,
                execution_count=s.execution_count,
            )
            for key, value in inference_stats(v).items():
                d = getattr(m.inference_stats, key)
                d.count, d.ns = value.count, value.ns
            for size, value in sorted(s.batch_sizes.items()):
                bs = m.batch_stats.add(batch_size=size)
                bs.compute_infer.count, bs.compute_infer.ns = value.count, value.ns
                bs.compute_input.count = bs.compute_output.count = value.count
        return response

    @_unary
    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        response = pb.RepositoryIndexResponse()
        for e in self.dataplane.repository_index():
            if request.ready and e.state != "READY":
                continue
            response.models.add(name=e.name, version=e.version, state=e.state, reason=e.reason)
        return response

    @_unary
    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        if self.control is None:
            raise InvalidInput("model control is not available")
        await self.control.load(request.model_name, config_from_grpc(request.parameters))
        return pb.RepositoryModelLoadResponse()

    @_unary
    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        if self.control is None:
            raise InvalidInput("model control is not available")
        await self.control.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # ------------------------------------------------------------------ shared memory
    def _regions(self, what: str) -> SharedMemoryRegions:
        if self.shm is None:
            raise disabled(what)
        return self.shm

    @_unary
    async def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        response = pb.SystemSharedMemoryStatusResponse()
        for r in self._regions("SystemSharedMemoryStatus").status(request.name):
            response.regions[r.name].CopyFrom(
                pb.SystemSharedMemoryStatusResponse.RegionStatus(
                    name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size
                )
            )
        return response

    @_unary
    async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        shm = self._regions("SystemSharedMemoryRegister")
        shm.register(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @_unary
    async def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        self._regions("SystemSharedMemoryUnregister").unregister(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    # CUDA shared memory, answered as Triton built without GPU support (cuda_refusal).
    @_unary
    async def CudaSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        refusal = cuda_refusal("status", request.name)
        if refusal is not None:
            raise refusal
        return pb.CudaSharedMemoryStatusResponse()

    @_unary
    async def CudaSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        refusal = cuda_refusal("register", request.name)
        assert refusal is not None
        raise refusal

    @_unary
    async def CudaSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        return pb.CudaSharedMemoryUnregisterResponse()

    # ------------------------------------------------------------------ inference
    async def _infer(self, message: Any, context: Any, timings: Timings | None = None) -> Any:
        """Check the call, hand it to the dataplane (which decodes it once the model is
        known, then records it), encode the answer; raises ``RTServeError``. ``timings``:
        the call's (its request id read into them)."""
        if timings is None:
            timings = Timings(received=_now())
        self.last_request_s = time.monotonic()
        dp = self.dataplane
        remaining = None
        try:
            message = _check(message)
            if self.guard is not None and context is not None:
                self.guard.grpc("ModelInfer", message, context)
            if context is not None:
                read_metadata(timings, context.invocation_metadata() or ())
                remaining = context.time_remaining()
        except Exception as exc:
            error = as_error(exc, "inference request")
            if isinstance(message, _Malformed):
                dp.refuse(_unsent, timings, error)
            else:  # (counted and logged under the model it names, as over HTTP)
                dp.record_refusal(timings, error, message.model_name, message.model_version)
            try:
                raise error from None
            finally:
                del error  # not held by this frame, which its traceback holds (a cycle)

        decoded: list[InferRequest] = []

        def decode(mv: Any) -> InferRequest:
            request = decode_model_infer(message, mv.decode_limits, self.shm)
            if remaining is not None and "timeout" not in request.parameters:
                request.parameters["timeout"] = max(1.0, remaining * 1e6)
            if request.outputs:
                decoded.append(request)  # its outputs may go to shared memory
            return request

        try:
            response = await dp.infer(message.model_name, message.model_version, timings, decode)
        except asyncio.CancelledError:  # the client cancelled: its queued work was dropped
            log.debug("gRPC request cancelled by its client (model %.100s)", message.model_name)
            raise
        try:
            in_shm = None
            if self.shm is not None and decoded:
                in_shm = self.shm.write_outputs(decoded[0].outputs or (), response.outputs)
            return encode_model_infer(response, in_shm), timings
        except Exception as exc:
            raise as_error(exc, "inference response") from None

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        self.in_flight += 1
        timings = Timings(received=_now())
        try:
            message, timings = await self._infer(request, context, timings)
        except RTServeError as exc:
            code, details = grpc_error(exc)
            await context.abort(code, details, grpc_trailers(exc) + error_metadata(timings))
        finally:
            self.in_flight -= 1
        context.set_trailing_metadata(grpc_metadata(timings))
        return message

    async def ModelStreamInfer(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        """Requests on a stream run concurrently (so they batch together); each answer is
        sent as soon as it is ready, carrying its request's id. Every request gets an answer:
        its result or an error message. While the stream's window is full (answers the
        client has not read) no further request is read: HTTP/2 flow control holds it."""
        window = _Window(STREAM_WINDOW, STREAM_WINDOW_BYTES)
        answers: Answers = asyncio.Queue()
        pending: set[asyncio.Task[None]] = set()
        reader = asyncio.get_running_loop().create_task(
            self._read_stream(request_iterator, context, window, answers, pending)
        )
        try:
            while (item := await answers.get()) is not None:
                yield item[0]
                window.release(item[1], item[2])
            await reader  # the reader's own failure, if any, ends the call
        finally:
            reader.cancel()
            for task in pending:
                task.cancel()

    async def _read_stream(
        self,
        requests: Any,
        context: Any,
        window: _Window,
        answers: Answers,
        pending: set[asyncio.Task[None]],
    ) -> None:
        """Start a task per request, up to the window; ends the answers with None once the
        client finished sending and every request was answered."""
        loop = asyncio.get_running_loop()
        try:
            async for request in requests:
                cost = 0 if isinstance(request, _Malformed) else request.ByteSize()
                window.take(cost)
                self.in_flight += 1
                task = loop.create_task(
                    self._stream_answer(request, cost, context, window, answers)
                )
                pending.add(task)
                task.add_done_callback(pending.discard)
                task.add_done_callback(self._stream_task_done)  # also if cancelled unstarted
                await window.room()
            if pending:
                await asyncio.wait(set(pending))
        finally:
            answers.put_nowait(None)

    def _stream_task_done(self, task: asyncio.Task[None]) -> None:
        self.in_flight -= 1

    async def _stream_answer(
        self,
        request: Any,
        cost: int,
        context: Any,
        window: _Window,
        answers: Answers,
    ) -> None:
        mv = self._generative(request)
        if mv is not None:
            await self._stream_generation(request, mv, cost, context, window, answers)
            return
        try:
            if self.guard is not None:
                self.guard.grpc("ModelStreamInfer", _check(request), context)
            message, _ = await self._infer(request, None)
            message.parameters["triton_final_response"].bool_param = True  # (as Triton)
            reply = pb.ModelStreamInferResponse(infer_response=message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reply = _stream_error(request, exc)
        size = reply.ByteSize()
        window.take_answer(size)
        answers.put_nowait((reply, cost + size, True))

    def _generative(self, request: Any) -> ModelVersion | None:
        """The generative model a stream request names, else None (answered as V2)."""
        if isinstance(request, _Malformed):
            return None
        entry = self.dataplane.registry.models.get(request.model_name)
        if entry is None or not entry.versions:
            return None
        mv = entry.versions.get(request.model_version or entry.latest)
        return mv if mv is not None and generation.engine_of(mv) is not None else None

    async def _stream_generation(
        self,
        request: Any,
        mv: ModelVersion,
        cost: int,
        context: Any,
        window: _Window,
        answers: Answers,
    ) -> None:
        """A decoupled answer: a response per piece of text as it is generated."""
        dp = self.dataplane
        timings = Timings(received=_now())

        def put(reply: Any, last: bool = False) -> None:
            size = reply.ByteSize()
            window.take_answer(size)
            answers.put_nowait((reply, size + (cost if last else 0), last))

        try:
            if self.guard is not None:
                self.guard.grpc("ModelStreamInfer", request, context)
            if context is not None:  # (as for ModelInfer: the access log's id)
                read_metadata(timings, context.invocation_metadata() or ())
            text, params, empty_final = _generation_request(request, mv)
            gen = await generation.prepare_async(
                dp, request.model_name, timings, params, prompt=text,
                version=request.model_version, request_id=request.id[:MAX_ID_CHARS],
            )  # fmt: skip
        except Exception as exc:
            put(
                _stream_error(request, generation.refused(dp, timings, exc, request.model_name)),
                True,
            )
            return
        try:
            async with aclosing(generation.events(dp, gen)) as events:
                async for event in events:
                    if not event.finished:
                        if event.text:
                            put(_text_response(request, mv, event.text, False))
                    elif empty_final:
                        if event.text:
                            put(_text_response(request, mv, event.text, False))
                        put(_text_response(request, mv, None, True), True)
                    else:
                        put(_text_response(request, mv, event.text, True), True)
        except Exception as exc:
            put(_stream_error(request, exc), True)


_NOT_SAMPLING = frozenset({"text_input", "stream", "exclude_input_in_output"})


def _generation_request(request: Any, mv: ModelVersion) -> tuple[str, SamplingParams, bool]:
    """(prompt, sampling, whether an empty final response was asked for) of a stream
    request to a generative model."""
    decoded = decode_model_infer(request, mv.decode_limits)
    settings = parameters_to_dict(request.parameters)
    text = None
    for t in decoded.inputs:
        values = t.data.reshape(-1)
        if t.name == "text_input":
            if t.datatype != "BYTES" or values.size != 1:
                raise InvalidInput("input 'text_input': expected one BYTES element (the prompt)")
            try:
                text = bytes(values[0]).decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidInput("input 'text_input': expected UTF-8 text") from None
        elif t.name not in _NOT_SAMPLING and values.size == 1:
            value = values[0]
            settings[t.name] = (
                value.decode("utf-8", "replace")
                if isinstance(value, bytes)
                else (value.item() if isinstance(value, np.generic) else value)
            )
    if text is None:
        raise InvalidInput("inputs: expected 'text_input' (BYTES, the prompt)")
    empty_final = settings.pop("triton_enable_empty_final_response", False) is True
    params = SamplingParams.from_mapping(settings, where="parameters.")
    return text, params.one_answer("parameters.n"), empty_final


def _text_response(request: Any, mv: ModelVersion, text: str | None, final: bool) -> Any:
    """One decoupled response: ``text_output`` (none in an empty final response) and the
    ``triton_final_response`` flag."""
    reply = pb.ModelInferResponse(
        model_name=mv.name, model_version=mv.version, id=request.id[:MAX_ID_CHARS]
    )
    reply.parameters["triton_final_response"].bool_param = final
    if text is not None:
        reply.outputs.add(name="text_output", datatype="BYTES", shape=[1])
        data = np.array([text.encode()], dtype=object)
        reply.raw_output_contents.append(encode_bytes_elements(data))
    return pb.ModelStreamInferResponse(infer_response=reply)


def _stream_error(request: Any, exc: Exception) -> Any:
    """The stream answer to a failed request: the error, and what identifies the request."""
    ok = not isinstance(request, _Malformed)
    return pb.ModelStreamInferResponse(
        error_message=grpc_error(exc)[1],
        infer_response=pb.ModelInferResponse(
            model_name=request.model_name[:MAX_ID_CHARS] if ok else "",
            model_version=request.model_version[:MAX_ID_CHARS] if ok else "",
            id=request.id[:MAX_ID_CHARS] if ok else "",
        ),
    )


# A stream's answers waiting to be sent: (message, bytes to release, its request's last?).
Answers = asyncio.Queue[tuple[Any, int, bool] | None]

# Per stream: requests read and not yet answered on the wire, and their request and answer
# bytes. At either bound the stream is not read until the client reads answers.
STREAM_WINDOW = 64
STREAM_WINDOW_BYTES = 16 << 20


class _Window:
    """What one stream holds: requests read and not yet sent back, and their bytes."""

    def __init__(self, count: int, nbytes: int) -> None:
        self.max_count, self.max_bytes = count, nbytes
        self.count = self.nbytes = 0
        self._room = asyncio.Event()
        self._room.set()

    def take(self, nbytes: int) -> None:
        self.count += 1
        self.take_answer(nbytes)

    def take_answer(self, nbytes: int) -> None:
        self.nbytes += nbytes
        self._update()

    def release(self, nbytes: int, last: bool = True) -> None:
        """An answer was sent; ``last``: its request's last (a generation sends many)."""
        self.count -= last
        self.nbytes -= nbytes
        self._update()

    async def room(self) -> None:
        await self._room.wait()

    def _update(self) -> None:
        if self.count < self.max_count and self.nbytes < self.max_bytes:
            self._room.set()
        else:
            self._room.clear()


SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]


@dataclass(frozen=True, slots=True)
class GrpcRoute:
    """One method of the service: ``handler(frontend, request, context)`` (a unary call's
    coroutine, or a streaming call's async iterator of answers); ``parse`` turns the
    request's bytes into its message (a malformed one into a value the handler refuses
    INVALID_ARGUMENT, instead of failing inside the transport); ``serialize`` the answer's
    message into bytes."""

    name: str
    handler: Callable[..., Any]
    parse: Callable[[bytes], Any]
    serialize: Callable[[Any], bytes]
    streaming: bool


def _route(handler: Callable[..., Any]) -> tuple[str, GrpcRoute]:
    """``handler``'s route, its messages as the service's descriptor declares them."""
    m = SERVICE.methods_by_name[handler.__name__]
    route = GrpcRoute(
        m.name,
        handler,
        _parser(getattr(pb, m.input_type.name)),
        getattr(pb, m.output_type.name).SerializeToString,
        m.client_streaming,
    )
    return f"/{SERVICE.full_name}/{m.name}", route


F = GrpcFrontend
# The one table of gRPC methods, by the path a call names (HTTP/2 ``:path``).
GRPC_ROUTES: dict[str, GrpcRoute] = dict(
    [
        _route(F.ModelInfer),
        _route(F.ModelStreamInfer),
        _route(F.ServerLive),
        _route(F.ServerReady),
        _route(F.ModelReady),
        _route(F.ServerMetadata),
        _route(F.ModelMetadata),
        _route(F.ModelConfig),
        _route(F.ModelStatistics),
        _route(F.RepositoryIndex),
        _route(F.RepositoryModelLoad),
        _route(F.RepositoryModelUnload),
        _route(F.SystemSharedMemoryStatus),
        _route(F.SystemSharedMemoryRegister),
        _route(F.SystemSharedMemoryUnregister),
        _route(F.CudaSharedMemoryStatus),
        _route(F.CudaSharedMemoryRegister),
        _route(F.CudaSharedMemoryUnregister),
    ]
)
assert len(GRPC_ROUTES) == len(SERVICE.methods), "every method of the service has a route"


class Method:
    """A route bound to one frontend, as a transport calls it: ``fn(request, context)``."""

    __slots__ = ("name", "fn", "parse", "serialize", "streaming")

    def __init__(self, name: str, fn: Any, parse: Any, serialize: Any, streaming: bool) -> None:
        self.name, self.fn, self.parse = name, fn, parse
        self.serialize, self.streaming = serialize, streaming


def bind_routes(frontend: GrpcFrontend) -> dict[str, Method]:
    """``GRPC_ROUTES`` with their handlers bound to ``frontend`` (as its own methods are:
    a call costs what calling ``frontend.ModelInfer`` does)."""
    return {
        path: Method(r.name, MethodType(r.handler, frontend), r.parse, r.serialize, r.streaming)
        for path, r in GRPC_ROUTES.items()
    }
