"""Per-request decoding budgets, checked before anything is allocated.

Every decoder takes a :class:`DecodeLimits`; a request over a limit is refused with a
4xx that names the limit. The defaults suit the default 64 MiB request size.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from rtserve.errors import InvalidInput, PayloadTooLarge

# numpy (1.x) arrays have at most 32 dimensions; the cache format uses the same bound.
MAX_NDIM = 32
# Model, version, input and output names longer than this are refused, so that no error
# message that repeats a name can grow large.
MAX_NAME_CHARS = 1024
# A request's ``id`` is echoed in its answer: longer ones are refused (400 / INVALID_ARGUMENT).
MAX_ID_CHARS = 256
# Echoed client strings (names, values) are cut to this many characters in error messages.
SHOWN_CHARS = 100


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """What one request may cost to decode.

    ``max_elements``: tensor elements over all inputs of one request (any datatype).
    ``max_bytes_elements``: BYTES elements over all inputs of one request; each becomes a
    Python object, so this bound is lower.
    ``max_json_depth``: nesting of JSON ``parameters`` (tensor ``data`` may nest only as
    deep as its tensor's rank).
    ``max_json_containers``: lists and objects in a JSON header above a few KiB, counted
    before parsing (parsing a list costs far more than parsing a number).
    """

    max_elements: int = 1 << 24
    max_bytes_elements: int = 1 << 16
    max_json_depth: int = 32
    max_json_containers: int = 1 << 16


DEFAULT_LIMITS = DecodeLimits()


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``repr`` of a client-supplied value, cut to ``limit`` characters for error messages."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) > limit:
        return f"{text[:limit]}... ({len(text)} characters)"
    return text


def check_name(value: str, where: str, limit: int = MAX_NAME_CHARS) -> str:
    """``value`` if it is at most ``limit`` characters long; else InvalidInput naming
    ``where``."""
    if len(value) > limit:
        raise InvalidInput(f"{where}: {len(value)} characters, longer than the limit of {limit}")
    return value


def shown_name(name: str, limit: int = SHOWN_CHARS) -> str:
    """A client-supplied name for an error message: quoted, cut to ``limit`` characters."""
    if len(name) > limit:
        return f"'{name[:limit]}...' ({len(name)} characters)"
    return f"'{name}'"


def limits_for_model(
    inputs: Iterable[Any], max_batch_size: int, base: DecodeLimits = DEFAULT_LIMITS
) -> DecodeLimits:
    """``base`` tightened to what a model can accept, when its input shapes are static.

    ``inputs``: the model's input specs (``.datatype``, ``.shape`` per row when
    ``max_batch_size`` > 0; -1 is any size). With every dimension known, a request
    holding more elements than the largest batch is refused before it is parsed.
    """
    rows = max(1, max_batch_size)
    total = 0
    total_bytes = 0
    for spec in inputs:
        dims = tuple(spec.shape)
        if any(d < 0 for d in dims):
            return base
        n = rows
        for d in dims:
            n *= d
        total += n
        if spec.datatype == "BYTES":
            total_bytes += n
    return replace(
        base,
        max_elements=min(base.max_elements, total),
        max_bytes_elements=min(base.max_bytes_elements, total_bytes),
    )


class ElementBudget:
    """Counts a request's tensor elements (and BYTES elements) against its limits as each
    input's shape is read, before anything is allocated for it."""

    __slots__ = ("limits", "elements", "bytes_elements")

    def __init__(self, limits: DecodeLimits) -> None:
        self.limits = limits
        self.elements = 0
        self.bytes_elements = 0

    def charge(self, where: str, shape: tuple[int, ...], count: int, is_bytes: bool) -> None:
        limits = self.limits
        if count == 0:  # (a 0 beside huge dimensions: numpy cannot even shape it)
            n = 1
            for d in shape:
                n *= d or 1
                if n > limits.max_elements:
                    raise InvalidInput(
                        f"{where}.shape: {list(shape)[:8]} has no elements, but its other "
                        f"dimensions multiply to over {limits.max_elements} (max_elements); "
                        "expected smaller dimensions"
                    )
        self.elements += count
        if self.elements > limits.max_elements:
            raise PayloadTooLarge(
                f"{where}.shape: {list(shape)} brings the request to {self.elements} elements, "
                f"over the limit of {limits.max_elements} (max_elements)"
            )
        if is_bytes:
            if limits.max_bytes_elements == 0:  # (limits_for_model: no input takes BYTES)
                raise InvalidInput(f"{where}: datatype BYTES, but no input of the model is BYTES")
            self.bytes_elements += count
            if self.bytes_elements > limits.max_bytes_elements:
                raise PayloadTooLarge(
                    f"{where}.shape: {list(shape)} brings the request to "
                    f"{self.bytes_elements} BYTES elements, over the limit of "
                    f"{limits.max_bytes_elements} (max_bytes_elements)"
                )


def check_bools(arr: Any, where: str, what: str) -> None:
    """BOOL data read as raw bytes (binary data, raw contents, shared memory) holds only the
    bytes 0 and 1 (numpy would take any byte as a bool); ``what`` names where it came from."""
    if arr.size and bool((arr.view("u1") > 1).any()):
        raise InvalidInput(f"{where}: BOOL {what} other than 0 and 1")
