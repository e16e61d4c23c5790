"""Request parameters that a runtime reads per row (``exit_threshold`` of an early-exit model).

A runtime that takes one declares ``row_parameters``; the dataplane checks the request's
value (or takes the default) and hands it over as one extra FP32 feed of shape ``[rows]``
named after the parameter. The batcher concatenates it like any input, so every row of a
batch keeps its own request's value, and no scheduler or runtime interface changes. A model
without row parameters pays one attribute test per request.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rtserve.errors import InvalidInput
from rtserve.protocol.types import ROW_PARAMETER, InferRequest, Tensor


@dataclass(frozen=True, slots=True)
class RowParameter:
    """A number in ``[minimum, maximum]``; ``meaning`` completes the error message."""

    name: str
    default: float
    minimum: float = 0.0
    maximum: float = 1.0
    meaning: str = ""

    def value(self, given: Any) -> float:
        """The request's value (``given``; None: absent), checked."""
        if given is None:
            return self.default
        if (
            isinstance(given, bool)
            or not isinstance(given, int | float)
            or not math.isfinite(given)
            or not self.minimum <= given <= self.maximum
        ):
            about = f" ({self.meaning})" if self.meaning else ""
            raise InvalidInput(
                f"parameters.{self.name}: expected a number from {self.minimum:g} to "
                f"{self.maximum:g}{about}, got {given!r:.100}"
            )
        return float(given)


def row_feeds(
    params: tuple[RowParameter, ...],
    values: Mapping[str, Any],
    feeds: dict[str, np.ndarray],
    rows: int,
) -> dict[str, np.ndarray]:
    """``feeds`` plus one ``[rows]`` FP32 array per parameter (``values`` or the default)."""
    out = dict(feeds)
    for p in params:
        out[p.name] = np.full(rows, p.value(values.get(p.name)), np.float32)
    return out


def add_row_parameters(
    params: tuple[RowParameter, ...],
    request: InferRequest,
    feeds: dict[str, np.ndarray],
    rows: int,
) -> dict[str, np.ndarray]:
    """:func:`row_feeds` for a decoded request; the arrays also join ``request.inputs`` so
    that the response cache keys on them (two thresholds, two answers)."""
    out = row_feeds(params, request.parameters, feeds, rows)
    for p in params:
        arr = out[p.name]
        # (marked: the cache's round_floats must not merge two thresholds' answers)
        request.inputs.append(Tensor(p.name, "FP32", arr.shape, arr, {ROW_PARAMETER: True}))
    return out
