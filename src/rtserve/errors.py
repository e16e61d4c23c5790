"""The error hierarchy: each error maps once to an HTTP status and a gRPC code."""

from __future__ import annotations

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


class ModelNotReady(RTServeError):
    http_status = 503
    grpc_code = grpc.StatusCode.UNAVAILABLE


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


class ShuttingDown(RTServeError):
    http_status = 503
    grpc_code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(RTServeError):
    http_status = 504
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED


class InferenceFailed(RTServeError):
    http_status = 500
    grpc_code = grpc.StatusCode.INTERNAL


class ConfigError(Exception):
    """A model or server config is invalid; the message names the file and the field."""
