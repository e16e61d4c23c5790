"""A request's context and its answer's headers, for every entry.

In: the request id (``x-request-id``, checked) and the W3C trace context
(``traceparent``, at most 128 characters) into the request's ``Timings``, from HTTP headers
or gRPC metadata. Out: the V2 inference answer's headers (content type,
``inference-header-content-length``, ``server-timing``, ``x-rtserve-cache``,
``x-request-id``) or gRPC trailing metadata, and error answers carrying the request id.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from rtserve.api.call import Answer, Headers
from rtserve.observability.logs import checked_request_id
from rtserve.observability.metrics import server_timing
from rtserve.protocol.types import Timings
from rtserve.server.errors import JSON_TYPE, http_error
from rtserve.server.openai import error_answer as openai_error

OCTET_TYPE = (b"content-type", b"application/octet-stream")
REQUEST_ID = b"x-request-id"
TRACEPARENT = b"traceparent"
TRACEPARENT_CHARS = 128
_now = time.perf_counter_ns


def read_headers(timings: Timings, headers: Mapping[bytes, bytes]) -> Timings:
    """Set ``timings``' request id and trace context from HTTP ``headers``; raises
    ``InvalidInput`` for a request id that cannot be logged as given."""
    request_id = headers.get(REQUEST_ID)
    if request_id is not None:
        timings.request_id = checked_request_id(request_id.decode("latin-1"))
    traceparent = headers.get(TRACEPARENT)
    if traceparent is not None:
        timings.traceparent = traceparent[:TRACEPARENT_CHARS].decode("latin-1")
    return timings


def timings_of(headers: Mapping[bytes, bytes], received_ns: int) -> Timings:
    """A new request's ``Timings`` with its context read from ``headers``."""
    return read_headers(Timings(received=received_ns), headers)


def read_metadata(timings: Timings, metadata: Iterable[tuple[str, str | bytes]]) -> Timings:
    """As ``read_headers``, from gRPC invocation metadata."""
    for key, value in metadata:
        if key == "x-request-id":
            timings.request_id = checked_request_id(str(value))
        elif key == "traceparent":
            timings.traceparent = str(value)[:TRACEPARENT_CHARS]
    return timings


def infer_headers(timings: Timings, json_length: int | None) -> Headers:
    """The headers of a V2 inference answer: JSON, or binary tensors after a JSON header
    of ``json_length`` bytes."""
    timing = (b"server-timing", server_timing(timings, _now()).encode())
    if json_length is None:
        headers = [JSON_TYPE, timing]
    else:
        headers = [OCTET_TYPE, (b"inference-header-content-length", b"%d" % json_length), timing]
    if timings.cache:
        headers.append((b"x-rtserve-cache", timings.cache.encode()))
    if timings.request_id:
        headers.append((REQUEST_ID, timings.request_id.encode("latin-1")))
    return headers


def with_request_id(headers: Headers, timings: Timings) -> Headers:
    """``headers`` and the request's id, when it has one."""
    if timings.request_id:
        return [*headers, (REQUEST_ID, timings.request_id.encode("latin-1"))]
    return headers


def grpc_metadata(timings: Timings) -> list[tuple[str, str]]:
    """The trailing metadata of a gRPC inference answer (the HTTP answer's headers)."""
    metadata = [("server-timing", server_timing(timings, _now()))]
    if timings.cache:
        metadata.append(("x-rtserve-cache", timings.cache))
    if timings.request_id:
        metadata.append(("x-request-id", timings.request_id))
    return metadata


def error_metadata(timings: Timings) -> tuple[tuple[str, str], ...]:
    """The trailing metadata a failed gRPC call adds to its status: the request's id."""
    return (("x-request-id", timings.request_id),) if timings.request_id else ()


def error_reply(path: str, exc: BaseException, timings: Timings | None = None) -> Answer:
    """The answer to a failed request: OpenAI's error shape on ``/v1``, V2's elsewhere,
    with the request's id when known."""
    status, body, headers = openai_error(exc) if path.startswith("/v1/") else http_error(exc)
    return status, body, headers if timings is None else with_request_id(headers, timings)
