"""The error hierarchy: each error maps once to an HTTP status and a gRPC code."""

from __future__ import annotations

import logging

import grpc


class RTServeError(Exception):
    """Base of every error rtserve reports to a client."""

    http_status = 500
    grpc_code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidInput(RTServeError):
    """The request is malformed: names the field and what was expected."""

    http_status = 400
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class ModelNotFound(RTServeError):
    http_status = 404
    grpc_code = grpc.StatusCode.NOT_FOUND


class RouteNotFound(RTServeError):
    """No such endpoint (HTTP path or method)."""

    http_status = 404
    grpc_code = grpc.StatusCode.UNIMPLEMENTED


class ModelNotReady(RTServeError):
    http_status = 503
    grpc_code = grpc.StatusCode.UNAVAILABLE


class LoadFailed(RTServeError):
    """A model load request failed; the old versions (if any) keep serving."""

    http_status = 400
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class PayloadTooLarge(RTServeError):
    http_status = 413
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Overloaded(RTServeError):
    """The model's queue is full: retry later (HTTP 503 with Retry-After)."""

    http_status = 503
    grpc_code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ObjectiveRefused(Overloaded):
    """The latency objective or the request's deadline cannot be met: refused at once
    (HTTP 429 with Retry-After, gRPC RESOURCE_EXHAUSTED) instead of answered too late."""

    http_status = 429
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ClientClosed(RTServeError):
    """The client went away (HTTP connection closed, gRPC cancelled) before its answer."""

    http_status = 499
    grpc_code = grpc.StatusCode.CANCELLED


class ShuttingDown(RTServeError):
    http_status = 503
    grpc_code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(RTServeError):
    http_status = 504
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED


class InferenceFailed(RTServeError):
    http_status = 500
    grpc_code = grpc.StatusCode.INTERNAL


class InstanceFailed(InferenceFailed):
    """The model instance itself failed (hung past its timeout, its worker died): not the
    data, so a failed batch is not run again request by request."""


class SharedMemoryFull(RTServeError):
    """``/dev/shm`` has no room for a batch's tensors (HTTP 507); names its size and free space."""

    http_status = 507
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class RequestTimeout(RTServeError):
    """The client was too slow sending its request (HTTP 408); names the timeout."""

    http_status = 408
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED


class UriTooLong(RTServeError):
    """The request URL is longer than the configured limit (HTTP 414); names the limit."""

    http_status = 414
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class HeaderTooLarge(RTServeError):
    """Too many request headers, or one or all of them too large (HTTP 431); names the limit."""

    http_status = 431
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NotSupported(RTServeError):
    """A protocol feature rtserve does not offer (HTTP 501), e.g. CONNECT or WebSocket."""

    http_status = 501
    grpc_code = grpc.StatusCode.UNIMPLEMENTED


class SharedMemoryDisabled(RTServeError):
    """A shared memory route or tensor parameter on a server started without
    ``--shared-memory system``; names how to enable it."""

    http_status = 400
    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class AlreadyExists(RTServeError):
    """A name that is already registered (a shared memory region), as Triton's ALREADY_EXISTS."""

    http_status = 400
    grpc_code = grpc.StatusCode.ALREADY_EXISTS


class RegionNotFound(RTServeError):
    """No shared memory region of that name is registered (its status was asked)."""

    http_status = 404
    grpc_code = grpc.StatusCode.NOT_FOUND


class ConfigError(Exception):
    """A model or server config is invalid; the message names the file and the field."""


def as_error(exc: BaseException, what: str = "request") -> RTServeError:
    """Any exception as an ``RTServeError``: an unexpected one (a bug) becomes a 500 that
    names only its type; its traceback goes to the log, never to the client."""
    if isinstance(exc, RTServeError):
        return exc
    logging.getLogger("rtserve").error("unexpected error answering a %s", what, exc_info=exc)
    return InferenceFailed(f"internal error ({type(exc).__name__}) answering the {what}")


def runtime_message(exc: BaseException, limit: int = 400) -> str:
    """A runtime's error for a client: its most telling line (ONNX Runtime's status
    message, a LiteRT kernel's complaint), cut to ``limit`` characters."""
    text = str(exc).strip()
    if "Status Message:" in text:  # ONNX Runtime: what is wrong comes after the node name
        text = text.split("Status Message:", 1)[1].strip()
    lines = [t.strip() for t in text.splitlines() if t.strip()] or [type(exc).__name__]
    if "Traceback of TorchScript" in text:  # TorchScript: the error is the last line
        lines = lines[-1:]
    line = lines[0]
    for more in lines[1:4]:  # ONNX Runtime's "... for the following indices" lists them next
        if not more.startswith("index:"):
            break
        line += "; " + more
    return line if len(line) <= limit else line[:limit] + "..."
