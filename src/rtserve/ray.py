"""rtserve on Ray Serve: a model repository as one Serve deployment.

Each replica owns an ``rtserve.Engine`` (its models, batcher, cache and metrics) and answers
the V2 HTTP routes itself: Ray's proxy hands the request straight to the replica, which
decodes it, calls ``DataPlane.infer`` (batching happens there, not in ``@serve.batch``) and
encodes the answer, as ``rtserve serve`` does. Generative models (``backend: llm``) are
served on the OpenAI-compatible routes (``/v1/...``) and Triton's ``generate`` /
``generate_stream`` by the same code as ``rtserve serve`` (``server/generative.py``),
streamed through Ray's ``StreamingResponse``; a client that disconnects (Ray cancels the
request) aborts its sequence.

```python
from ray import serve
import rtserve.ray

serve.run(rtserve.ray.app("examples/repository", num_replicas=2), route_prefix="/")
```

or ``serve run rtserve.ray:build repository=examples/repository num_replicas=2``, or a
Serve config file (``deploy/ray/serve.yaml``) for ``serve deploy``.

Every request passes the checks ``rtserve serve`` applies (``rtserve.api``): the
URL, header and body limits, the keys of ``auth_file`` and the ``rate_limit_rps`` per
client address (the address Ray's proxy saw; a bucket per replica), before any decoding.
A setting a replica cannot honour (``tls_*``, ``shared_memory``) fails its start, naming
the setting.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.deployment import Application as ServeApplication
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from rtserve.api import checks
from rtserve.api.application import Application
from rtserve.api.call import Answer, CallData, Streamed, settle
from rtserve.api.context import error_reply
from rtserve.config import ServerConfig, load_server_config
from rtserve.engine import Engine
from rtserve.errors import ConfigError, NotSupported
from rtserve.server.paths import canonical_path

__all__ = ["AsgiEntry", "RTServeDeployment", "app", "build"]

REPLICA_HEADER = "x-rtserve-replica"
ENTRY = "the Ray deployment"
FRONT = "Ray's proxy (serve.start's http_options)"
NO_CONTROL = NotSupported(
    "model control is not offered through Ray Serve: each replica owns its "
    "models; change the repository and redeploy the application"
)
_now = time.perf_counter_ns


def _headers(pairs: list[tuple[bytes, bytes]], replica: str) -> dict[str, str]:
    """Response headers for Starlette, less ``x-request-id`` (Ray's proxy echoes it, or
    makes one), with the replica's id."""
    out = {k.decode("latin-1"): v.decode("latin-1") for k, v in pairs if k != b"x-request-id"}
    out[REPLICA_HEADER] = replica
    return out


class AsgiEntry:
    """A Starlette request (an ASGI scope) into a call of the application, its reply into a
    Starlette response: the part of a replica that sees requests, without Ray."""

    def __init__(self, application: Application, config: ServerConfig, replica: str) -> None:
        self.app = application
        self.config = config
        self.replica = replica
        self.last_request = 0.0

    async def __call__(self, request: Request) -> Response:
        received = _now()
        self.last_request = time.monotonic()
        path = ""
        try:
            path = self._path(request)
            headers = self._head(request)
            peer = request.client.host if request.client else "?"
            self.app.check_credentials(peer, path, headers)
            body = await self._body(request) if request.method == "POST" else b""
        except Exception as exc:
            return self._response(error_reply(path, exc))
        call = CallData(request.method.encode(), path, headers, body, received)
        reply = await settle(self.app.reply(call, peer))
        if isinstance(reply, Streamed):
            return StreamingResponse(reply.chunks, 200, _headers(reply.headers, self.replica))
        return self._response(reply)

    def _path(self, request: Request) -> str:
        """The canonical path below the application's route prefix."""
        scope = request.scope
        path = canonical_path(scope.get("raw_path") or scope["path"].encode())
        root = scope.get("root_path", "").rstrip("/")
        if root and path.startswith(root + "/"):
            path = path[len(root) :]
        return path

    def _head(self, request: Request) -> dict[bytes, bytes]:
        """The request's headers within the server's URL and header limits, and a declared
        body within ``max_request_bytes`` (refused before the key, as the server does)."""
        scope = request.scope
        target = len(scope.get("raw_path") or scope["path"].encode()) + len(
            scope.get("query_string", b"")
        )
        headers = checks.request_headers(self.config, target, scope["headers"])
        declared = headers.get(b"content-length", b"")
        limit = self.config.max_request_bytes
        if declared.isdigit() and int(declared) > limit:
            raise checks.body_too_large(int(declared), limit)
        return headers

    async def _body(self, request: Request) -> bytes:
        """The body, read no further than ``max_request_bytes``: a body that grows past it
        is refused as soon as it does."""
        limit = self.config.max_request_bytes
        pieces: list[bytes] = []
        size = 0
        async for piece in request.stream():
            size += len(piece)
            if size > limit:
                raise checks.body_too_large(size, limit)
            pieces.append(piece)
        return b"".join(pieces)

    def _response(self, answer: Answer) -> Response:
        status, body, headers = answer
        return Response(body, status, _headers(headers, self.replica))


class RTServeDeployment:
    """One Serve replica: an Engine over the repository answering the V2 HTTP routes.

    Model control (load / unload) is refused: each replica owns its models, so a load on
    one would leave the others different; redeploy the application instead."""

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self,
        repository: str,
        settings: Mapping[str, Any] | None = None,
        config_file: str | None = None,
    ) -> None:
        """``settings``: ``ServerConfig`` fields; ``config_file``: an rtserve server YAML.
        The models load and warm up here, on the loop that then runs every request."""
        config = load_server_config(
            Path(config_file) if config_file else None,
            model_repository=Path(repository),
            **dict(settings or {}),
        )
        self.config = config
        self.engine = Engine(config)
        # The keys and limits first: a setting that cannot be honoured stops the start
        # before any model loads.
        application = Application.for_adapter(
            self.engine.dataplane, config, ENTRY, FRONT, control_refusal=NO_CONTROL
        )
        replica = serve.get_replica_context().replica_id.to_full_id_str()
        self.entry = AsgiEntry(application, config, replica)
        self.engine.add_activity(self._more_expected)
        await self.engine.start()

    def _more_expected(self) -> bool:
        """Whether a request may arrive soon: one arrived in the last second (the proxy's
        connections are not visible here, as with gRPC in ``rtserve serve``)."""
        return time.monotonic() - self.entry.last_request < 1.0

    async def __call__(self, request: Request) -> Response:
        return await self.entry(request)

    def check_health(self) -> None:
        """Ray's replica health check: failing models make the replica unhealthy."""
        if not self.engine.ready():
            failed = [
                f"{m.name} ({m.reason[:300]})" if m.reason else m.name
                for m in self.engine.models()
                if m.state != "READY"
            ]
            raise RuntimeError(
                "rtserve engine is not ready: "
                + ("; ".join(failed[:5]) if failed else "it is stopping")
            )

    async def __del__(self) -> None:
        """Answer what was accepted, then release the models (Ray calls this at shutdown)."""
        if self.engine.started:
            await self.engine.stop()


def app(
    repository: str | os.PathLike[str],
    *,
    num_replicas: int = 1,
    autoscaling_config: Mapping[str, Any] | None = None,
    max_ongoing_requests: int = 64,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    settings: Mapping[str, Any] | None = None,
    config_file: str | None = None,
    name: str = "rtserve",
    access_log: bool = False,
) -> ServeApplication:
    """The repository as a bound Serve application (pass it to ``serve.run``).

    ``autoscaling_config``: Ray's fields (``min_replicas``, ``max_replicas``,
    ``target_ongoing_requests``, ...); when given it replaces ``num_replicas``.
    ``max_ongoing_requests``: requests the proxy sends one replica at once; the batcher
    needs several in flight to batch, so keep it above the model's ``max_batch_size``.
    ``num_cpus`` / ``num_gpus``: each replica's ``ray_actor_options``. ``access_log``: Ray's
    per-request log line (off, as rtserve's own access log is by default)."""
    options: dict[str, Any] = {
        "name": name,
        "max_ongoing_requests": max_ongoing_requests,
        "ray_actor_options": {"num_cpus": num_cpus, "num_gpus": num_gpus},
        "logging_config": {"enable_access_log": access_log},
    }
    if autoscaling_config is not None:
        options["autoscaling_config"] = dict(autoscaling_config)
    else:
        options["num_replicas"] = num_replicas
    deployment = serve.deployment(RTServeDeployment).options(**options)
    return deployment.bind(str(Path(repository).resolve()), dict(settings or {}), config_file)


_ARGS: dict[str, type] = {
    "repository": str,
    "num_replicas": int,
    "autoscaling_config": dict,
    "max_ongoing_requests": int,
    "num_cpus": float,
    "num_gpus": float,
    "settings": dict,
    "config_file": str,
    "name": str,
    "access_log": bool,
}


def _arg(key: str, value: Any) -> Any:
    """One builder argument as ``app`` takes it (``serve run``'s ``key=value`` are strings)."""
    kind = _ARGS.get(key)
    if kind is None:
        raise ConfigError(
            f"rtserve.ray:build: unknown argument {key!r} (expected {', '.join(_ARGS)})"
        )
    if kind is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"rtserve.ray:build: {key}: expected a mapping, got {value!r}")
        return dict(value)
    if kind is bool:
        if isinstance(value, bool) or str(value).lower() in ("true", "false"):
            return value if isinstance(value, bool) else str(value).lower() == "true"
        raise ConfigError(f"rtserve.ray:build: {key}: expected true or false, got {value!r}")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"rtserve.ray:build: {key}: expected {kind.__name__}, got {value!r}"
        ) from None


def build(args: dict[str, Any]) -> ServeApplication:
    """The application builder for ``serve run rtserve.ray:build repository=...`` and the
    ``args`` of a Serve config file; the arguments are ``app``'s."""
    if "repository" not in args:
        raise ConfigError("rtserve.ray:build: the argument 'repository' is required")
    parsed = {key: _arg(key, value) for key, value in args.items()}
    return app(parsed.pop("repository"), **parsed)
