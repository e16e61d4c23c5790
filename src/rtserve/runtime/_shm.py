"""Tensors through shared memory between the server and a model's worker process.

Only a small layout (names, dtypes, shapes, offsets) crosses the pipe per batch; the
tensor bytes are written once into a segment the other side maps. BYTES tensors are
framed as ``n`` little-endian uint32 lengths followed by the concatenated items.

The server process creates (and unlinks) every segment, so a worker that dies never
leaks one; the worker only attaches.
"""

from __future__ import annotations

import contextlib
import secrets
from multiprocessing import shared_memory
from typing import Any

import numpy as np

_ALIGN = 64
# (name, kind "n"|"b", dtype str, shape, offset, nbytes)
Layout = list[tuple[str, str, str, tuple[int, ...], int, int]]


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _as_bytes(item: Any) -> bytes:
    if isinstance(item, bytes):
        return item
    if isinstance(item, str):
        return item.encode("utf-8", "surrogateescape")
    if isinstance(item, bytearray | memoryview | np.bytes_):
        return bytes(item)
    raise TypeError(f"expected bytes in a BYTES tensor, got {type(item).__name__}")


def plan(arrays: dict[str, np.ndarray]) -> tuple[Layout, list[Any], int]:
    """The layout of ``arrays`` in one segment, the prepared payloads and the total size."""
    layout: Layout = []
    payloads: list[Any] = []
    offset = 0
    for name, arr in arrays.items():
        if arr.dtype == object or arr.dtype.kind in "SU":
            items = [_as_bytes(x) for x in arr.reshape(-1)]
            lengths = np.fromiter((len(x) for x in items), dtype="<u4", count=len(items))
            data = b"".join(items)
            nbytes = lengths.nbytes + len(data)
            layout.append((name, "b", "object", arr.shape, offset, nbytes))
            payloads.append((lengths, data))
        else:
            arr = np.ascontiguousarray(arr)
            layout.append((name, "n", arr.dtype.str, arr.shape, offset, arr.nbytes))
            payloads.append(arr)
        offset = _aligned(offset + layout[-1][5])
    return layout, payloads, offset


def write(buf: memoryview, layout: Layout, payloads: list[Any]) -> None:
    for (_, kind, _, _, offset, nbytes), payload in zip(layout, payloads, strict=True):
        if kind == "n":
            dst: np.ndarray = np.ndarray(payload.shape, payload.dtype, buffer=buf, offset=offset)
            dst[...] = payload
        else:
            lengths, data = payload
            end = offset + lengths.nbytes
            buf[offset:end] = lengths.tobytes()
            buf[end : offset + nbytes] = data


def read(buf: memoryview, layout: Layout, copy: bool) -> dict[str, np.ndarray]:
    """The tensors of ``layout``; numeric ones are views into ``buf`` unless ``copy``."""
    out: dict[str, np.ndarray] = {}
    for name, kind, dtype, shape, offset, _ in layout:
        if kind == "n":
            arr: np.ndarray = np.ndarray(shape, np.dtype(dtype), buffer=buf, offset=offset)
            out[name] = arr.copy() if copy else arr
            continue
        count = int(np.prod(shape, dtype=np.int64))
        lengths = np.frombuffer(buf, dtype="<u4", count=count, offset=offset)
        items = np.empty(count, dtype=object)
        pos = offset + lengths.nbytes
        for i, length in enumerate(lengths.tolist()):
            items[i] = bytes(buf[pos : pos + length])
            pos += length
        out[name] = items.reshape(shape)
    return out


class Segment:
    """A growable shared-memory segment created and unlinked by the server process."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self.shm: shared_memory.SharedMemory | None = None

    @property
    def size(self) -> int:
        return self.shm.size if self.shm is not None else 0

    @property
    def name(self) -> str:
        return self.shm.name if self.shm is not None else ""

    def ensure(self, nbytes: int) -> bool:
        """Make room for ``nbytes``; True when the segment was replaced (new name)."""
        if self.shm is not None and self.shm.size >= nbytes:
            return False
        size = max(1 << 16, _aligned(int(nbytes * 1.25)))
        self.release()
        name = f"{self._prefix}_{secrets.token_hex(6)}"
        self.shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        return True

    @property
    def buf(self) -> memoryview:
        assert self.shm is not None and self.shm.buf is not None
        return self.shm.buf

    def release(self) -> None:
        if self.shm is not None:
            with contextlib.suppress(BufferError):  # a view still alive: unlink anyway
                self.shm.close()
            with contextlib.suppress(FileNotFoundError):
                self.shm.unlink()
            self.shm = None


class Attached:
    """The worker's side: maps the segment the server names, re-mapping when it changes."""

    def __init__(self) -> None:
        self.shm: shared_memory.SharedMemory | None = None
        self._retired: list[shared_memory.SharedMemory] = []

    def attach(self, name: str) -> memoryview:
        if self.shm is None or self.shm.name != name:
            if self.shm is not None:
                try:
                    self.shm.close()
                except BufferError:  # user code kept a view of an old input: keep it mapped
                    self._retired.append(self.shm)
            self.shm = shared_memory.SharedMemory(name=name)
        assert self.shm.buf is not None
        return self.shm.buf
