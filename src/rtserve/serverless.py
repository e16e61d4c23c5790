"""rtserve as an AWS Lambda function: the V2 routes behind API Gateway (REST API, payload
1.0; HTTP API, payload 2.0) and Lambda function URLs.

    ENV RTSERVE_MODEL_REPOSITORY=/var/task/models
    CMD ["rtserve.serverless.handler"]

The models are loaded and warmed once per process, at import (Lambda's init phase, which
SnapStart snapshots) when ``RTSERVE_MODEL_REPOSITORY`` is set, else at the first call. The
engine runs on an event-loop thread this module owns, so concurrent and successive
invocations share its batcher and response cache; an invocation pays only for inference.
Requests take the server's path: the same canonical paths, size limits, decoding, errors
(V2 shape ``{"error": ...}`` with the status the server answers) and routes. Binary tensor
bodies (the binary data extension) come and go base64-encoded. ``RTSERVE_CONFIG`` may name
a server config file (limits, response cache, keys, rate limit). Needs no ``awslambdaric``.

Every request passes the checks ``rtserve serve`` applies (``rtserve.api``): the
URL, header and body limits, then the keys of ``auth_file`` and the ``rate_limit_rps`` per
client address (the event's ``sourceIp``; a bucket per execution environment), before
any decoding. A setting the handler cannot honour (``tls_*``, ``shared_memory``) or an
unset ``RTSERVE_MODEL_REPOSITORY`` fails Lambda's init phase with the reason; a handler
started lazily (the variable set after import) answers 503 with the reason instead.

Generative models (``backend: llm``) answer the OpenAI-compatible routes (``/v1/...``) and
Triton's ``generate`` / ``generate_stream`` through the server's own code
(``server/generative.py``). API Gateway cannot stream a response: a streamed request
(``"stream": true``, ``generate_stream``) gets its server-sent events whole, in one body,
once generation ends.
"""

from __future__ import annotations

import atexit
import base64
import binascii
import logging
import os
import random
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from rtserve.api import checks
from rtserve.api.application import Application
from rtserve.api.call import CallData, gather
from rtserve.config import load_server_config
from rtserve.engine import Engine, SyncEngine
from rtserve.errors import ConfigError, InvalidInput, RouteNotFound
from rtserve.server.errors import http_error
from rtserve.server.paths import canonical_path

__all__ = ["ENV_CONFIG", "ENV_REPOSITORY", "engine", "handler", "shutdown"]

ENV_REPOSITORY = "RTSERVE_MODEL_REPOSITORY"
ENV_CONFIG = "RTSERVE_CONFIG"
# Set by Lambda in every execution environment: there, import is the init phase.
ENV_LAMBDA = "AWS_LAMBDA_FUNCTION_NAME"
log = logging.getLogger("rtserve")
ENTRY = "the Lambda handler"
FRONT = "API Gateway or the function URL"
NO_CONTROL = RouteNotFound(
    "model control is not offered by the serverless handler (deploy a new function version instead)"
)
# An HTTP header name (RFC 9110's token).
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# What a header value may not hold (as the HTTP parser refuses it): CR, LF, NUL.
_VALUE_CONTROL = re.compile("[\r\n\x00]")

# (status, headers, body bytes): one answer before it is shaped as a Lambda response.
Answer = tuple[int, dict[str, str], bytes]


@dataclass(frozen=True)
class HttpEvent:
    """The HTTP request an API Gateway or function URL event carries."""

    method: bytes
    path: str  # canonical (rtserve.server.paths)
    headers: dict[bytes, bytes]  # names in lower case
    body: bytes
    peer: str  # the client's address (requestContext's sourceIp): its rate limit bucket
    received_ns: int = 0


class _Runtime:
    """The engine on its loop thread and the V2 routes over its dataplane."""

    def __init__(self, repository: str, config_file: str | None) -> None:
        config = load_server_config(
            Path(config_file) if config_file else None, model_repository=Path(repository)
        )
        self.config = config
        engine = Engine(config)
        # The keys and limits first: a setting that cannot be honoured stops the start
        # before any model loads.
        self.app = Application.for_adapter(
            engine.dataplane, config, ENTRY, FRONT, control_refusal=NO_CONTROL
        )
        guard = self.app.guard
        if guard is not None:
            log.info(
                "serverless: keys %s, rate limit %s",
                "on (auth_file)" if guard.auth is not None else "off",
                f"{config.rate_limit_rps:g} requests/s per client address in this execution "
                "environment"
                if guard.limiter is not None
                else "off",
            )
        self.engine = engine.sync().start()


_lock = threading.Lock()
_runtime: _Runtime | None = None


def _forked() -> None:
    """In a forked child the parent's engine thread does not exist: start afresh there."""
    global _lock, _runtime
    _lock = threading.Lock()
    _runtime = None


os.register_at_fork(after_in_child=_forked)


def _started() -> _Runtime:
    """The process's runtime, started on first use (models loaded and warmed once)."""
    global _runtime
    with _lock:
        if _runtime is None:
            repository = os.environ.get(ENV_REPOSITORY)
            if not repository:
                raise ConfigError(f"{ENV_REPOSITORY}: not set (expected a model repository path)")
            _runtime = _Runtime(repository, os.environ.get(ENV_CONFIG))
        return _runtime


def engine() -> SyncEngine:
    """The engine this process serves from (started on first use)."""
    return _started().engine


def shutdown() -> None:
    """Answer what was accepted, release the models and the loop thread (at exit; tests).
    The next call starts afresh."""
    global _runtime
    with _lock:
        rt, _runtime = _runtime, None
    if rt is not None:
        rt.engine.stop()


# ---------------------------------------------------------------------- events
def _header_pairs(event: dict[str, Any]) -> list[tuple[bytes, bytes]]:
    """The event's headers as (lower-case name, value) pairs, one per name: a name given
    more than once (in either spelling, or in both objects) has its values joined by commas,
    as API Gateway joins repeated headers; ``headers`` over ``multiValueHeaders``."""
    multi, single = event.get("multiValueHeaders") or {}, event.get("headers") or {}
    for field, given in (("multiValueHeaders", multi), ("headers", single)):
        if not isinstance(given, dict):
            raise InvalidInput(f"event.{field}: expected an object of header names to values")
    joined: dict[bytes, list[str]] = {}
    for name, values in multi.items():
        key = _header_name("multiValueHeaders", name)
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise InvalidInput(
                f"event.multiValueHeaders[{name[:60]!r}]: expected a list of strings"
            )
        joined.setdefault(key, []).extend(values)
    from_single: dict[bytes, list[str]] = {}
    for name, value in single.items():
        key = _header_name("headers", name)
        if not isinstance(value, str):
            raise InvalidInput(
                f"event.headers[{name[:60]!r}]: expected a string, got {type(value).__name__}"
            )
        from_single.setdefault(key, []).append(value)
    joined.update(from_single)
    pairs = []
    for key, values in joined.items():
        value = ",".join(values)
        if _VALUE_CONTROL.search(value):
            raise InvalidInput(
                f"event.headers[{key[:60].decode()!r}]: a value with CR, LF or NUL characters"
            )
        try:
            pairs.append((key, value.encode()))
        except UnicodeEncodeError:  # (lone surrogates: \ud800 in the event's JSON)
            raise InvalidInput(
                f"event.headers[{key[:60].decode()!r}]: a value that is not valid Unicode"
            ) from None
    return pairs


def _header_name(field: str, name: Any) -> bytes:
    if not isinstance(name, str) or _HEADER_NAME.fullmatch(name) is None:
        raise InvalidInput(f"event.{field}: {str(name)[:60]!r} is not an HTTP header name")
    return name.lower().encode("ascii")


def _peer(event: dict[str, Any]) -> str:
    """The client's address as API Gateway saw it (payload 2.0: ``requestContext.http``;
    1.0: ``requestContext.identity``), never a header the client wrote; '?' without one
    (a direct invocation)."""
    context = event.get("requestContext")
    if not isinstance(context, dict):
        return "?"
    where = context.get("http") if event.get("version") == "2.0" else context.get("identity")
    ip = where.get("sourceIp") if isinstance(where, dict) else None
    return ip if isinstance(ip, str) and 0 < len(ip) <= 64 else "?"


def _method_and_path(event: dict[str, Any]) -> tuple[str, str]:
    """(method, path) of a payload 2.0 event (HTTP API, function URL) or a 1.0 one (REST API);
    a named stage's prefix is dropped from an HTTP API's ``rawPath``."""
    if event.get("version") == "2.0":
        context = event.get("requestContext") or {}
        http = context.get("http") if isinstance(context, dict) else None
        method = http.get("method") if isinstance(http, dict) else None
        path = event.get("rawPath")
        stage = context.get("stage") if isinstance(context, dict) else None
        if isinstance(path, str) and isinstance(stage, str) and stage and stage != "$default":
            prefix = f"/{stage}"
            if path == prefix or path.startswith(prefix + "/"):
                path = path[len(prefix) :] or "/"
    else:
        method, path = event.get("httpMethod"), event.get("path")
    if not isinstance(method, str) or not isinstance(path, str) or not _token(method):
        raise InvalidInput(
            "event: expected an API Gateway (payload 1.0 or 2.0) or function URL event "
            "with an HTTP method and path"
        )
    return method.upper(), path


def _token(method: str) -> bool:
    """An HTTP method: ASCII letters (GET, POST, ...)."""
    return 0 < len(method) <= 32 and method.isascii() and method.isalpha()


def _body(event: dict[str, Any], limit: int) -> bytes:
    body = event.get("body")
    if body is None:
        return b""
    if not isinstance(body, str):
        raise InvalidInput("event.body: expected a string")
    encoded = event.get("isBase64Encoded", False)
    if encoded in ("true", "false"):  # (some gateways' test consoles send strings)
        encoded = encoded == "true"
    if not isinstance(encoded, bool):
        raise InvalidInput(f"event.isBase64Encoded: expected true or false, got {encoded!r:.40}")
    # Sized before decoding: base64 decodes to 3/4 of its length at most, and UTF-8 takes
    # a byte per character at least.
    least = (len(body) - 4) * 3 // 4 if encoded else len(body)
    if least > limit:
        raise checks.body_too_large(least, limit)
    if encoded:
        try:
            raw = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidInput("event.body: isBase64Encoded is true but it is not base64") from None
    else:
        try:
            raw = body.encode()
        except UnicodeEncodeError:  # (lone surrogates: \ud800 in the event's JSON)
            raise InvalidInput("event.body: not valid Unicode") from None
    if len(raw) > limit:
        raise checks.body_too_large(len(raw), limit)
    return raw


def parse_event(event: Any, rt: _Runtime) -> HttpEvent:
    """The request in ``event``, checked against the server's URL, header and body limits."""
    received = time.perf_counter_ns()  # (the event's arrival)
    if not isinstance(event, dict):
        raise InvalidInput("event: expected a JSON object")
    method, path = _method_and_path(event)
    config = rt.config
    try:
        raw_path = path.encode()
    except UnicodeEncodeError:
        raise InvalidInput("event: the request path is not valid Unicode") from None
    query = event.get("rawQueryString")  # (payload 2.0; counted as the server counts it)
    target = len(raw_path) + (len(query) + 1 if isinstance(query, str) and query else 0)
    headers = checks.request_headers(config, target, _header_pairs(event))
    return HttpEvent(
        method.encode("latin-1"),
        canonical_path(raw_path),
        headers,
        _body(event, config.max_request_bytes),
        _peer(event),
        received,
    )


# ---------------------------------------------------------------------- answers
def _text_headers(headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in headers}


def _error(exc: BaseException) -> Answer:
    status, body, headers = http_error(exc)
    return status, _text_headers(headers), body


async def _answer(rt: _Runtime, ev: HttpEvent) -> Answer:
    """The application's reply, gathered into one body (API Gateway cannot stream); runs
    on the engine's loop (one rate limiter, one dataplane, whichever thread called)."""
    call = CallData(ev.method, ev.path, ev.headers, ev.body, ev.received_ns, checked=False)
    status, body, headers = await gather(rt.app.reply(call, ev.peer))
    if ev.method == b"HEAD":  # (the GET's status and headers, no body)
        body = b""
    return status, _text_headers(headers), body


def _lambda_response(answer: Answer) -> dict[str, Any]:
    status, headers, body = answer
    if headers.get("content-type", "").startswith("application/octet-stream"):
        text, encoded = base64.b64encode(body).decode("ascii"), True
    else:
        text, encoded = body.decode("utf-8", "replace"), False
    return {"statusCode": status, "headers": headers, "body": text, "isBase64Encoded": encoded}


def handler(event: Any, context: Any) -> dict[str, Any]:
    """The Lambda entry point: an API Gateway / function URL event in, its HTTP answer out.
    Never raises: every failure is an HTTP status with an error body (OpenAI's shape on
    ``/v1``, else V2's)."""
    try:
        rt = _started()
    except ConfigError as exc:  # (started lazily: the client is told why, not only the log)
        log.error("serverless: cannot serve: %s", exc)
        return _lambda_response(_not_configured(exc))
    except Exception as exc:
        log.exception("serverless: the engine did not start")
        return _lambda_response(_error(exc))
    try:
        ev = parse_event(event, rt)
        return _lambda_response(rt.engine.run(_answer(rt, ev)))
    except Exception as exc:
        return _lambda_response(_error(exc))


def _not_configured(exc: ConfigError) -> Answer:
    body = f"the function is not configured to serve: {exc}"
    return 503, {"content-type": "application/json"}, orjson.dumps({"error": body})


# ---------------------------------------------------------------------- SnapStart
def _before_snapshot() -> None:
    """Load and warm the models into the snapshot; close connections (Redis) that a
    restored copy must not share."""
    rt = _started()

    async def disconnect() -> None:
        for mv in rt.engine.engine.registry.loaded_versions():
            redis = mv.cache.redis if mv.cache is not None else None
            if redis is not None:
                await redis.disconnect()

    rt.engine.run(disconnect())


def _after_restore() -> None:
    """Fresh random state in each restored copy (a snapshot would otherwise replay it)."""
    random.seed()
    np.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()


def _register_snapshot_hooks() -> bool:
    try:
        from snapshot_restore_py import register_after_restore, register_before_snapshot
    except ImportError:
        return False
    register_before_snapshot(_before_snapshot)
    register_after_restore(_after_restore)
    return True


def _at_exit(stop: Any) -> None:
    """Run ``stop`` at interpreter exit before ``concurrent.futures`` shuts its executors
    (threading's exit hooks run first; a plain ``atexit`` hook runs after them, and a model
    that hands its stop to an executor then failed with "cannot schedule new futures
    after shutdown")."""
    import concurrent.futures.thread  # noqa: F401  (its hook first: ours then runs before it)

    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(stop)
            return
    except RuntimeError:  # (already shutting down)
        pass
    atexit.register(stop)


_register_snapshot_hooks()
_at_exit(shutdown)
if os.environ.get(ENV_REPOSITORY) or os.environ.get(ENV_LAMBDA):
    # Lambda's init phase: the models load into the snapshot; a missing or bad setting
    # fails the init with its reason (an unset RTSERVE_MODEL_REPOSITORY included).
    _started()
