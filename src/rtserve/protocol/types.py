"""In-memory request and response types shared by the HTTP and gRPC frontends.

Tensors are numpy arrays already shaped and typed (BYTES tensors are object arrays of
``bytes``); frontends decode into these and the dataplane never sees wire formats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rtserve.errors import InvalidInput

# V2 datatype name -> numpy dtype. BYTES is an object array of bytes.
DATATYPE_TO_NUMPY: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}
NUMPY_TO_DATATYPE: dict[np.dtype[Any], str] = {v: k for k, v in DATATYPE_TO_NUMPY.items()}


# Tensor.parameters key of an input the server added from a request parameter (a row
# parameter, ``exit_threshold``): the response cache keys on it exactly.
ROW_PARAMETER = "rtserve_row_parameter"


@dataclass(slots=True)
class Tensor:
    """A named tensor: V2 datatype, full shape (batch dimension included) and its data."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: np.ndarray
    parameters: dict[str, Any] | None = None


@dataclass(slots=True)
class RequestedOutput:
    name: str
    binary: bool | None = None  # None: the request-wide default applies
    # The classification extension: the top N classes of this output, as "value:index[:label]"
    # strings, instead of the tensor (0: the tensor).
    classification: int = 0
    # The system shared memory extension: where in a registered region to write this output
    # (a ``protocol.shared_memory.OutputRegion``; None: in the response).
    shared_memory: Any = None


def classification_count(value: Any, where: str) -> int:
    """An output's ``classification`` parameter: a positive number of classes (0: none)."""
    if type(value) is not int or value < 0:
        raise InvalidInput(
            f"{where}: expected a positive integer (how many top classes to return), "
            f"got {str(value)[:40]!r}"
        )
    return value


@dataclass(slots=True)
class Timings:
    """Per-stage timestamps (time.perf_counter_ns) of one request and what identifies it
    for logs and traces; read by metrics, the access log and the tracer after send."""

    received: int = 0
    enqueued: int = 0
    batch_start: int = 0
    batch_end: int = 0
    done: int = 0  # the answer was ready (encoding starts)
    batch_size: int = 0
    cache: str = ""  # "", "memory", "redis"
    request_id: str = ""  # the client's x-request-id, echoed back
    traceparent: str = ""  # the client's W3C trace context
    prompt_tokens: int = 0  # a generation's prompt, in tokens (0: not a generation)
    completion_tokens: int = 0  # the tokens it generated


@dataclass(slots=True)
class InferRequest:
    model_name: str
    model_version: str  # "" means the default (latest ready) version
    inputs: list[Tensor]
    outputs: list[RequestedOutput] | None = None  # None: every output
    id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    timings: Timings = field(default_factory=Timings)


@dataclass(slots=True)
class InferResponse:
    model_name: str
    model_version: str
    outputs: list[Tensor]
    id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
