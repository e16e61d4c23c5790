"""Triton's system shared memory extension: tensors in files of ``/dev/shm``.

A client registers a region (a name for bytes ``offset:offset+byte_size`` of the file
``/dev/shm/<key>``), then names it in an input's or a requested output's parameters
(``shared_memory_region``, ``shared_memory_byte_size``, optional ``shared_memory_offset``
within the region): the input's bytes are read from it, the output's written into it.

The client is not trusted. A key names a regular file directly in ``/dev/shm`` (no
symbolic link, no other directory); the server's own segments (python-backend workers)
and POSIX semaphores cannot be registered; each use is checked against the region and the
tensor's size before a byte is read. The file is read and written with ``pread`` /
``pwrite`` rather than mapped: a client that truncates the file after registering it
gets an error, where a mapping would kill the server with SIGBUS.

Everything here runs on the event loop thread, so a region unregistered while a request
is in flight is seen as such when that request's outputs are written.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rtserve.errors import (
    AlreadyExists,
    InferenceFailed,
    InvalidInput,
    PayloadTooLarge,
    RegionNotFound,
    RTServeError,
    SharedMemoryDisabled,
    SharedMemoryFull,
)
from rtserve.protocol.bytes_codec import decode_bytes_elements, encode_bytes_elements
from rtserve.protocol.limits import MAX_ID_CHARS, check_bools, shown
from rtserve.protocol.types import DATATYPE_TO_NUMPY, RequestedOutput, Tensor
from rtserve.runtime._shm import is_server_segment

SHM_DIR = "/dev/shm"
MAX_KEY_CHARS = 255  # NAME_MAX
DEFAULT_MAX_REGIONS = 64
# Region parameters of an input or a requested output.
REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
OFFSET = "shared_memory_offset"

_ENABLE = "start the server with --shared-memory system (or shared_memory: system in its config)"
CUDA_UNSUPPORTED = "CUDA shared memory is not supported by this server"


def cuda_refusal(action: str, name: str) -> RTServeError | None:
    """CUDA shared memory, answered as Triton built without GPU support: no region exists.
    Registering one is refused, so is the status of a named one; the rest (a status of
    all, an unregister) has nothing to do: None."""
    if action == "register":
        return InvalidInput(f"{CUDA_UNSUPPORTED}: cannot register CUDA region '{name:.100}'")
    if action == "status" and name:
        return RegionNotFound(
            f"no CUDA shared memory region '{name:.100}' is registered ({CUDA_UNSUPPORTED})"
        )
    return None


def disabled(where: str) -> SharedMemoryDisabled:
    """The refusal of a shared memory request on a server that does not allow it."""
    return SharedMemoryDisabled(f"{where}: system shared memory is disabled; to use it, {_ENABLE}")


def _quoted(value: Any) -> str:
    return f"'{shown(value)}'" if isinstance(value, str) else shown(value)


def _count(value: Any, where: str, what: str) -> int:
    if type(value) is not int or value < 0:
        raise InvalidInput(f"{where}: expected {what} (an integer >= 0), got {shown(value)}")
    return value


def _check_region_name(name: Any, where: str) -> str:
    if type(name) is not str or not name:
        raise InvalidInput(
            f"{where}: expected a region name (a non-empty string), got {shown(name)}"
        )
    if len(name) > MAX_ID_CHARS:
        raise InvalidInput(f"{where}: a region name of at most {MAX_ID_CHARS} characters")
    return name


def _file_name(key: str, where: str) -> str:
    """The file in ``/dev/shm`` that ``key`` (``/name`` or ``name``) names; refuses any other."""
    name = key[1:] if key.startswith("/") else key
    if (
        not name
        or len(name) > MAX_KEY_CHARS
        or "/" in name
        or "\x00" in name
        or name in (".", "..")
    ):
        raise InvalidInput(
            f"{where}: key {_quoted(key)} must name a file directly in {SHM_DIR} "
            "('/name' or 'name': no other '/', not '.' or '..', at most 255 characters)"
        )
    if is_server_segment(name) or name.startswith("sem."):
        raise InvalidInput(
            f"{where}: key {_quoted(key)} names one of the server's own segments or a POSIX "
            "semaphore, which cannot be registered"
        )
    return name


def _io_error(exc: OSError, what: str) -> RTServeError:
    if exc.errno == errno.ENOSPC:  # a sparse file on a full /dev/shm
        return SharedMemoryFull(f"{what}: /dev/shm is full ({exc.strerror})")
    return InferenceFailed(f"{what}: {exc.strerror}")


class Region:
    """A registered region: bytes ``offset:offset+byte_size`` of an open file."""

    __slots__ = ("name", "key", "offset", "byte_size", "_fd")

    def __init__(self, name: str, key: str, offset: int, byte_size: int, fd: int) -> None:
        self.name, self.key, self.offset, self.byte_size = name, key, offset, byte_size
        self._fd = fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _check_open(self, where: str) -> None:
        if self._fd < 0:
            raise InvalidInput(
                f"{where}: system shared memory region '{self.name}' was unregistered "
                "while the request ran"
            )

    def read_into(self, out: memoryview, start: int, where: str) -> None:
        """Fill ``out`` from byte ``start`` of the region (bounds checked by the caller)."""
        self._check_open(where)
        pos, done, total = self.offset + start, 0, len(out)
        while done < total:
            try:
                n = os.preadv(self._fd, [out[done:]], pos + done)
            except OSError as exc:
                raise _io_error(exc, f"{where}: reading region '{self.name}'") from None
            if n <= 0:
                raise InvalidInput(
                    f"{where}: the file of region '{self.name}' ({_quoted(self.key)}) is now "
                    f"shorter than the region: {done} of {total} bytes could be read"
                )
            done += n

    def write(self, data: memoryview, start: int, where: str) -> None:
        """Write ``data`` at byte ``start`` of the region (bounds checked by the caller)."""
        self._check_open(where)
        pos = self.offset + start
        end = pos + len(data)
        if os.fstat(self._fd).st_size < end:  # never grow a file the client shrank
            raise InvalidInput(
                f"{where}: the file of region '{self.name}' ({_quoted(self.key)}) is now "
                f"shorter than the region ({end} bytes needed)"
            )
        done = 0
        try:
            while done < len(data):
                done += os.pwritev(self._fd, [data[done:]], pos + done)
        except OSError as exc:
            raise _io_error(exc, f"{where}: writing region '{self.name}'") from None


@dataclass(slots=True)
class OutputRegion:
    """Where a requested output goes: ``byte_size`` bytes at ``offset`` in ``region``."""

    region: Region
    offset: int
    byte_size: int
    offset_given: bool


class SharedMemoryRegions:
    """The registered system shared memory regions of one server process."""

    def __init__(
        self,
        max_regions: int = DEFAULT_MAX_REGIONS,
        max_input_bytes: int = 64 * 1024 * 1024,
        directory: str = SHM_DIR,
    ) -> None:
        """``max_input_bytes``: the largest input read from a region (a request body's
        limit, ``max_request_bytes``: no larger than the client could send inline)."""
        self.max_regions = max_regions
        self.max_input_bytes = max_input_bytes
        self.directory = directory
        self._regions: dict[str, Region] = {}

    # ------------------------------------------------------------------ control
    def register(self, name: Any, key: Any, offset: Any, byte_size: Any) -> None:
        where = f"system shared memory region {_quoted(name)}"
        name = _check_region_name(name, "name")
        if type(key) is not str:
            raise InvalidInput(f"{where}: key: expected a string, got {shown(key)}")
        offset = _count(offset, f"{where}: offset", "a byte offset in the file")
        byte_size = _count(byte_size, f"{where}: byte_size", "a size in bytes")
        if name in self._regions:
            raise AlreadyExists(
                f"{where} is already registered (unregister it first to register it again)"
            )
        if len(self._regions) >= self.max_regions:
            raise InvalidInput(
                f"{where}: {len(self._regions)} regions are registered, the limit "
                f"(shared_memory_max_regions); unregister one first"
            )
        file_name = _file_name(key, where)
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = os.open(os.path.join(self.directory, file_name), flags)
        except OSError as exc:
            raise InvalidInput(
                f"{where}: cannot open key {_quoted(key)} in {self.directory} for reading and "
                f"writing ({exc.strerror})"
            ) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidInput(f"{where}: key {_quoted(key)} is not a regular file")
            if offset + byte_size > st.st_size:
                raise InvalidInput(
                    f"{where}: offset {offset} + byte_size {byte_size} is beyond the end of "
                    f"key {_quoted(key)} ({st.st_size} bytes)"
                )
        except BaseException:
            os.close(fd)
            raise
        self._regions[name] = Region(name, key, offset, byte_size, fd)

    def unregister(self, name: str = "") -> None:
        """Release region ``name`` (every region when empty); an unknown name is no error,
        as in Triton."""
        names = [name] if name else list(self._regions)
        for n in names:
            region = self._regions.pop(n, None)
            if region is not None:
                region.close()

    def status(self, name: str = "") -> list[Region]:
        """Every region, or region ``name`` (RegionNotFound when unknown)."""
        if not name:
            return list(self._regions.values())
        region = self._regions.get(name)
        if region is None:
            raise RegionNotFound(f"no system shared memory region {_quoted(name)} is registered")
        return [region]

    def close(self) -> None:
        self.unregister()

    # ------------------------------------------------------------------ inference
    def _use(self, params: dict[str, Any], where: str) -> tuple[Region, int, int, bool]:
        """(region, offset in it, byte size, offset given) of tensor ``params``, in bounds."""
        name = _check_region_name(params.get(REGION), f"{where}.parameters.{REGION}")
        if BYTE_SIZE not in params:
            raise InvalidInput(f"{where}.parameters: {REGION} needs {BYTE_SIZE}")
        size = _count(params[BYTE_SIZE], f"{where}.parameters.{BYTE_SIZE}", "a size in bytes")
        given = OFFSET in params
        offset = _count(params.get(OFFSET, 0), f"{where}.parameters.{OFFSET}", "a byte offset")
        region = self._regions.get(name)
        if region is None:
            raise InvalidInput(
                f"{where}.parameters.{REGION}: no system shared memory region {_quoted(name)} "
                "is registered"
            )
        if offset + size > region.byte_size:
            raise InvalidInput(
                f"{where}.parameters: offset {offset} + byte size {size} is beyond the "
                f"{region.byte_size} bytes of region {_quoted(name)}"
            )
        return region, offset, size, given

    def read_input(
        self,
        params: dict[str, Any],
        datatype: str,
        shape: tuple[int, ...],
        count: int,
        where: str,
        max_bytes_elements: int,
    ) -> np.ndarray[Any, Any]:
        """The input tensor ``params`` names, checked against its shape before it is read;
        BYTES in Triton's layout (each element a little-endian uint32 length, then its bytes)."""
        region, offset, size, _ = self._use(params, where)
        if size > self.max_input_bytes:
            raise PayloadTooLarge(
                f"{where}.parameters.{BYTE_SIZE}: {size} bytes exceed the limit of "
                f"{self.max_input_bytes} bytes (max_request_bytes)"
            )
        if datatype == "BYTES":
            raw = bytearray(size)
            region.read_into(memoryview(raw), offset, where)
            arr = decode_bytes_elements(memoryview(raw), count, where, max_bytes_elements)
            return arr.reshape(shape)
        dtype = DATATYPE_TO_NUMPY[datatype]
        expected = count * dtype.itemsize
        if size != expected:
            raise InvalidInput(
                f"{where}.parameters.{BYTE_SIZE}: {size} bytes do not match shape "
                f"{list(shape)} of {datatype} ({expected} bytes)"
            )
        arr = np.empty(count, dtype=dtype)
        if count:
            region.read_into(arr.view(np.uint8).data, offset, where)
        if datatype == "BOOL":
            check_bools(arr, where, "data in shared memory holds bytes")
        return arr.reshape(shape)

    def output_region(self, params: dict[str, Any], where: str) -> OutputRegion:
        region, offset, size, given = self._use(params, where)
        return OutputRegion(region, offset, size, given)

    def write_outputs(
        self, requested: Iterable[RequestedOutput], outputs: Iterable[Tensor]
    ) -> dict[str, dict[str, Any]] | None:
        """Write the outputs requested in shared memory; their response parameters by name
        (None: none was)."""
        targets = {o.name: o.shared_memory for o in requested if o.shared_memory is not None}
        if not targets:
            return None
        answered: dict[str, dict[str, Any]] = {}
        for t in outputs:
            target = targets.get(t.name)
            if target is None:
                continue
            where = f"output '{t.name}'"
            arr = t.data
            if t.datatype == "BYTES":
                data = memoryview(encode_bytes_elements(arr))
            else:
                data = np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data
            if len(data) > target.byte_size:
                raise InvalidInput(
                    f"{where}: {BYTE_SIZE} {target.byte_size} is too small for the result, "
                    f"{len(data)} bytes (shape {list(arr.shape)} of {t.datatype})"
                )
            target.region.write(data, target.offset, where)
            params: dict[str, Any] = {REGION: target.region.name, BYTE_SIZE: len(data)}
            if target.offset_given:
                params[OFFSET] = target.offset
            answered[t.name] = params
        return answered
