"""What one HTTP/1.1 client may send, and the refusals that name each limit.

``HttpLimits`` is the configuration (the ``http_*`` fields of ``ServerConfig``); the
functions below build the refusal for a limit passed, naming the limit's config field, so
that the parser (``h1_parse``) and the connection's timeouts say the same thing.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass
from typing import Any

from rtserve.errors import ConfigError, HeaderTooLarge, PayloadTooLarge, RequestTimeout, UriTooLong

log = logging.getLogger(__name__)

# What a chunk of a chunked body costs beyond its payload (a parser callback, a copy), charged
# against the body limit: 2-byte chunks cannot make the server parse 32 million of them.
CHUNK_COST = 64


@dataclass(frozen=True)
class HttpLimits:
    """What one client may send; each limit is named (by its config field) in its refusal."""

    max_url_bytes: int = 8 * 1024  # the request target (414)
    max_headers: int = 100  # header lines per request (431)
    max_header_bytes: int = 16 * 1024  # one header, name + value (431)
    max_head_bytes: int = 64 * 1024  # request line + all headers (431)
    idle_timeout_s: float = 75.0  # keep-alive with no request in progress: closed
    header_timeout_s: float = 20.0  # from a request's first byte to the end of its head (408)
    body_timeout_s: float = 30.0  # silence while a body arrives, or while answers wait (408)
    max_connections: int = 10_000  # open HTTP connections; more are refused with 503

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigError(f"http_{name}: expected a number > 0, got {value!r}")

    @classmethod
    def from_config(cls, config: Any) -> HttpLimits:
        """The limits from a ``ServerConfig`` (its ``http_*`` fields; defaults where absent)."""
        kwargs = {}
        for name in cls.__dataclass_fields__:
            value = getattr(config, f"http_{name}", None)
            if value is not None:
                kwargs[name] = value
        return cls(**kwargs)

    # ------------------------------------------------------------------ refusals
    def url_too_long(self) -> UriTooLong:
        return UriTooLong(
            f"the request URL exceeds the limit of {self.max_url_bytes} bytes (http_max_url_bytes)"
        )

    def header_error(self, name: bytes, size: int, count: int) -> HeaderTooLarge:
        """The refusal of a header of ``size`` bytes, the ``count``-th of its request, that
        passed a limit: its own size, the header count, or the head's size."""
        if size > self.max_header_bytes:
            shown = name[:64].decode("latin-1")
            return HeaderTooLarge(
                f"header {shown!r} of {size} bytes exceeds the limit of "
                f"{self.max_header_bytes} bytes per header (http_max_header_bytes)"
            )
        if count > self.max_headers:
            return HeaderTooLarge(
                f"more than {self.max_headers} request headers (http_max_headers)"
            )
        return self.head_too_large()

    def head_too_large(self) -> HeaderTooLarge:
        return HeaderTooLarge(
            f"the request headers exceed the limit of {self.max_head_bytes} bytes "
            "in all (http_max_head_bytes)"
        )

    def head_timeout(self) -> RequestTimeout:
        return RequestTimeout(
            f"the request head did not arrive within {self.header_timeout_s:g} s"
            " (http_header_timeout_s)"
        )

    def body_timeout(self) -> RequestTimeout:
        return RequestTimeout(
            f"no part of the request body arrived for {self.body_timeout_s:g} s "
            "(http_body_timeout_s)"
        )


def declared_too_large(length: int, limit: int, route: str | None = None) -> PayloadTooLarge:
    """A Content-Length past the body limit: the server's, or one a ``route`` set lower."""
    if route is None:
        return PayloadTooLarge(
            f"request body of {length} bytes exceeds the limit of {limit} bytes (max_request_bytes)"
        )
    return PayloadTooLarge(
        f"request body of {length} bytes exceeds the limit of {limit} bytes for {route}"
    )


def body_too_large(limit: int, name: str, chunked: bool) -> PayloadTooLarge:
    """A body that grew past its limit while it arrived (chunks counted with their cost)."""
    extra = f"; each chunk counts {CHUNK_COST} bytes more" if chunked else ""
    return PayloadTooLarge(f"request body exceeds the limit of {limit} bytes ({name}{extra})")


def raise_fd_limit() -> int:
    """Raise the soft descriptor limit to the hard one; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # pragma: no cover - a restricted sandbox
            log.warning("could not raise the descriptor limit from %d to %d: %s", soft, hard, exc)
    return soft
