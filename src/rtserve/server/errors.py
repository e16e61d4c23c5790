"""Exception -> wire answer, once per frontend.

The status and code of each error class live in ``rtserve.errors``; this module turns any
exception into the HTTP answer or the gRPC status a client gets. Unexpected exceptions (bugs)
become 500 / INTERNAL naming only their type; the traceback goes to the log.
"""

from __future__ import annotations

import grpc
import orjson

from rtserve.errors import Overloaded, as_error

Headers = list[tuple[bytes, bytes]]
JSON_TYPE = (b"content-type", b"application/json")


def _retry_after(err: Overloaded) -> str:
    """When to retry, in whole seconds (at least 1): HTTP's ``Retry-After``."""
    return str(max(1, round(err.retry_after_s)))


def http_error(exc: BaseException) -> tuple[int, bytes, Headers]:
    """(status, JSON body, headers) of the answer to a failed HTTP request."""
    err = as_error(exc)
    headers = [JSON_TYPE]
    if isinstance(err, Overloaded):
        headers.append((b"retry-after", _retry_after(err).encode()))
    return err.http_status, orjson.dumps({"error": err.message}), headers


def grpc_error(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(status code, details) of a failed gRPC call."""
    err = as_error(exc)
    return err.grpc_code, err.message


def grpc_trailers(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """Trailing metadata of a failed gRPC call: for a refusal under load, when to retry, as
    gRPC's retry pushback (``grpc-retry-pushback-ms``, which a client's retry policy
    honours) and as ``retry-after`` in whole seconds, the HTTP answer's header."""
    err = as_error(exc)
    if not isinstance(err, Overloaded):
        return ()
    return (
        ("grpc-retry-pushback-ms", str(max(1, round(err.retry_after_s * 1000)))),
        ("retry-after", _retry_after(err)),
    )
