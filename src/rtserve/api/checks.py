"""The checks every entry applies as ``rtserve serve`` does, before a route runs: the URL
and header limits, the body limits (``max_request_bytes``, then the decompression limit),
and the settings an adapter cannot honour, which refuse its start naming the setting (a
user must never believe a protection is on when it is not). The keys and the rate limit
are ``Application.check_credentials``.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

from rtserve.config import ServerConfig
from rtserve.errors import ConfigError, HeaderTooLarge, InvalidInput, PayloadTooLarge, UriTooLong

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


def decompress(body: bytes, encoding: bytes, limit: int) -> bytes:
    """``body`` inflated (gzip or deflate) up to ``limit`` bytes (``max_decompressed_bytes``);
    other encodings, corrupt bodies and bombs are refused naming why."""
    if encoding not in (b"gzip", b"deflate"):
        raise InvalidInput(
            f"Content-Encoding: {encoding[:40].decode(errors='replace')!r} is not supported "
            "(expected gzip, deflate or identity)"
        )
    d = zlib.decompressobj(31 if encoding == b"gzip" else 15)
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error as exc:
        raise InvalidInput(f"Content-Encoding {encoding.decode()}: corrupt body: {exc}") from None
    if len(out) > limit or d.unconsumed_tail:
        raise PayloadTooLarge(
            f"decompressed body exceeds the limit of {limit} bytes (max_decompressed_bytes)"
        )
    return out
