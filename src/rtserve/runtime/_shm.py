"""Tensors through shared memory between the server and a model's worker process.

Only a small layout (names, dtypes, shapes, offsets) crosses the pipe per batch; the
tensor bytes are written once into a segment the other side maps. BYTES tensors are
framed as ``n`` little-endian uint32 lengths followed by the concatenated items.

The server process creates (and unlinks) every segment, so a worker that dies never
leaks one; the worker only attaches.

Segments are grown with ``ftruncate``, which reserves nothing: a write through the mapping
into a page ``/dev/shm`` has no room for kills the writer with SIGBUS. So every writer first
reserves what it writes (``posix_fallocate``: ENOSPC instead, raised as ``SharedMemoryFull``)
and tracks how far it has reserved; only reserved pages are ever touched, on either side.
Released segments are truncated first, which frees their pages even while the worker still
maps them.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from rtserve.errors import SharedMemoryFull

_ALIGN = 64
# (name, kind "n"|"b", dtype str, shape, offset, nbytes)
Layout = list[tuple[str, str, str, tuple[int, ...], int, int]]


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.3g} MiB"


def _shm_usage() -> str:
    """``/dev/shm (64 MiB, 12 MiB free)``, as far as it can be read."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return "/dev/shm"
    return f"/dev/shm ({_mib(st.f_blocks * st.f_frsize)}, {_mib(st.f_bavail * st.f_frsize)} free)"


def reserve(shm: shared_memory.SharedMemory, start: int, end: int, what: str) -> None:
    """Reserve bytes ``start:end`` of ``shm`` so that writing them cannot raise SIGBUS."""
    fd = getattr(shm, "_fd", -1)
    if end <= start or fd < 0 or not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, start, end - start)
    except OSError as exc:
        raise SharedMemoryFull(
            f"shared memory is full: {_shm_usage()} has no room for {_mib(end)} of {what} "
            f"({exc.strerror}); give the container a larger /dev/shm "
            "(docker run --shm-size, or a Kubernetes emptyDir with medium: Memory)"
        ) from None


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


def segment_tag(instance: int) -> str:
    """The name prefix of a model instance's segments: ``rts<pid>i<instance>``, then ``in_`` or
    ``out_`` and a random suffix (``Segment``)."""
    return f"rts{os.getpid()}i{instance}"


_SERVER_SEGMENT = re.compile(r"rts[0-9]+i[0-9]+")


def is_server_segment(name: str) -> bool:
    """Whether ``name`` (a file in /dev/shm) has the form of the server's own segments:
    clients may not register them as shared memory regions."""
    return _SERVER_SEGMENT.match(name) is not None


class Segment:
    """A growable shared-memory segment created and unlinked by the server process."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self.shm: shared_memory.SharedMemory | None = None
        self.reserved = 0  # bytes 0:reserved are backed by /dev/shm

    @property
    def size(self) -> int:
        return self.shm.size if self.shm is not None else 0

    @property
    def name(self) -> str:
        return self.shm.name if self.shm is not None else ""

    def ensure(self, nbytes: int, what: str = "") -> None:
        """Make the segment at least ``nbytes`` long (a new name when it grows) and, when
        ``what`` names the data, reserve its first ``nbytes`` for the server to write."""
        if self.shm is None or self.shm.size < nbytes:
            size = max(1 << 16, _aligned(int(nbytes * 1.25)))
            self.release()
            name = f"{self._prefix}_{secrets.token_hex(6)}"
            self.shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        if what and nbytes > self.reserved:
            reserve(self.shm, self.reserved, nbytes, what)
            self.reserved = nbytes

    @property
    def buf(self) -> memoryview:
        assert self.shm is not None and self.shm.buf is not None
        return self.shm.buf

    def release(self) -> None:
        """Free the segment's pages at once (the worker may still map it), then unlink it."""
        if self.shm is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(getattr(self.shm, "_fd", -1), 0)
            with contextlib.suppress(BufferError):  # a view still alive: unlink anyway
                self.shm.close()
            with contextlib.suppress(FileNotFoundError):
                self.shm.unlink()
            self.shm = None
            self.reserved = 0


class Attached:
    """The worker's side: maps the segment the server names, re-mapping when it changes."""

    def __init__(self) -> None:
        self.shm: shared_memory.SharedMemory | None = None
        self._retired: list[shared_memory.SharedMemory] = []
        self._reserved = 0

    def attach(self, name: str, reserve_bytes: int = 0) -> memoryview:
        """The segment ``name``; its first ``reserve_bytes`` reserved for the worker to write."""
        if self.shm is None or self.shm.name != name:
            self._reserved = 0
            if self.shm is not None:
                try:
                    self.shm.close()
                except BufferError:  # user code kept a view of an old input: keep it mapped
                    self._retired.append(self.shm)
            self.shm = shared_memory.SharedMemory(name=name)
        if reserve_bytes > self._reserved:
            reserve(self.shm, self._reserved, reserve_bytes, "outputs")
            self._reserved = reserve_bytes
        assert self.shm.buf is not None
        return self.shm.buf
