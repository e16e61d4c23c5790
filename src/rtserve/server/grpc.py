"""The V2 gRPC service on grpc.aio: an adapter from grpcio's calls to the service's route
table (``rtserve.api.grpc_service.GRPC_ROUTES``), plus the servers that share the port.

grpcio parses each request with its route's ``parse``, calls its handler with grpcio's
servicer context, and serializes the answer; ``_HeaderCheck`` applies the keys from the
call's headers before its message is read (``check_call_headers``, as the HTTP/2 transport
does).
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from rtserve.api.grpc_service import (
    GRPC_ROUTES,
    SERVICE,
    GrpcFrontend,
    Method,
    bind_routes,
    check_call_headers,
)
from rtserve.errors import RTServeError
from rtserve.server.errors import grpc_error
from rtserve.server.security import Guard

__all__ = [
    "GRPC_SERVERS",
    "SERVICE",
    "GrpcFrontend",
    "GrpcServers",
    "Method",
    "check_call_headers",
    "start_grpc_server",
]


def _generic_handler(frontend: GrpcFrontend) -> grpc.GenericRpcHandler:
    """The service's method handlers for grpcio, from the route table."""
    handlers = {}
    for m in bind_routes(frontend).values():
        make = (
            grpc.stream_stream_rpc_method_handler
            if m.streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[m.name] = make(m.fn, request_deserializer=m.parse, response_serializer=m.serialize)
    return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)


GRPC_IDLE_MS = 300_000
GRPC_MAX_STREAMS = 1024
GRPC_MAX_RPCS = 10_000
# A grpc.aio server accepts one new call at a time (a completion-queue round trip and a loop
# wakeup each). Several servers on the port (SO_REUSEPORT: the kernel spreads connections over
# them) accept in parallel: 1.5x the calls for the same CPU, measured in docs/deploy.md.
GRPC_SERVERS = 8


class GrpcServers:
    """The grpc.aio servers that share the gRPC port, stopped together."""

    def __init__(self, servers: list[grpc.aio.Server]) -> None:
        self.servers = servers

    async def stop(self, grace: float | None) -> None:
        await asyncio.gather(*(s.stop(grace) for s in self.servers))


async def start_grpc_server(
    frontend: GrpcFrontend,
    host: str,
    port: int,
    reuse_port: bool = False,
    credentials: grpc.ServerCredentials | None = None,
    servers: int = GRPC_SERVERS,
) -> tuple[GrpcServers, int]:
    """``servers`` grpc.aio servers on one port (``port`` 0: a free one); ``reuse_port``: other
    processes share the port (``--workers``); ``credentials``: serve over TLS (None:
    plaintext). Together they hold at most ``GRPC_MAX_RPCS`` calls in progress."""
    started: list[grpc.aio.Server] = []
    try:
        for _ in range(servers):
            server = _grpc_server(
                frontend, max(1, GRPC_MAX_RPCS // servers), reuse_port or servers > 1
            )
            started.append(server)
            port = _bind(server, host, port, credentials)
            await server.start()
    except BaseException:
        await GrpcServers(started).stop(0)
        raise
    return GrpcServers(started), port


class _HeaderCheck(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """``check_call_headers`` for grpcio's calls, before their handler (with keys on)."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        route = GRPC_ROUTES.get(str(details.method))
        method = route.name if route is not None else None
        metadata = [(str(k), v) for k, v in details.invocation_metadata or ()]
        try:
            check_call_headers(self.guard, method, metadata)
        except RTServeError as exc:
            code, message = grpc_error(exc)

            async def refuse(_: Any, context: Any) -> None:
                await context.abort(code, message)

            if route is not None and route.streaming:
                return grpc.stream_stream_rpc_method_handler(refuse)
            return grpc.unary_unary_rpc_method_handler(refuse)
        return await continuation(details)


def _grpc_server(frontend: GrpcFrontend, max_rpcs: int, reuse_port: bool) -> grpc.aio.Server:
    limit = frontend.max_message_bytes
    guard = frontend.guard
    interceptors = []
    if guard is not None and guard.auth is not None:
        interceptors.append(_HeaderCheck(guard))
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 1 if reuse_port else 0),
            # Idle or never-finished connections are closed (slow clients hold no socket
            # forever); streams per connection are bounded.
            ("grpc.max_connection_idle_ms", GRPC_IDLE_MS),
            ("grpc.max_concurrent_streams", GRPC_MAX_STREAMS),
            ("grpc.http2.max_pings_without_data", 2),
        ],
        # Beyond this many RPCs in progress new ones are refused RESOURCE_EXHAUSTED at once.
        maximum_concurrent_rpcs=max_rpcs,
    )
    server.add_generic_rpc_handlers((_generic_handler(frontend),))
    return server


def _bind(
    server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None
) -> int:
    if credentials is not None:
        bound = server.add_secure_port(f"{host}:{port}", credentials)
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind gRPC to {host}:{port}")
    return bound
