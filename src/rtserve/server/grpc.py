"""The V2 gRPC frontend (``inference.GRPCInferenceService``) on grpc.aio.

Thin: decode into an ``InferRequest``, call the dataplane, encode. Errors abort the RPC with
the code the error class maps to (INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE, ...).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from rtserve.core.dataplane import DataPlane, outcome_of
from rtserve.errors import RTServeError
from rtserve.observability.metrics import Metrics, server_timing
from rtserve.protocol import grpc_service_pb2 as pb
from rtserve.protocol import grpc_service_pb2_grpc as pb_grpc
from rtserve.protocol.grpc_codec import decode_model_infer, encode_model_infer
from rtserve.protocol.types import Timings
from rtserve.server.stats import model_statistics

_now = time.perf_counter_ns


class GrpcFrontend(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, dataplane: DataPlane, metrics: Metrics, max_message_bytes: int) -> None:
        self.dataplane = dataplane
        self.metrics = metrics
        self.max_message_bytes = max_message_bytes
        self.in_flight = 0
        self.last_request_s = 0.0  # time.monotonic() of the last inference RPC

    # ------------------------------------------------------------------ health & metadata
    async def ServerLive(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=self.dataplane.live())

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=self.dataplane.ready())

    async def ModelReady(self, request: Any, context: Any) -> Any:
        try:
            return pb.ModelReadyResponse(
                ready=self.dataplane.model_ready(request.name, request.version)
            )
        except RTServeError as exc:
            await context.abort(exc.grpc_code, exc.message)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        meta = self.dataplane.server_metadata()
        return pb.ServerMetadataResponse(
            name=meta["name"], version=meta["version"], extensions=meta["extensions"]
        )

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        try:
            meta = self.dataplane.model_metadata(request.name, request.version)
        except RTServeError as exc:
            await context.abort(exc.grpc_code, exc.message)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=meta["name"],
            versions=meta["versions"],
            platform=meta["platform"],
            inputs=[tensor(**t) for t in meta["inputs"]],
            outputs=[tensor(**t) for t in meta["outputs"]],
        )

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        try:
            cfg = self.dataplane.model_config(request.name, request.version)
        except RTServeError as exc:
            await context.abort(exc.grpc_code, exc.message)
        db = cfg["dynamic_batching"]
        config = pb.ModelConfig(
            name=cfg["name"],
            platform=cfg["platform"],
            backend=cfg["backend"],
            max_batch_size=cfg["max_batch_size"],
            input=[
                pb.ModelInput(name=t["name"], data_type=t["data_type"], dims=t["dims"])
                for t in cfg["input"]
            ],
            output=[
                pb.ModelOutput(name=t["name"], data_type=t["data_type"], dims=t["dims"])
                for t in cfg["output"]
            ],
            dynamic_batching=pb.ModelDynamicBatching(
                preferred_batch_size=db["preferred_batch_size"],
                max_queue_delay_microseconds=db["max_queue_delay_microseconds"],
            ),
            instance_group=[
                pb.ModelInstanceGroup(
                    name=g["name"], kind=pb.ModelInstanceGroup.KIND_CPU, count=g["count"]
                )
                for g in cfg["instance_group"]
            ],
        )
        return pb.ModelConfigResponse(config=config)

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        try:
            stats = model_statistics(self.dataplane, request.name or None, request.version)
        except RTServeError as exc:
            await context.abort(exc.grpc_code, exc.message)
        response = pb.ModelStatisticsResponse()
        for s in stats:
            m = response.model_stats.add(
                name=s["name"],
                version=s["version"],
                last_inference=s["last_inference"],
                inference_count=s["inference_count"],
                execution_count=s["execution_count"],
            )
            for key, value in s["inference_stats"].items():
                d = getattr(m.inference_stats, key)
                d.count, d.ns = value["count"], value["ns"]
            for b in s["batch_stats"]:
                bs = m.batch_stats.add(batch_size=b["batch_size"])
                for key in ("compute_input", "compute_infer", "compute_output"):
                    d = getattr(bs, key)
                    d.count, d.ns = b[key]["count"], b[key]["ns"]
        return response

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        response = pb.RepositoryIndexResponse()
        for row in self.dataplane.repository_index():
            response.models.add(**row)
        return response

    # ------------------------------------------------------------------ inference
    async def _infer(self, request: Any, context: Any) -> tuple[Any, Timings]:
        """The response message and the request's timings; errors raise RTServeError."""
        timings = Timings(received=_now())
        self.last_request_s = time.monotonic()
        mm = None
        try:
            mv = self.dataplane.resolve_name(request.model_name, request.model_version, timings)
            mm = mv.metrics
            infer_request = decode_model_infer(request)
            infer_request.timings = timings
            remaining = context.time_remaining() if context is not None else None
            if remaining is not None and "timeout" not in infer_request.parameters:
                infer_request.parameters["timeout"] = max(1.0, remaining * 1e6)
            response = await self.dataplane.infer(infer_request, mv)
            message = encode_model_infer(response)
            end = _now()
            rows = infer_request.inputs[0].shape[0] if mv.config.max_batch_size else 1
            mm.observe_success(timings, rows, end)
            return message, timings
        except RTServeError as exc:
            if mm is not None:
                mm.observe_failure(outcome_of(exc), timings, _now())
            else:
                self.metrics.unrouted.labels(outcome_of(exc)).inc()
            raise

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        self.in_flight += 1
        try:
            message, timings = await self._infer(request, context)
            metadata = [("server-timing", server_timing(timings, _now()))]
            if timings.cache:
                metadata.append(("x-rtserve-cache", timings.cache))
            context.set_trailing_metadata(metadata)
            return message
        except RTServeError as exc:
            await context.abort(exc.grpc_code, exc.message)
        finally:
            self.in_flight -= 1

    async def ModelStreamInfer(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        """Requests on a stream run concurrently (so they batch together); each answer is
        sent as soon as it is ready, carrying its request's id."""
        answers: asyncio.Queue[Any] = asyncio.Queue()
        pending: set[asyncio.Task[None]] = set()

        async def answer(request: Any) -> None:
            try:
                message, _ = await self._infer(request, None)
                await answers.put(pb.ModelStreamInferResponse(infer_response=message))
            except RTServeError as exc:
                await answers.put(
                    pb.ModelStreamInferResponse(
                        error_message=exc.message,
                        infer_response=pb.ModelInferResponse(
                            model_name=request.model_name,
                            model_version=request.model_version,
                            id=request.id,
                        ),
                    )
                )
            finally:
                self.in_flight -= 1

        async def read() -> None:
            async for request in request_iterator:
                self.in_flight += 1
                task = asyncio.get_running_loop().create_task(answer(request))
                pending.add(task)
                task.add_done_callback(pending.discard)

        reader = asyncio.get_running_loop().create_task(read())
        try:
            while True:
                if answers.empty() and reader.done() and not pending:
                    break
                getter = asyncio.ensure_future(answers.get())
                waiters: set[asyncio.Future[Any]] = {getter}
                if not reader.done():
                    waiters.add(reader)
                done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield getter.result()
                else:
                    getter.cancel()
                    if not pending and answers.empty():
                        break
                    # The client finished sending; drain the answers still to come.
                    while pending or not answers.empty():
                        yield await answers.get()
                    break
            reader.result()
        finally:
            reader.cancel()
            for task in pending:
                task.cancel()


async def start_grpc_server(
    frontend: GrpcFrontend, host: str, port: int, reuse_port: bool = False
) -> tuple[grpc.aio.Server, int]:
    limit = frontend.max_message_bytes
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 1 if reuse_port else 0),
        ]
    )
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(frontend, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind gRPC to {host}:{port}")
    await server.start()
    return server, bound
