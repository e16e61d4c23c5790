"""Conversions between the gRPC messages and the in-memory request and response types.

Decoding follows the same budget as the HTTP codec (:class:`DecodeLimits`): element
counts are checked against the bytes present and the limits before any allocation, typed
``contents`` must fit the datatype's range, and a decode error carries no traceback into
the decoder's frames (so an error answer never pins the buffers it was decoding).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from rtserve.errors import InvalidInput, RTServeError
from rtserve.protocol import grpc_service_pb2 as pb
from rtserve.protocol.bytes_codec import decode_bytes_elements, encode_bytes_elements
from rtserve.protocol.limits import (
    DEFAULT_LIMITS,
    MAX_ID_CHARS,
    MAX_NDIM,
    DecodeLimits,
    ElementBudget,
    check_bools,
    check_name,
    shown,
    shown_name,
)
from rtserve.protocol.shared_memory import BYTE_SIZE, OFFSET, REGION, SharedMemoryRegions, disabled
from rtserve.protocol.types import (
    DATATYPE_TO_NUMPY,
    InferRequest,
    InferResponse,
    RequestedOutput,
    Tensor,
    classification_count,
)

# Which InferTensorContents field carries each datatype when raw contents are not used.
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
# The wide type of each contents field, before narrowing to the datatype.
_CONTENTS_DTYPE: dict[str, np.dtype[Any]] = {
    "int_contents": np.dtype(np.int32),
    "int64_contents": np.dtype(np.int64),
    "uint_contents": np.dtype(np.uint32),
    "uint64_contents": np.dtype(np.uint64),
    "fp32_contents": np.dtype(np.float32),
    "fp64_contents": np.dtype(np.float64),
    "bool_contents": np.dtype(np.bool_),
}
_NARROW = frozenset({"INT8", "INT16", "UINT8", "UINT16"})


def parameters_to_dict(params: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in params.items():
        choice = value.WhichOneof("parameter_choice")
        if choice is not None:
            out[key] = getattr(value, choice)
    return out


def parse_model_infer(data: bytes) -> pb.ModelInferRequest:
    """A serialized ModelInferRequest; a malformed one is InvalidInput (INVALID_ARGUMENT).

    Register the RPC with no request deserializer (the handler gets bytes) and call this,
    or pass the bytes to :func:`decode_model_infer`, so that a bad message gets an answer
    instead of an UNKNOWN status and a logged traceback.
    """
    try:
        return pb.ModelInferRequest.FromString(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise InvalidInput(
            f"request is not a valid inference.ModelInferRequest message: {shown(str(exc))}"
        ) from None


def decode_model_infer(
    request: pb.ModelInferRequest | bytes,
    limits: DecodeLimits = DEFAULT_LIMITS,
    shm: SharedMemoryRegions | None = None,
) -> InferRequest:
    """Decode a ModelInferRequest (or its serialized bytes); raises 4xx RTServeErrors.

    ``shm``: the registered system shared memory regions (None: the extension is off, and
    a tensor that names a region is refused)."""
    try:
        if isinstance(request, bytes | bytearray | memoryview):
            request = parse_model_infer(bytes(request))
        return _decode(request, limits, shm)
    except RTServeError as exc:
        # Drop the decoder's frames (and the arrays they hold) from the error.
        raise exc.with_traceback(None) from None


def _decode(
    request: pb.ModelInferRequest, limits: DecodeLimits, shm: SharedMemoryRegions | None
) -> InferRequest:
    check_name(request.model_name, "model_name")
    check_name(request.model_version, "model_version")
    check_name(request.id, "id", MAX_ID_CHARS)
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        # Inputs in shared memory have no raw contents (as in Triton).
        in_shm = sum(1 for inp in request.inputs if REGION in inp.parameters)
        if len(raw) != len(request.inputs) - in_shm:
            raise InvalidInput(
                f"raw_input_contents: {len(raw)} entries for {len(request.inputs) - in_shm} "
                "inputs (expected one per input not in shared memory)"
            )
    budget = ElementBudget(limits)
    inputs: list[Tensor] = []
    next_raw = 0
    for i, inp in enumerate(request.inputs):
        name = inp.name
        if not name:
            raise InvalidInput(f"inputs[{i}].name: expected a non-empty string")
        check_name(name, f"inputs[{i}].name")
        where = f"input {shown_name(name)}"
        datatype = inp.datatype
        dtype = DATATYPE_TO_NUMPY.get(datatype)
        if dtype is None:
            raise InvalidInput(
                f"{where}.datatype: expected one of {', '.join(DATATYPE_TO_NUMPY)}, "
                f"got {shown(datatype)!r}"
            )
        if len(inp.shape) > MAX_NDIM:
            raise InvalidInput(f"{where}.shape: more than {MAX_NDIM} dimensions")
        shape = tuple(inp.shape)
        if any(d < 0 for d in shape):
            raise InvalidInput(f"{where}.shape: dimensions must be >= 0, got {list(shape)}")
        count = math.prod(shape)
        budget.charge(where, shape, count, datatype == "BYTES")
        if inp.parameters and REGION in inp.parameters:
            if inp.HasField("contents") and inp.contents.ListFields():
                raise InvalidInput(
                    f"{where}: both contents and parameters.{REGION} given (send one)"
                )
            if shm is None:
                raise disabled(where)
            arr = shm.read_input(
                parameters_to_dict(inp.parameters),
                datatype,
                shape,
                count,
                where,
                limits.max_bytes_elements,
            )
        elif raw:
            if inp.HasField("contents") and inp.contents.ListFields():
                raise InvalidInput(
                    f"{where}: both contents and raw_input_contents given (send one or the other)"
                )
            buf = raw[next_raw]
            next_raw += 1
            if datatype == "BYTES":
                arr = decode_bytes_elements(
                    memoryview(buf), count, f"{where}.raw_input_contents", count
                )
            else:
                expected = count * dtype.itemsize
                if len(buf) != expected:
                    raise InvalidInput(
                        f"{where}: raw_input_contents has {len(buf)} bytes, shape {list(shape)} "
                        f"of {datatype} needs {expected}"
                    )
                arr = np.frombuffer(buf, dtype=dtype, count=count)
                if datatype == "BOOL":
                    check_bools(arr, where, "raw contents hold bytes")
        else:
            arr = _from_contents(inp, datatype, count, where)
        inputs.append(Tensor(name, datatype, shape, arr.reshape(shape)))
    if next_raw != len(raw) and raw:
        raise InvalidInput(
            f"raw_input_contents: {len(raw)} entries for {next_raw} inputs not in shared "
            f"memory (an input in a {REGION} has no raw contents)"
        )
    outputs = None
    if request.outputs:
        outputs = []
        for i, o in enumerate(request.outputs):
            top = 0
            region = None
            if "classification" in o.parameters:
                value = parameters_to_dict(o.parameters).get("classification")
                top = classification_count(value, f"outputs[{i}].parameters.classification")
            if REGION in o.parameters:
                where = f"output {shown_name(o.name)}"
                if shm is None:
                    raise disabled(where)
                if top:
                    raise InvalidInput(
                        f"{where}: has parameters.{REGION} and classification (send one)"
                    )
                region = shm.output_region(parameters_to_dict(o.parameters), where)
            name = check_name(o.name, f"outputs[{i}].name")
            outputs.append(RequestedOutput(name, None, top, region))
    return InferRequest(
        model_name=request.model_name,
        model_version=request.model_version,
        inputs=inputs,
        outputs=outputs,
        id=request.id,
        parameters=parameters_to_dict(request.parameters) if request.parameters else {},
    )


def _from_contents(inp: Any, datatype: str, count: int, where: str) -> np.ndarray[Any, Any]:
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        raise InvalidInput(f"{where}: {datatype} tensors must be sent in raw_input_contents")
    values = getattr(inp.contents, field)
    if len(values) != count:
        raise InvalidInput(
            f"{where}.contents.{field}: has {len(values)} elements, shape needs {count}"
        )
    if datatype == "BYTES":
        arr = np.empty(count, dtype=object)
        arr[:] = list(values)
        return arr
    wide = np.array(values, dtype=_CONTENTS_DTYPE[field])
    if datatype in _NARROW and count:
        info = np.iinfo(DATATYPE_TO_NUMPY[datatype])
        bad = np.flatnonzero((wide < info.min) | (wide > info.max))
        if bad.size:
            j = int(bad[0])
            raise InvalidInput(
                f"{where}.contents.{field}[{j}]: {wide[j]} is out of range for {datatype} "
                f"({info.min} to {info.max})"
            )
    return wide.astype(DATATYPE_TO_NUMPY[datatype], copy=False)


def encode_model_infer(
    response: InferResponse, in_shared_memory: dict[str, dict[str, Any]] | None = None
) -> pb.ModelInferResponse:
    """The response message. ``in_shared_memory``: the outputs already written into shared
    memory regions, by name: each carries these parameters and empty raw contents (one
    entry per output, as Triton sends)."""
    msg = pb.ModelInferResponse(
        model_name=response.model_name, model_version=response.model_version, id=response.id
    )
    for t in response.outputs:
        arr = t.data
        out = msg.outputs.add(name=t.name, datatype=t.datatype, shape=arr.shape)
        if in_shared_memory is not None and t.name in in_shared_memory:
            shm_params = in_shared_memory[t.name]
            out.parameters[REGION].string_param = shm_params[REGION]
            out.parameters[BYTE_SIZE].int64_param = shm_params[BYTE_SIZE]
            if OFFSET in shm_params:
                out.parameters[OFFSET].int64_param = shm_params[OFFSET]
            msg.raw_output_contents.append(b"")
        elif t.datatype == "BYTES":
            msg.raw_output_contents.append(encode_bytes_elements(arr))
        else:
            msg.raw_output_contents.append(np.ascontiguousarray(arr).tobytes())
    return msg
