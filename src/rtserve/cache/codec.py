"""A safe binary format for cached outputs (what L2 stores): data only, never code.

Layout, little-endian::

    b"RTSC"  u8 format version (1)  u8 flags (0)  u16 tensor count
    per tensor:
        u16 name length, name (UTF-8)
        u8 datatype code (index in DATATYPES)
        u8 ndim, ndim x u64 dims
        u64 payload length, payload
            numeric: the C-order array bytes (length must equal prod(shape) * itemsize)
            BYTES:   prod(shape) x (u32 length, bytes)  (rtserve.protocol.bytes_codec)
        u32 parameters length, parameters (a JSON object of scalars; length 0: none)

:func:`decode` checks every length, code and count and that nothing trails, and raises
:class:`CacheDecodeError` on anything else; a value written by someone else is therefore
either a well-formed answer or a miss. Decoded numeric arrays are read-only views over the
value's bytes (no copy).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rtserve.errors import RTServeError
from rtserve.protocol.bytes_codec import decode_bytes_elements, encode_bytes_elements
from rtserve.protocol.types import DATATYPE_TO_NUMPY, Tensor

MAGIC = b"RTSC"
FORMAT_VERSION = 1
MAX_TENSORS = 4096
MAX_NDIM = 32
# Codes are part of the format: append only.
DATATYPES: tuple[str, ...] = (
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
)
_CODE = {name: i for i, name in enumerate(DATATYPES)}
# Fixed little-endian dtypes, so a value means the same on any host.
_LE_DTYPE = {
    name: DATATYPE_TO_NUMPY[name].newbyteorder("<") for name in DATATYPES if name != "BYTES"
}
_HEADER = struct.Struct("<4sBBH")
_CODE_NDIM = struct.Struct("<BB")
_SCALARS = (str, int, float, bool)
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class CacheDecodeError(ValueError):
    """A cached value is not a well-formed rtserve cache entry."""


def encode(tensors: Sequence[Tensor]) -> bytes:
    """Serialise output tensors; raises ValueError for a datatype the format does not know."""
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"at most {MAX_TENSORS} tensors can be cached, got {len(tensors)}")
    parts: list[bytes | memoryview] = [_HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(tensors))]
    for t in tensors:
        code = _CODE.get(t.datatype)
        if code is None:
            raise ValueError(f"output {t.name!r}: datatype {t.datatype!r} cannot be cached")
        name = t.name.encode()
        shape = tuple(int(d) for d in t.data.shape)
        if len(shape) > MAX_NDIM:
            raise ValueError(f"output {t.name!r}: more than {MAX_NDIM} dimensions")
        parts.append(_U16.pack(len(name)) + name)
        parts.append(struct.pack(f"<BB{len(shape)}Q", code, len(shape), *shape))
        if t.datatype == "BYTES":
            payload = encode_bytes_elements(t.data)
            parts.append(_U64.pack(len(payload)))
            parts.append(payload)
        else:
            data = np.ascontiguousarray(t.data, dtype=_LE_DTYPE[t.datatype])
            parts.append(_U64.pack(data.nbytes))
            parts.append(data.data)
        params = _encode_parameters(t.parameters, t.name)
        parts.append(_U32.pack(len(params)))
        parts.append(params)
    return b"".join(parts)


def decode(value: bytes | bytearray | memoryview) -> list[Tensor]:
    """Parse a value written by :func:`encode`; anything else raises CacheDecodeError."""
    return _Reader(memoryview(value).cast("B")).tensors()


def _encode_parameters(params: Mapping[str, Any] | None, name: str) -> bytes:
    if not params:
        return b""
    for k, v in params.items():
        if not isinstance(k, str) or not isinstance(v, _SCALARS):
            raise ValueError(f"output {name!r}: parameter {k!r} is not a scalar")
    return json.dumps(params, separators=(",", ":"), allow_nan=False).encode()


def _decode_parameters(raw: memoryview, name: str) -> dict[str, Any] | None:
    if not raw:
        return None
    try:
        params = json.loads(str(raw, "utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CacheDecodeError(f"tensor {name!r}: parameters are not JSON") from e
    if not isinstance(params, dict) or not all(isinstance(v, _SCALARS) for v in params.values()):
        raise CacheDecodeError(f"tensor {name!r}: parameters are not an object of scalars")
    return params


class _Reader:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int, what: str) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self.buf):
            raise CacheDecodeError(f"truncated value: {what} needs {n} bytes at offset {self.pos}")
        view = self.buf[self.pos : end]
        self.pos = end
        return view

    def unpack(self, s: struct.Struct, what: str) -> tuple[Any, ...]:
        return s.unpack(self.take(s.size, what))

    def tensors(self) -> list[Tensor]:
        magic, version, flags, count = self.unpack(_HEADER, "header")
        if magic != MAGIC:
            raise CacheDecodeError(f"not an rtserve cache value (magic {bytes(magic)!r})")
        if version != FORMAT_VERSION:
            raise CacheDecodeError(f"unsupported cache format version {version}")
        if flags != 0:
            raise CacheDecodeError(f"unknown flags {flags:#x}")
        if count > MAX_TENSORS:
            raise CacheDecodeError(f"too many tensors: {count}")
        try:
            out = [self.tensor(i) for i in range(count)]
        except CacheDecodeError:
            raise
        except (ValueError, TypeError, OverflowError, MemoryError) as e:
            raise CacheDecodeError(f"malformed value: {e}") from e
        if self.pos != len(self.buf):
            raise CacheDecodeError(f"{len(self.buf) - self.pos} trailing bytes")
        return out

    def tensor(self, index: int) -> Tensor:
        (name_len,) = self.unpack(_U16, f"tensor {index} name length")
        try:
            name = str(self.take(name_len, f"tensor {index} name"), "utf-8")
        except UnicodeDecodeError as e:
            raise CacheDecodeError(f"tensor {index}: name is not UTF-8") from e
        code, ndim = self.unpack(_CODE_NDIM, f"tensor {name!r} datatype")
        if code >= len(DATATYPES):
            raise CacheDecodeError(f"tensor {name!r}: unknown datatype code {code}")
        if ndim > MAX_NDIM:
            raise CacheDecodeError(f"tensor {name!r}: {ndim} dimensions")
        shape = struct.unpack(f"<{ndim}Q", self.take(8 * ndim, f"tensor {name!r} shape"))
        count = 1
        for d in shape:
            count *= d
        (payload_len,) = self.unpack(_U64, f"tensor {name!r} payload length")
        payload = self.take(payload_len, f"tensor {name!r} payload")
        datatype = DATATYPES[code]
        if datatype == "BYTES":
            data = _decode_bytes_elements(payload, count, name).reshape(shape)
        else:
            dtype = _LE_DTYPE[datatype]
            if payload_len != count * dtype.itemsize:
                raise CacheDecodeError(
                    f"tensor {name!r}: payload of {payload_len} bytes does not fit shape "
                    f"{list(shape)} of {datatype}"
                )
            data = np.frombuffer(payload, dtype=dtype).reshape(shape)
            if datatype == "BOOL" and bool((data.view(np.uint8) > 1).any()):
                raise CacheDecodeError(f"tensor {name!r}: BOOL values other than 0 and 1")
            if not dtype.isnative:
                data = data.astype(dtype.newbyteorder("="))
            data.flags.writeable = False
        (params_len,) = self.unpack(_U32, f"tensor {name!r} parameters length")
        params = _decode_parameters(self.take(params_len, f"tensor {name!r} parameters"), name)
        return Tensor(name, datatype, tuple(int(d) for d in shape), data, params)


def _decode_bytes_elements(payload: memoryview, count: int, name: str) -> np.ndarray[Any, Any]:
    if count * 4 > len(payload):
        raise CacheDecodeError(f"tensor {name!r}: {count} BYTES elements do not fit the payload")
    try:
        out = decode_bytes_elements(payload, count, f"tensor {name!r}", count)
    except RTServeError as e:
        raise CacheDecodeError(e.message) from None
    out.flags.writeable = False
    return out
