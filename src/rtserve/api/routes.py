"""The one route table of every HTTP entry (``rtserve serve``, Ray, Lambda); gRPC's, by
method path, is ``grpc_service.GRPC_ROUTES``.

A request takes the first route whose method and path match: inference first (the hot
path: one comparison and one suffix test), then model control, the generative routes,
and the rest of V2. A route is one line::

    Route(b"POST", exact("/v1/embeddings"), llm(G.embeddings), LLM_BODY),

placed before the catch-alls (``prefix("/v1/")``, the last route); ``G`` is
``GenerativeRoutes``, whose method ``embeddings(request, peer, body)`` answers it.
``handler(app, call, peer)`` returns a ``Reply``; ``head(app, path)``, when given, runs at a
POST's head before its body is read: it may refuse (an unknown model: 404) and returns the
largest body the route reads (None: ``max_request_bytes``). ``HEAD`` matches ``GET`` routes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rtserve.api import v2
from rtserve.api.call import Call, Reply
from rtserve.errors import RouteNotFound
from rtserve.protocol.load_request import MAX_LOAD_BODY_BYTES
from rtserve.server.generative import GenerativeRoutes

if TYPE_CHECKING:
    from rtserve.api.application import Application

Handler = Callable[["Application", Call, str], Reply]
Head = Callable[["Application", str], "int | None"]
Match = Callable[[str], bool]
G = GenerativeRoutes


@dataclass(frozen=True, slots=True)
class Route:
    method: bytes | None  # None: any method
    match: Match
    handler: Handler
    head: Head | None = None


def exact(path: str) -> Match:
    return path.__eq__


def prefix(start: str) -> Match:
    return lambda path: path.startswith(start)


def suffix(end: str) -> Match:
    return lambda path: path.endswith(end)


def _anything(path: str) -> bool:
    return True


def llm(route: Callable[..., Reply]) -> Handler:
    """A handler running ``route(routes, call, peer, body)`` of ``GenerativeRoutes`` on the
    inflated body."""
    return lambda app, call, peer: app.generative.reply(call, peer, route)


def _llm_body(app: Application, path: str) -> int:
    return app.generative.body_limit()  # (from the models' max_model_len)


LLM_BODY: Head = _llm_body


def _infer_head(app: Application, path: str) -> None:
    app.resolve_infer(path)


def _load_body(app: Application, path: str) -> int:
    return MAX_LOAD_BODY_BYTES  # a load body has a config file's size limit


INFER = Route(b"POST", suffix("/infer"), v2.infer, _infer_head)
ROUTES: list[Route] = [
    INFER,
    Route(b"POST", prefix("/v2/repository/models/"), v2.model_control, _load_body),
    Route(b"POST", exact("/v1/chat/completions"), llm(G.completions), LLM_BODY),
    Route(b"POST", exact("/v1/completions"), llm(G.completions), LLM_BODY),
    Route(b"POST", exact("/v1/responses"), llm(G.responses), LLM_BODY),
    Route(b"POST", exact("/v1/embeddings"), llm(G.embeddings), LLM_BODY),
    Route(b"GET", exact("/v1/models"), llm(G.models)),
    Route(b"GET", prefix("/v1/models/"), llm(G.model)),
    Route(None, prefix("/v1/"), llm(G.unknown), LLM_BODY),  # (404 in OpenAI's shape)
    Route(None, suffix("/generate"), llm(G.triton), LLM_BODY),
    Route(None, suffix("/generate_stream"), llm(G.triton), LLM_BODY),
    Route(None, _anything, v2.other, v2.other_head),
]


def find(method: bytes, path: str) -> Route:
    """The route of a request (the last one takes every path). The first (inference) is
    tested before the loop: the hot path allocates no iterator."""
    first = ROUTES[0]
    if first.method == method and first.match(path):
        return first
    if method == b"HEAD":
        method = b"GET"
    for route in ROUTES:
        if (route.method is None or route.method == method) and route.match(path):
            return route
    raise RouteNotFound(f"no route for {method.decode(errors='replace')} {path[:200]}")
