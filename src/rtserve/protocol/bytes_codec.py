"""BYTES tensor framing, the one implementation: each element is a u32 little-endian
length followed by that many bytes (the V2 binary extension, gRPC raw contents and the
response cache all use it).

Decoding checks the element count against the buffer before allocating: every element
needs at least its 4-byte length, so a shape cannot claim more elements than
``len(buf) // 4``.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from rtserve.errors import InvalidInput, PayloadTooLarge

_U32 = struct.Struct("<I")


def element_bytes(item: Any) -> bytes:
    """One BYTES element as bytes: bytes-like as is, ``str`` as UTF-8, anything else as
    its ``str`` in UTF-8 (a model returning numbers in an object array)."""
    if isinstance(item, bytes):
        return item
    if isinstance(item, str):
        return item.encode()
    if isinstance(item, bytearray | memoryview | np.bytes_):
        return bytes(item)
    return str(item).encode()


def encode_bytes_elements(arr: np.ndarray[Any, Any]) -> bytes:
    """Serialise a BYTES tensor in row-major order."""
    parts: list[bytes] = []
    pack = _U32.pack
    for item in arr.reshape(-1):
        b = element_bytes(item)
        parts.append(pack(len(b)))
        parts.append(b)
    return b"".join(parts)


def decode_bytes_elements(
    buf: memoryview | bytes, count: int, where: str, max_elements: int
) -> np.ndarray[Any, Any]:
    """A flat object array of ``count`` bytes elements read from ``buf``.

    Raises :class:`InvalidInput` naming ``where`` when the framing does not hold exactly
    ``count`` elements, and :class:`PayloadTooLarge` when ``count`` exceeds
    ``max_elements``; both before any allocation.
    """
    n = len(buf)
    if count > max_elements:
        raise PayloadTooLarge(
            f"{where}: {count} BYTES elements exceed the limit of {max_elements} "
            "(max_bytes_elements)"
        )
    if count * 4 > n:
        raise InvalidInput(
            f"{where}: {count} BYTES elements need at least {count * 4} bytes "
            f"(a 4-byte length each), got {n}"
        )
    out = np.empty(count, dtype=object)
    unpack = _U32.unpack_from
    pos = 0
    for i in range(count):
        if pos + 4 > n:
            raise InvalidInput(f"{where}: BYTES data ends inside element {i} of {count}")
        (length,) = unpack(buf, pos)
        pos += 4
        end = pos + length
        if end > n:
            raise InvalidInput(
                f"{where}: BYTES element {i} claims {length} bytes but only {n - pos} remain"
            )
        out[i] = bytes(buf[pos:end])
        pos = end
    if pos != n:
        raise InvalidInput(f"{where}: {n - pos} bytes follow the last of {count} BYTES elements")
    return out
