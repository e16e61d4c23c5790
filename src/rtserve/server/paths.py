"""The one canonical form of a request path, computed once per request at its head.

Authentication, routing, rate limits, metrics labels and logs all read this form, so a
path cannot be spelled one way for the guard and another for the router. The rules follow
what Envoy and nginx do by default, choosing refusal where they differ:

- percent-escapes are decoded once (``%76%32`` is ``v2``); an invalid escape is refused;
- an encoded ``/`` or ``\\`` (``%2F``, ``%5C``) is refused: it would change the segments;
- NUL and other control characters, raw or encoded, are refused;
- ``.`` and ``..`` segments, raw or encoded, are refused;
- empty segments are merged (``/v2//models/`` is ``/v2/models``), as nginx's merge_slashes.

Case is kept: ``/V2/...`` is a different path (routes and model names are case-sensitive).
"""

from __future__ import annotations

import re

from rtserve.errors import InvalidInput

# Paths made only of these need no decoding and no checks beyond slashes and dots.
_PLAIN = re.compile(rb"[A-Za-z0-9_\-~!$&'()*+,;=:@/]*")
_ESCAPE = re.compile(rb"%([0-9A-Fa-f]{2})")
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


# Canonical forms of recent paths: clients repeat the same few, and a lookup costs less than
# the checks. Bounded: cleared when full.
_SEEN: dict[bytes, str] = {}
_SEEN_MAX = 1024


def canonical_path(raw: bytes) -> str:
    """The canonical form of ``raw``, a request target's path (no query string).

    Raises ``InvalidInput`` (400) naming what is wrong; the message never echoes more than
    100 characters of the path."""
    seen = _SEEN.get(raw)
    if seen is not None:
        return seen
    path = _canonical(raw)
    if len(raw) <= 256:  # at most 1024 x 256 bytes, whatever clients send
        if len(_SEEN) >= _SEEN_MAX:
            _SEEN.clear()
        _SEEN[raw] = path
    return path


def _canonical(raw: bytes) -> str:
    if not raw.startswith(b"/"):
        raise InvalidInput(
            f"request path {_shown(raw)}: expected an absolute path starting with '/'"
        )
    if _PLAIN.fullmatch(raw) is not None:
        if b"//" not in raw and b"/." not in raw and not raw.endswith(b"/"):
            return raw.decode("ascii")
        decoded = raw.decode("ascii")
    else:
        decoded = _decode(raw)
    segments = []
    for segment in decoded.split("/"):
        if not segment:
            continue
        if segment in (".", ".."):
            raise InvalidInput(f"request path {_shown(raw)}: '.' and '..' segments are not allowed")
        segments.append(segment)
    return "/" + "/".join(segments)


def _decode(raw: bytes) -> str:
    if b"%" in raw:
        pieces = raw.split(b"%")
        out = bytearray(pieces[0])
        for piece in pieces[1:]:
            match = _ESCAPE.match(b"%" + piece[:2])
            if match is None:
                raise InvalidInput(
                    f"request path {_shown(raw)}: '%' must start an escape of two hex digits"
                )
            byte = int(match.group(1), 16)
            if byte in (0x2F, 0x5C):
                raise InvalidInput(
                    f"request path {_shown(raw)}: an encoded '/' or '\\' (%2F, %5C) is not allowed"
                )
            out.append(byte)
            out += piece[2:]
        raw = bytes(out)
    if b"\\" in raw:
        raise InvalidInput(f"request path {_shown(raw)}: '\\' is not allowed")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInput(f"request path {_shown(raw)}: not valid UTF-8") from None
    if _CONTROL.search(text) is not None:
        raise InvalidInput(f"request path {_shown(raw)}: control characters are not allowed")
    return text


def _shown(raw: bytes) -> str:
    """At most 100 characters of a path, printable, for an error message."""
    text = raw[:100].decode("ascii", "backslashreplace")
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    return repr(text + ("..." if len(raw) > 100 else ""))
