"""What the adapters (the Lambda handler, the Ray deployment) apply as ``rtserve serve``
does, through the HTTP frontend's own code: the keys and the rate limit
(``HttpFrontend.check_credentials``, the ``Guard`` built by ``Guard.from_config``), the
URL and header limits, the body limits (``max_request_bytes``, then the decompression and
JSON limits where the frontend decodes). A setting an adapter cannot honour refuses its
start, naming the setting: a user must never believe a protection is on when it is not.
"""

from __future__ import annotations

from collections.abc import Iterable

from rtserve.config import ServerConfig
from rtserve.core.dataplane import DataPlane
from rtserve.errors import ConfigError, HeaderTooLarge, InvalidInput, PayloadTooLarge, UriTooLong
from rtserve.server.errors import Headers, http_error
from rtserve.server.openai import error_answer
from rtserve.server.rest import HttpFrontend
from rtserve.server.security import Guard

# Settings no adapter can honour, and why: TLS (and its client certificates) ends before the
# adapter, at API Gateway, the function URL or Ray's proxy; system shared memory needs a
# client on the same host as the process that reads the regions.
_NOT_HONOURED = {
    "tls_cert": "TLS ends at {front}: configure the certificate there",
    "tls_key": "TLS ends at {front}: configure the certificate there",
    "tls_client_ca": "client certificates (mTLS) are checked at {front}: configure them there",
    "shared_memory": "system shared memory needs clients on the server's host (rtserve serve)",
}
# Credentials: one of each, never two that the guard and a log could read differently.
_CREDENTIAL_HEADERS = (b"authorization", b"x-api-key")


def refuse_unhonoured(config: ServerConfig, entry: str, front: str) -> None:
    """Raise ``ConfigError`` naming the first setting ``entry`` cannot honour."""
    where = config.config_file or "server settings"
    for name, why in _NOT_HONOURED.items():
        value = getattr(config, name)
        if value and value != "none":
            raise ConfigError(
                f"{where}: {name}: {entry} cannot honour this setting "
                f"({why.format(front=front)}); remove it"
            )


def frontend(dataplane: DataPlane, config: ServerConfig, entry: str, front: str) -> HttpFrontend:
    """The V2 frontend with the configured keys and rate limit, as ``rtserve serve`` builds
    it; raises ``ConfigError`` (naming the setting) for what ``entry`` cannot honour or an
    auth file that cannot be read. Call before loading models: a bad setting fails fast."""
    refuse_unhonoured(config, entry, front)
    return HttpFrontend(
        dataplane,
        config.max_request_bytes,
        guard=Guard.from_config(config),
        max_decompressed_bytes=config.max_decompressed_bytes,
    )


def request_headers(
    config: ServerConfig, url_bytes: int, pairs: Iterable[tuple[bytes, bytes]]
) -> dict[bytes, bytes]:
    """The headers by lower-case name, within the server's URL and header limits (the same
    statuses and messages as its HTTP parser); a second ``Authorization`` or ``x-api-key``
    is refused. ``url_bytes``: the request target's size."""
    if url_bytes > config.http_max_url_bytes:
        raise UriTooLong(
            f"the request URL exceeds the limit of {config.http_max_url_bytes} bytes "
            "(http_max_url_bytes)"
        )
    headers: dict[bytes, bytes] = {}
    total = 0
    for count, (name, value) in enumerate(pairs, 1):
        size = len(name) + len(value)
        total += size + 4
        if size > config.http_max_header_bytes:
            raise HeaderTooLarge(
                f"header {name[:64].decode('latin-1')!r} of {size} bytes exceeds the limit of "
                f"{config.http_max_header_bytes} bytes per header (http_max_header_bytes)"
            )
        if count > config.http_max_headers:
            raise HeaderTooLarge(
                f"more than {config.http_max_headers} request headers (http_max_headers)"
            )
        if total > config.http_max_head_bytes:
            raise HeaderTooLarge(
                f"the request headers exceed the limit of {config.http_max_head_bytes} bytes "
                "in all (http_max_head_bytes)"
            )
        key = name.lower()
        if key in headers and key in _CREDENTIAL_HEADERS:
            raise InvalidInput(f"{key.decode()}: expected one such header, got several")
        headers[key] = value
    return headers


def body_too_large(size: int, limit: int) -> PayloadTooLarge:
    """The refusal of a body over ``max_request_bytes``, as the HTTP server words it."""
    return PayloadTooLarge(
        f"request body of {size} bytes exceeds the limit of {limit} bytes (max_request_bytes)"
    )


def refusal(path: str, exc: BaseException) -> tuple[int, bytes, Headers]:
    """The answer to a request refused before its route ran: OpenAI's error shape on
    ``/v1``, V2's elsewhere (as the HTTP server answers)."""
    return error_answer(exc) if path.startswith("/v1/") else http_error(exc)
