"""Conversions between the gRPC messages and the in-memory request and response types."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rtserve.errors import InvalidInput
from rtserve.protocol import grpc_service_pb2 as pb
from rtserve.protocol.http_codec import decode_bytes_elements, encode_bytes_elements
from rtserve.protocol.types import (
    DATATYPE_TO_NUMPY,
    InferRequest,
    InferResponse,
    RequestedOutput,
    Tensor,
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


def parameters_to_dict(params: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in params.items():
        choice = value.WhichOneof("parameter_choice")
        if choice is not None:
            out[key] = getattr(value, choice)
    return out


def decode_model_infer(request: pb.ModelInferRequest) -> InferRequest:
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidInput(
            f"raw_input_contents: {len(raw)} entries for {len(request.inputs)} inputs "
            "(expected one per input)"
        )
    inputs: list[Tensor] = []
    for i, inp in enumerate(request.inputs):
        name = inp.name
        where = f"input '{name}'" if name else f"inputs[{i}]"
        if not name:
            raise InvalidInput(f"inputs[{i}].name: expected a non-empty string")
        datatype = inp.datatype
        dtype = DATATYPE_TO_NUMPY.get(datatype)
        if dtype is None:
            raise InvalidInput(
                f"{where}.datatype: expected one of {', '.join(DATATYPE_TO_NUMPY)}, got {datatype!r}"
            )
        shape = tuple(inp.shape)
        if any(d < 0 for d in shape):
            raise InvalidInput(f"{where}.shape: dimensions must be >= 0, got {list(shape)}")
        count = math.prod(shape)
        if raw:
            buf = raw[i]
            if datatype == "BYTES":
                arr = decode_bytes_elements(memoryview(buf), count, where)
            else:
                expected = count * dtype.itemsize
                if len(buf) != expected:
                    raise InvalidInput(
                        f"{where}: raw_input_contents has {len(buf)} bytes, shape {list(shape)} "
                        f"of {datatype} needs {expected}"
                    )
                arr = np.frombuffer(buf, dtype=dtype, count=count)
        else:
            field = _CONTENTS_FIELD.get(datatype)
            if field is None:
                raise InvalidInput(
                    f"{where}: {datatype} tensors must be sent in raw_input_contents"
                )
            values = getattr(inp.contents, field)
            if len(values) != count:
                raise InvalidInput(
                    f"{where}.contents.{field}: has {len(values)} elements, shape {list(shape)} "
                    f"needs {count}"
                )
            if datatype == "BYTES":
                arr = np.empty(count, dtype=object)
                arr[:] = list(values)
            else:
                try:
                    arr = np.array(values, dtype=dtype)
                except (OverflowError, ValueError) as exc:
                    raise InvalidInput(f"{where}.contents.{field}: {exc}") from None
        inputs.append(Tensor(name, datatype, shape, arr.reshape(shape)))
    outputs = None
    if request.outputs:
        outputs = [RequestedOutput(o.name) for o in request.outputs]
    return InferRequest(
        model_name=request.model_name,
        model_version=request.model_version,
        inputs=inputs,
        outputs=outputs,
        id=request.id,
        parameters=parameters_to_dict(request.parameters) if request.parameters else {},
    )


def encode_model_infer(response: InferResponse) -> pb.ModelInferResponse:
    msg = pb.ModelInferResponse(
        model_name=response.model_name, model_version=response.model_version, id=response.id
    )
    for t in response.outputs:
        arr = t.data
        msg.outputs.add(name=t.name, datatype=t.datatype, shape=arr.shape)
        if t.datatype == "BYTES":
            msg.raw_output_contents.append(encode_bytes_elements(arr))
        else:
            msg.raw_output_contents.append(np.ascontiguousarray(arr).tobytes())
    return msg
