"""V2 HTTP/REST codec: JSON tensors and the binary tensor data extension.

A request body is a JSON header, optionally followed by raw tensor bytes; the header's
length comes in the ``Inference-Header-Content-Length`` HTTP header. Binary inputs become
numpy arrays over the body without a copy.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
import orjson

from rtserve.errors import InvalidInput
from rtserve.protocol.types import (
    DATATYPE_TO_NUMPY,
    InferRequest,
    InferResponse,
    RequestedOutput,
    Tensor,
)

_JSON_OPTS = orjson.OPT_SERIALIZE_NUMPY
_U32 = struct.Struct("<I")


def _fail(where: str, message: str) -> InvalidInput:
    return InvalidInput(f"{where}: {message}")


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or any(
        isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in value
    ):
        raise _fail(f"{where}.shape", f"expected a list of non-negative integers, got {value!r}")
    return tuple(value)


def _flatten(data: Any) -> list[Any]:
    if not isinstance(data, list):
        return [data]
    out: list[Any] = []
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        else:
            out.append(item)
    return out


def decode_bytes_elements(buf: memoryview, count: int, where: str) -> np.ndarray:
    """BYTES tensors in binary form: each element is a 4-byte little-endian length + bytes."""
    out = np.empty(count, dtype=object)
    pos = 0
    n = len(buf)
    for i in range(count):
        if pos + 4 > n:
            raise _fail(where, f"BYTES data ends inside element {i} (expected {count} elements)")
        (length,) = _U32.unpack_from(buf, pos)
        pos += 4
        if pos + length > n:
            raise _fail(where, f"BYTES element {i} claims {length} bytes but the data ends first")
        out[i] = bytes(buf[pos : pos + length])
        pos += length
    if pos != n:
        raise _fail(where, f"BYTES data has {n - pos} bytes beyond its {count} elements")
    return out


def encode_bytes_elements(arr: np.ndarray) -> bytes:
    parts = []
    for item in arr.reshape(-1):
        b = item if isinstance(item, bytes) else str(item).encode()
        parts.append(_U32.pack(len(b)))
        parts.append(b)
    return b"".join(parts)


def _json_array(data: Any, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    count = math.prod(shape)
    if datatype == "BYTES":
        flat = _flatten(data)
        if len(flat) != count:
            raise _fail(
                f"{where}.data", f"has {len(flat)} elements, shape {list(shape)} needs {count}"
            )
        arr = np.empty(count, dtype=object)
        for i, item in enumerate(flat):
            if isinstance(item, str):
                arr[i] = item.encode()
            else:
                raise _fail(f"{where}.data", f"BYTES elements must be strings, got {item!r}")
        return arr.reshape(shape)
    dtype = DATATYPE_TO_NUMPY[datatype]
    if type(data) is list and len(data) == count and count and type(data[0]) is float:
        # The common case, a flat list of floats: fromiter skips numpy's nesting checks.
        try:
            return np.fromiter(data, dtype=dtype, count=count).reshape(shape)
        except (ValueError, TypeError):
            pass  # mixed content: let np.array report it below
    try:
        arr = np.array(data, dtype=dtype)
    except (ValueError, TypeError, OverflowError) as exc:
        raise _fail(
            f"{where}.data", f"expected a (nested) list of {datatype} numbers: {exc}"
        ) from None
    if arr.size != count:
        raise _fail(f"{where}.data", f"has {arr.size} elements, shape {list(shape)} needs {count}")
    if datatype != "BOOL" and arr.size and _has_non_numbers(data):
        raise _fail(f"{where}.data", f"expected {datatype} numbers")
    return arr.reshape(shape)


def _has_non_numbers(data: Any) -> bool:
    """numpy quietly turns True into 1; V2 numeric tensors must hold numbers."""
    first = data
    while isinstance(first, list) and first:
        first = first[0]
    return isinstance(first, bool)


def decode_infer_request(
    body: bytes, header_length: int | None, model_name: str, model_version: str
) -> InferRequest:
    if header_length is None:
        header_length = len(body)
    elif header_length < 0 or header_length > len(body):
        raise InvalidInput(
            f"Inference-Header-Content-Length: {header_length} is outside the body of {len(body)} bytes"
        )
    try:
        doc = orjson.loads(memoryview(body)[:header_length])
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidInput("request body: expected a JSON object with an 'inputs' list")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidInput("inputs: expected a non-empty list of tensors")
    binary = memoryview(body)[header_length:]
    offset = 0
    inputs: list[Tensor] = []
    for i, item in enumerate(raw_inputs):
        where = f"inputs[{i}]"
        if not isinstance(item, dict):
            raise _fail(where, "expected an object with name, shape, datatype and data")
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise _fail(f"{where}.name", f"expected a non-empty string, got {name!r}")
        where = f"input '{name}'"
        datatype = item.get("datatype")
        dtype = DATATYPE_TO_NUMPY.get(datatype) if isinstance(datatype, str) else None
        if dtype is None:
            raise _fail(
                f"{where}.datatype",
                f"expected one of {', '.join(DATATYPE_TO_NUMPY)}, got {datatype!r}",
            )
        assert isinstance(datatype, str)
        shape = _shape(item.get("shape"), where)
        params = item.get("parameters")
        size = params.get("binary_data_size") if isinstance(params, dict) else None
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise _fail(
                    f"{where}.parameters.binary_data_size", f"expected a byte count, got {size!r}"
                )
            if offset + size > len(binary):
                raise _fail(
                    f"{where}.parameters.binary_data_size",
                    f"{size} bytes requested but only {len(binary) - offset} binary bytes remain",
                )
            chunk = binary[offset : offset + size]
            offset += size
            count = math.prod(shape)
            if datatype == "BYTES":
                arr = decode_bytes_elements(chunk, count, where).reshape(shape)
            else:
                expected = count * dtype.itemsize
                if size != expected:
                    raise _fail(
                        f"{where}.parameters.binary_data_size",
                        f"{size} bytes do not match shape {list(shape)} of {datatype} "
                        f"({expected} bytes)",
                    )
                arr = np.frombuffer(chunk, dtype=dtype, count=count).reshape(shape)
                if not arr.flags.aligned:
                    arr = arr.copy()
        else:
            if "data" not in item:
                raise _fail(where, "has neither 'data' nor parameters.binary_data_size")
            arr = _json_array(item["data"], datatype, shape, where)
        inputs.append(Tensor(name, datatype, shape, arr))
    if offset != len(binary):
        raise InvalidInput(
            f"binary data: {len(binary) - offset} bytes after the last input's binary_data_size"
        )
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidInput("parameters: expected an object")
    outputs = None
    raw_outputs = doc.get("outputs")
    if raw_outputs is not None:
        if not isinstance(raw_outputs, list):
            raise InvalidInput("outputs: expected a list of {name, parameters}")
        outputs = []
        for i, out in enumerate(raw_outputs):
            if not isinstance(out, dict) or not isinstance(out.get("name"), str):
                raise InvalidInput(f"outputs[{i}].name: expected a string")
            op = out.get("parameters")
            flag = op.get("binary_data") if isinstance(op, dict) else None
            outputs.append(RequestedOutput(out["name"], flag if isinstance(flag, bool) else None))
    req_id = doc.get("id", "")
    return InferRequest(
        model_name=model_name,
        model_version=model_version,
        inputs=inputs,
        outputs=outputs,
        id=req_id if isinstance(req_id, str) else str(req_id),
        parameters=params,
    )


def encode_infer_response(
    response: InferResponse, request: InferRequest
) -> tuple[bytes, int | None]:
    """The response body and, when it carries binary tensors, the JSON header's length."""
    binary_default = request.parameters.get("binary_data_output") is True
    flags: dict[str, bool | None] = (
        {o.name: o.binary for o in request.outputs} if request.outputs else {}
    )
    blobs: list[bytes] = []
    outs: list[dict[str, Any]] = []
    for t in response.outputs:
        arr = t.data
        flag = flags.get(t.name)
        as_binary = binary_default if flag is None else flag
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": arr.shape}
        if as_binary:
            blob = (
                encode_bytes_elements(arr)
                if t.datatype == "BYTES"
                else np.ascontiguousarray(arr).tobytes()
            )
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        elif t.datatype == "BYTES":
            entry["data"] = [
                b.decode("utf-8", "replace") if isinstance(b, bytes) else str(b)
                for b in arr.reshape(-1)
            ]
        else:
            entry["data"] = np.ascontiguousarray(arr).reshape(-1)
        outs.append(entry)
    doc: dict[str, Any] = {
        "model_name": response.model_name,
        "model_version": response.model_version,
        "outputs": outs,
    }
    if response.id:
        doc["id"] = response.id
    if response.parameters:
        doc["parameters"] = response.parameters
    header = orjson.dumps(doc, option=_JSON_OPTS)
    if not blobs:
        return header, None
    return header + b"".join(blobs), len(header)
